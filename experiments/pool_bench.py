"""Side-by-side overhead benchmark: ``python -m hetflow.experiments.pool_bench [runtimes...]``.

Runs, through the normal ``mpi_app`` + Parsl DFK path, on each runtime in turn:
- latency: N no-op 2-rank tasks one after another; per-task overhead is the mean
  of TaskTimes.overhead_s (submit to delivery, minus time in the function);
- throughput: N no-op 2-rank tasks submitted at once; tasks/s over the whole batch.
Prints one table, then each runtime's sequential overhead by part (mean, median, p95: which
part makes the mean exceed the median) with the client's garbage collections meanwhile, and
the ratios against mpirun. Never fails on a time: it only reports.

``--auth``: the pool with its message signing on (the default) against the same
build with ``authenticate=False``, in one run, alternating the two ``--rounds``
times (the machine's load drifts) and reporting each one's best round.
``--samples S``: the same for every rank sampling its resource use every S seconds
(``hetflow.runtime(sample_s=S)``, hetflow.executors.monitoring) against sampling off.
``--output``: the same for the ranks' output forwarded (to a stream: the console's path,
writing to /dev/null) against ``output="off"``, each rank printing one line per task.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import hetflow


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return None


@hetflow.mpi_app(ranks=2)
def say(comm):
    print("a line from rank", comm.Get_rank())


def measure(name: str, n: int, options: dict, app=noop) -> dict:
    t0 = time.perf_counter()
    from hetflow.executors.runtime_cpu import RuntimeCPU

    with hetflow.runtime(name, **options) as dfk:
        start_s = time.perf_counter() - t0
        app().result()                                       # warm: imports on the ranks
        overheads, parts = [], []
        cpu = RuntimeCPU(dfk.hetflow_token)    # the CPU of the client and all it started
        collections = gc.get_stats()
        cpu.start()
        t = time.perf_counter()
        for _ in range(n):
            fut = app()
            fut.result()
            times = hetflow.task_times(fut)
            overheads.append(times.overhead_s)
            parts.append(_parts(times))
        sequential_s = time.perf_counter() - t
        cpu_ms = 1e3 * cpu.stop()["cpu_s"] / n
        collected = [b["collections"] - a["collections"]
                     for a, b in zip(collections, gc.get_stats())]
        t = time.perf_counter()
        futs = [app() for _ in range(n)]
        for fut in futs:
            fut.result()
        batch_s = time.perf_counter() - t
    return {"runtime": name, "start_s": start_s,
            "overhead_ms": 1e3 * statistics.mean(overheads),
            "overhead_p50_ms": 1e3 * statistics.median(overheads),
            "sequential_ms": 1e3 * sequential_s / n, "cpu_ms": cpu_ms,
            "tasks_per_s": n / batch_s, "gc_collections": collected,
            "parts_ms": {name: [1e3 * p[i] for p in parts] for i, name in enumerate(PARTS)}}


#: Where a sequential task's overhead goes (``TaskTimes``): the client until its ranks were
#: sent it, until rank 0 entered the function (delivery, unpickling, waiting for its peers),
#: from rank 0's return until the client had every rank's outcome, and until the future's
#: result was set. Their means against their medians say which part makes the slow tail.
PARTS = ("submit->sent", "sent->rank 0 in", "rank 0 out->all back", "all back->delivered")


def _parts(times) -> tuple:
    back = max(times.returned.values(), default=float("nan"))
    return (times.launched - times.submitted, times.started - times.launched,
            back - times.finished, times.delivered - back)


def print_parts(row: dict) -> None:
    """The overhead's parts (mean, p50, p95 in ms) and the client's collections by generation."""
    print(f"{row['runtime']}: overhead by part, ms (mean / p50 / p95); the client's garbage "
          f"collections by generation over the {len(row['parts_ms'][PARTS[0]])} tasks: "
          f"{row['gc_collections']}")
    for name, values in row["parts_ms"].items():
        values = [v for v in values if v == v]          # a runtime without the stamp: NaN
        if len(values) >= 2:
            print(f"  {name:22} {statistics.mean(values):7.3f} {statistics.median(values):7.3f} "
                  f"{statistics.quantiles(values, n=20)[18]:7.3f}")


@hetflow.mpi_app(ranks=1)
def join_task(comm, rows):
    from hetflow import frame

    per_rank = rows // comm.Get_size()
    left = frame.generate(comm, per_rank, seed=1)
    right = frame.generate(comm, per_rank, seed=2)
    return frame.join(left, right, on="key").num_rows()


#: The mixed workload: 8 joins of 1 and 2 ranks over 0.1M-1M rows (total over the ranks).
MIXED = [(ranks, rows) for rows in (100_000, 250_000, 500_000, 1_000_000) for ranks in (1, 2)]


def measure_mixed(name: str, options: dict) -> dict:
    with hetflow.runtime(name, **options):
        join_task.options(ranks=2)(1000).result()            # warm: engine imports on the ranks
        t = time.perf_counter()
        futs = [join_task.options(ranks=r)(rows) for r, rows in MIXED]
        results = [f.result() for f in futs]
        return {"runtime": name, "mixed_s": time.perf_counter() - t, "rows": results}


@hetflow.mpi_app(ranks=2)
def join_keep(comm, rows):
    from hetflow import frame

    left = frame.generate(comm, rows // 2, seed=1)
    right = frame.generate(comm, rows // 2, seed=2)
    return hetflow.keep(frame.join(left, right, on="key"))


@hetflow.mpi_app(ranks=2)
def join_gather(comm, rows):
    from hetflow import frame

    left = frame.generate(comm, rows // 2, seed=1)
    right = frame.generate(comm, rows // 2, seed=2)
    return frame.join(left, right, on="key").gather()


@hetflow.mpi_app(ranks=2)
def sort_rows(comm, table):
    from hetflow import frame

    if not isinstance(table, frame.DistributedTable):   # came through the client: scatter it
        table = frame.from_local(comm, table if comm.Get_rank() == 0 else table.slice(0, 0))
    return frame.sort(table, "key").num_rows()


def measure_pipeline(name: str, rows: int, options: dict) -> dict:
    """join -> sort as two tasks: resident in the pool, through the client elsewhere."""
    with hetflow.runtime(name, **options):
        sort_rows(join_gather(1000)).result()                # warm
        t = time.perf_counter()
        first = join_keep(rows) if name == "pool" else join_gather(rows)
        sorted_rows = sort_rows(first).result()
        return {"runtime": name, "pipeline_s": time.perf_counter() - t, "rows": sorted_rows}


def auth_cost(n: int, max_ranks: int, rounds: int) -> int:
    """The pool's per-task overhead and tasks/s with message authentication on and off.

    Each round runs both, in alternating order (on first, then off first), so a drift in
    the machine's load favours neither; the best and the median round of each are shown.
    The HMAC work itself is timed apart: one 2-rank task is four signed messages (a task
    frame to each rank, an outcome from each), each signed by one side, checked by the other.
    """
    on_off("auth", "authentication", n, rounds, {"max_ranks": max_ranks, "authenticate": True},
           {"max_ranks": max_ranks, "authenticate": False})
    print(f"HMAC work per 2-rank task (4 messages signed and checked, timed apart): "
          f"{hmac_work_us():.1f} us")
    return 0


def output_cost(n: int, max_ranks: int, rounds: int) -> int:
    """The pool's per-task overhead and tasks/s with the ranks' output forwarded and off."""
    import os

    with open(os.devnull, "w") as sink:
        on_off("output", "forwarding each rank's line", n, rounds,
               {"max_ranks": max_ranks, "output": sink}, {"max_ranks": max_ranks, "output": "off"},
               app=say)
        on, off = forwarding_work_us(sink, True), forwarding_work_us(sink, False)
    print(f"capture and forwarding work per 2-rank task, timed apart (both ranks' capture "
          f"around a one-line print, the client's last read and clean-up): on {on:.1f} us, "
          f"off {off:.1f} us (stacks and return marks only), on/off x{on / off:.2f}")
    return 0


def forwarding_work_us(sink, output: bool, repeat: int = 500) -> float:
    """Microseconds of the files-dir work one 2-rank task costs with ``output`` on or off,
    without MPI or scheduling: what the rank runner and the kernel add around a task."""
    import contextlib
    import os
    import shutil
    import threading
    import types

    from hetflow.executors import rankio
    from hetflow.executors._rankio import Capture

    lock = threading.Lock()
    best = float("inf")
    root = rankio.node_root("/nonexistent", "bench")     # where the kernel puts them
    # Off, the ranks' print goes to the bench's stdout: to the sink instead.
    with contextlib.redirect_stdout(sink if not output else sys.stdout):
        for _ in range(3):
            t = time.perf_counter()
            for i in range(repeat):
                task = types.SimpleNamespace(id=i, resources=types.SimpleNamespace(ranks=2),
                                             times=types.SimpleNamespace(returned={},
                                                                         launched=0.0),
                                             done=False)
                folder = rankio.private_dir(os.path.join(root, f"task-{i}"))
                files = rankio.TaskFiles(task, "bench", (folder,), sink if output else "off",
                                         root, lock)
                for rank in (0, 1):
                    with Capture(folder, rank, output):
                        print("a line from rank", rank)
                files.close(success=True)
            best = min(best, (time.perf_counter() - t) / repeat * 1e6)
    shutil.rmtree(root, ignore_errors=True)
    return best


def on_off(label: str, what: str, n: int, rounds: int, on: dict, off: dict, app=noop) -> None:
    """The pool with options ``on`` and ``off``, alternating rounds; best and median rounds."""
    runs = {"on": [], "off": []}
    for i in range(rounds):
        for key in (("on", "off") if i % 2 == 0 else ("off", "on")):
            runs[key].append(measure("pool", n, on if key == "on" else off, app=app))
    fields = (("overhead_ms", min), ("overhead_p50_ms", min), ("sequential_ms", min),
              ("tasks_per_s", max), ("cpu_ms", min))
    best = {k: {f: pick(r[f] for r in v) for f, pick in fields} for k, v in runs.items()}
    median = {k: {f: statistics.median(r[f] for r in v) for f, _ in fields}
              for k, v in runs.items()}
    print(f"pool, {n} 2-rank {app.__name__} tasks, {rounds} rounds (order alternating)")
    print(f"{label:12} {'overhead ms':>12} {'p50 ms':>8} {'seq ms/task':>12} {'tasks/s':>9} "
          f"{'CPU ms/task':>12}")
    for label, table in (("best", best), ("median", median)):
        for key in ("on", "off"):
            r = table[key]
            print(f"{key + ' ' + label:12} {r['overhead_ms']:12.3f} {r['overhead_p50_ms']:8.3f} "
                  f"{r['sequential_ms']:12.3f} {r['tasks_per_s']:9.1f} {r['cpu_ms']:12.3f}")
    for key in ("on", "off"):
        print(f"{key} rounds: overhead ms " + ", ".join(f"{r['overhead_ms']:.2f}" for r in runs[key])
              + "; CPU ms/task " + ", ".join(f"{r['cpu_ms']:.2f}" for r in runs[key]))
    for label, table in (("best", best), ("median", median)):
        on, off = table["on"], table["off"]
        print(f"{what} costs ({label}): overhead "
              f"x{on['overhead_ms'] / off['overhead_ms']:.3f} "
              f"(p50 x{on['overhead_p50_ms'] / off['overhead_p50_ms']:.3f}), "
              f"throughput x{on['tasks_per_s'] / off['tasks_per_s']:.3f}, "
              f"CPU per task x{on['cpu_ms'] / off['cpu_ms']:.3f}")


def hmac_work_us(repeat: int = 20000) -> float:
    """Microseconds of signing and checking for one 2-rank no-op task's four messages."""
    import timeit

    from hetflow.executors.pool import wire

    signer = wire.Signer.new()
    ident = wire.identity(0, 1)
    task = [wire.TASK, b"h" * 48, b"p" * 700]             # header, payload (a no-op's size)
    outcome = [wire.OUTCOME, b"t" * 8, b"o" * 300, b""]

    def four():
        for frames in (task, task):
            signer.check(wire.TO_RANK, ident, signer.sign(wire.TO_RANK, ident, frames))
        for frames in (outcome, outcome):
            signer.check(wire.TO_POOL, ident, signer.sign(wire.TO_POOL, ident, frames))

    return min(timeit.repeat(four, number=repeat, repeat=3)) / repeat * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetflow.experiments.pool_bench")
    parser.add_argument("runtimes", nargs="*", default=["pool", "mpirun"])
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--max-ranks", type=int, default=4)
    parser.add_argument("--mixed", action="store_true",
                        help="also the mixed join workload and the join->sort pipeline")
    parser.add_argument("--pipeline-rows", type=int, default=1_000_000)
    parser.add_argument("--auth", action="store_true",
                        help="the pool with authentication on vs off (see the docstring)")
    parser.add_argument("--output", action="store_true",
                        help="the pool with rank output forwarded vs off (see the docstring)")
    parser.add_argument("--samples", type=float, metavar="S",
                        help="the pool with per-rank sampling every S s vs off")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.auth:
        return auth_cost(args.n, args.max_ranks, args.rounds)
    if args.output:
        return output_cost(args.n, args.max_ranks, args.rounds)
    if args.samples is not None:
        with open("/proc/loadavg") as fh:
            print("load average before:", fh.read().split()[:3])
        on_off("samples", f"sampling every {args.samples:g} s", args.n, args.rounds,
               {"max_ranks": args.max_ranks, "sample_s": args.samples},
               {"max_ranks": args.max_ranks})
        with open("/proc/loadavg") as fh:
            print("load average after:", fh.read().split()[:3])
        return 0
    available = hetflow.available_runtimes()
    rows = []
    for name in args.runtimes:
        if name not in available:
            print(f"skipping {name}: not installed", file=sys.stderr)
            continue
        rows.append(measure(name, args.n, {"max_ranks": args.max_ranks}))
    print(f"{'runtime':10} {'start s':>8} {'overhead ms':>12} {'p50 ms':>8} "
          f"{'seq ms/task':>12} {'tasks/s':>9}")
    for r in rows:
        print(f"{r['runtime']:10} {r['start_s']:8.2f} {r['overhead_ms']:12.2f} "
              f"{r['overhead_p50_ms']:8.2f} {r['sequential_ms']:12.2f} {r['tasks_per_s']:9.1f}")
    for r in rows:
        print_parts(r)
    base = next((r for r in rows if r["runtime"] == "mpirun"), None)
    if base:
        for r in rows:
            if r is not base:
                print(f"{r['runtime']} vs mpirun: overhead 1/"
                      f"{base['overhead_ms'] / r['overhead_ms']:.0f}, throughput x"
                      f"{r['tasks_per_s'] / base['tasks_per_s']:.0f}")
    if args.mixed:
        options = {"max_ranks": args.max_ranks}
        mixed = [measure_mixed(n, options) for n in args.runtimes if n in available]
        pipe = [measure_pipeline(n, args.pipeline_rows, options)
                for n in args.runtimes if n in available]
        for m, p in zip(mixed, pipe):
            print(f"{m['runtime']:10} mixed 8 joins: {m['mixed_s']:7.2f} s   "
                  f"join->sort {args.pipeline_rows} rows: {p['pipeline_s']:6.2f} s "
                  f"({p['rows']} rows sorted)")
        if len(mixed) > 1 and len({tuple(m["rows"]) for m in mixed}) != 1:
            print("WARNING: runtimes disagree on join results", [m["rows"] for m in mixed])
        base_m = next((m for m in mixed if m["runtime"] == "mpirun"), None)
        base_p = next((p for p in pipe if p["runtime"] == "mpirun"), None)
        for m, p in zip(mixed, pipe):
            if base_m and m is not base_m:
                print(f"{m['runtime']} vs mpirun: mixed x{base_m['mixed_s'] / m['mixed_s']:.2f} "
                      f"faster, join->sort x{base_p['pipeline_s'] / p['pipeline_s']:.2f} faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
