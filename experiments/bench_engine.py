"""Benchmark: hetflow's engine on R ranks vs single-process pyarrow, polars and duckdb.

    python -m hetflow.experiments.bench_engine [--rows 5000000] [--ranks 2] [--repeats 5]

Data: two tables (left, right) of ``--rows`` rows each, two int64 columns, keys uniform in
[0, 0.9 * rows) (the Radical-Cylon paper's data), built by :func:`hetflow.frame.generate` on the
ranks and rebuilt identically here for the single-process peers. Ops: inner join on ``key``, and
sort of the left table by ``key``. hetflow is timed as the paper does (``barrier; t0; op;
barrier; t1``, slowest rank), each op in its own ``mpiexec`` launch so the peak RSS of each rank
can be attributed to one op; peers are timed in this process with their default thread pools.
Prints median and min seconds over repeats, the ratio to polars, and each rank's peak RSS against
its input partition: the peak is the highest RSS while the timed operations run (Linux VmHWM,
reset after the input is built), the base is the RSS after a 1,000-row warm-up with every library
loaded and before the input exists, so (peak - base) / partition counts the input partition
itself, the operation's output and all of its scratch. Never fails on a time: this machine is
shared and the numbers are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from hetflow.experiments import engine_memory, engine_scaling
from hetflow.experiments.engine_memory import peak_rss_mib, reset_peak, rss_mib

SEEDS = engine_memory.SEEDS
#: The ranks run this file by its path: ``-m hetflow.experiments...`` would find a checkout's
#: own ``hetflow/`` first when started from its root, where ``experiments`` is not inside it.
_SELF = os.path.abspath(__file__)


# -- the ranks' side ------------------------------------------------------------------------
def _barrier(comm) -> None:
    """The timing barrier: the engine's own (:func:`hetflow.frame.barrier`), which polls at
    full speed for a moment and then sleeps at most 50 us between polls. MPICH's blocking
    barrier busy-polls, so on a node with more runnable processes than cores the rank that
    finished first would take CPU from the one still working, inflating the very time being
    measured; a barrier that sleeps longer (this one slept up to 1 ms) adds its oversleep to
    every multi-rank time, a seventh of a 7 ms join, and nothing to a one-rank time."""
    from hetflow.frame import barrier

    barrier(comm)


def _cylon_op(args, comm):
    """Cylon's own op (``--engine cylon-sort``/``cylon-hash``: pycylon's distributed merge with
    that join algorithm; sort: its distributed sort_values) on pycylon DataFrames of the
    ranks' partitions, the way Cylon's users call it; returns (run, rows of a result)."""
    import pycylon
    from pycylon.net import MPIConfig

    env = pycylon.CylonEnv(config=MPIConfig(comm), distributed=True)
    algorithm = args.engine.split("-")[1] if "-" in args.engine else "sort"

    def run(left, right):
        ldf = pycylon.DataFrame(left.local)
        if args.op == "join":
            rdf = pycylon.DataFrame(right.local)
            return ldf.merge(rdf, how="inner", algorithm=algorithm, on=["key"], env=env)
        return ldf.sort_values(by=["key"], env=env)

    return env, run, lambda out: out.to_arrow().num_rows


def worker(args) -> None:
    from mpi4py import MPI

    from hetflow import frame

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # Warm-up on 1,000 rows first: the libraries' code and thread pools are paged in then, so
    # the base is the interpreter with the engine loaded, and the peak above it is data.
    tiny = frame.generate(comm, 1000, unique=args.unique, seed=99)
    warm = frame.join(tiny, tiny, on="key") if args.op == "join" else frame.sort(tiny, "key")
    del tiny, warm
    base_rss = rss_mib()
    per_rank = args.rows // size
    left = frame.generate(comm, per_rank, unique=args.unique, seed=SEEDS["left"])
    tables = [left]
    if args.op == "join":
        tables.append(frame.generate(comm, per_rank, unique=args.unique, seed=SEEDS["right"]))
    part_mib = sum(t.local.nbytes for t in tables) / 2**20
    data_rss = rss_mib()
    times, cpu, rows, backend, phases = [], [], 0, "", []
    system, faults = [], []  # the kernel's share of the CPU seconds, and fresh pages touched
    cylon = None
    if args.engine != "hetflow":
        cylon, run_cylon, cylon_rows = _cylon_op(args, comm)
    if args.phases and cylon is None:
        from hetflow.frame import _phases
        _phases.enable()
    reset = reset_peak()  # the peak counts the operations only, not building the input
    peak = 0.0
    for _ in range(args.repeats):
        _barrier(comm)
        t0, c0 = time.perf_counter(), time.process_time()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        if cylon is not None:   # the pycylon DataFrames are made inside: Cylon's users do
            out = run_cylon(left, tables[-1])
        elif args.op == "join":
            out = frame.join(left, tables[1], on="key")
        else:
            out = frame.sort(left, "key")
        cpu.append(time.process_time() - c0)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        system.append(ru1.ru_stime - ru0.ru_stime)
        faults.append(ru1.ru_minflt - ru0.ru_minflt)
        _barrier(comm)
        times.append(time.perf_counter() - t0)
        if cylon is not None:
            rows, backend = comm.allreduce(cylon_rows(out)), args.engine
        else:
            if args.phases:
                phases.append(_phases.take())  # before num_rows: its allreduce is not the op's
            rows, backend = out.num_rows(), out.backend
        del out
        peak = max(peak, peak_rss_mib())
    if cylon is not None:
        cylon.finalize()    # Cylon's context; MPI stays up (Cylon did not initialize it)
    comm_times = comm.allgather(times)
    slowest = [max(ts) for ts in zip(*comm_times)]
    cpu_all = [sum(cs) for cs in zip(*comm.allgather(cpu))]  # CPU seconds of all ranks
    system_all = [sum(cs) for cs in zip(*comm.allgather(system))]
    faults_all = [sum(fs) for fs in zip(*comm.allgather(faults))]
    phases_all = comm.gather(phases)
    mem = comm.gather({"rank": rank, "base_rss_mib": base_rss, "data_rss_mib": data_rss,
                       "peak_rss_mib": peak, "peak_ops_only": reset,
                       "partition_mib": part_mib})
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"times": slowest, "cpu": cpu_all, "system": system_all,
                       "faults": faults_all, "rows_out": rows, "memory": mem,
                       "backend": backend, "ranks": size, "phases": phases_all,
                       "rank_times": comm_times}, fh)


def wait_probe_worker(args) -> None:
    """Rank 1 does a fixed piece of NumPy work while rank 0 waits for it (``--wait-mode``):
    rank 0's CPU seconds while waiting and rank 1's wall time for its work show what a wait
    costs the waiter and its peer on this node."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    data = np.random.default_rng(rank).integers(0, 2**40, 2_000_000)
    rows = []
    for _ in range(args.repeats):
        _barrier(comm)
        w0, c0 = time.perf_counter(), time.process_time()
        if rank == 1:
            for _ in range(3):
                np.sort(data)
        if args.wait_mode == "blocking":
            comm.Barrier()
        else:
            _barrier(comm)
        rows.append((time.perf_counter() - w0, time.process_time() - c0))
    got = comm.gather(rows)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(got, fh)


def wait_probe(args) -> int:
    """MPICH's busy-wait vs a sleeping wait, with and without MPIR_CVAR_POLLS_BEFORE_YIELD."""
    from hetflow.executors.launch import launcher_env

    modes = [("blocking", {}), ("blocking", {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}),
             ("blocking", {"MPICH_ASYNC_PROGRESS": "1"}), ("sleeping", {})]
    print(f"wait probe: rank 1 sorts 3 x 2M int64 while rank 0 waits; {args.rounds} rounds x "
          f"{args.repeats} repeats, medians")
    print(f"{'wait':<10} {'env':<34} {'waiter cpu s':>13} {'waiter wall s':>14} "
          f"{'worker wall s':>14} {'worker cpu s':>13}")
    results = {i: [] for i in range(len(modes))}
    for _ in range(args.rounds):
        for i, (mode, env) in enumerate(modes):
            with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as tmp:
                out = os.path.join(tmp, "probe.json")
                cmd = [_mpiexec(), "-n", "2", sys.executable, _SELF,
                       "--wait-probe-worker", "--wait-mode",
                       mode, "--repeats", str(args.repeats), "--out", out]
                subprocess.run(cmd, check=True, timeout=args.timeout,
                               env={**launcher_env(cmd[0]), **env})
                with open(out) as fh:
                    results[i].append(json.load(fh))
    for i, (mode, env) in enumerate(modes):
        waiter = [r for run in results[i] for r in run[0]]
        worker_rows = [r for run in results[i] for r in run[1]]
        med = lambda xs: statistics.median(xs)  # noqa: E731 - a local shorthand
        print(f"{mode:<10} {' '.join(f'{k}={v}' for k, v in env.items()) or 'default':<34} "
              f"{med([c for _, c in waiter]):>13.3f} {med([w for w, _ in waiter]):>14.3f} "
              f"{med([w for w, _ in worker_rows]):>14.3f} {med([c for _, c in worker_rows]):>13.3f}")
    return 0


# -- single-process peers -------------------------------------------------------------------
def _tables(rows: int, ranks: int, unique: float):
    import pyarrow as pa

    from hetflow.frame._table import synthetic_partition

    per_rank = rows // ranks
    return {name: pa.concat_tables([synthetic_partition(r, ranks, per_rank, unique=unique,
                                                        seed=seed) for r in range(ranks)])
            .combine_chunks() for name, seed in SEEDS.items()}


def _time(fn, repeats):
    times, cpu, out = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        n = out.num_rows if hasattr(out, "num_rows") else len(out)
        del out
    return times, n, cpu


def _duckdb_arrow(con, sql: str):
    """Run ``sql`` and materialise the result as a pyarrow.Table (duckdb 1.x and 2.x names)."""
    result = con.sql(sql)
    fetch = getattr(result, "to_arrow_table", None) or result.arrow
    return fetch()


def peers(rows: int, ranks: int, unique: float, repeats: int):
    import duckdb
    import polars as pl

    data = _tables(rows, ranks, unique)
    left, right = data["left"], data["right"]
    pl_left, pl_right = pl.from_arrow(left), pl.from_arrow(right)
    con = duckdb.connect()
    con.register("l", left)
    con.register("r", right)
    results = {}
    results[("join", "pyarrow")] = _time(
        lambda: left.join(right, "key", join_type="inner", left_suffix="_x", right_suffix="_y"),
        repeats)
    results[("join", "polars")] = _time(lambda: pl_left.join(pl_right, on="key"), repeats)
    results[("join", "duckdb")] = _time(
        lambda: _duckdb_arrow(con, "SELECT l.key, l.value AS value_x, r.value AS value_y "
                                   "FROM l JOIN r ON l.key = r.key"), repeats)
    results[("sort", "pyarrow")] = _time(lambda: left.sort_by("key"), repeats)
    results[("sort", "polars")] = _time(lambda: pl_left.sort("key"), repeats)
    results[("sort", "duckdb")] = _time(
        lambda: _duckdb_arrow(con, "SELECT * FROM l ORDER BY key"), repeats)
    con.close()
    return results, left.nbytes + right.nbytes


def _mpiexec(python: str = sys.executable) -> str:
    local = os.path.join(os.path.dirname(python), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def hetflow_run(op: str, args, ranks=None, rows=None, repeats=None,
                engine: str = "hetflow") -> dict:
    """One ``mpiexec`` launch of the ranks' side; ``engine`` "cylon-sort"/"cylon-hash" run
    Cylon's own op instead, under ``--cylon``'s interpreter."""
    ranks = args.ranks if ranks is None else ranks
    python = sys.executable if engine == "hetflow" else args.cylon
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [_mpiexec(python), "-n", str(ranks), python, _SELF, "--worker", "--op", op,
               "--engine", engine,
               "--rows", str(args.rows if rows is None else rows), "--unique", str(args.unique),
               "--repeats", str(args.repeats if repeats is None else repeats), "--out", out]
        if args.phases and engine == "hetflow":
            cmd.append("--phases")
        subprocess.run(cmd, check=True, timeout=args.timeout, env=_ranks_env(args, cmd[0]))
        with open(out) as fh:
            return json.load(fh)


def _ranks_env(args, mpiexec: str) -> dict:
    """The ranks' environment (Cylon's too): as hetflow's runtimes give it (Open MPI's opt-in
    as root included), then --mpi-env."""
    from hetflow.executors.launch import launcher_env

    env = launcher_env(mpiexec)
    env.update(kv.split("=", 1) for kv in args.mpi_env)
    return env


def _here_if_pycylon():
    import importlib.util

    return sys.executable if importlib.util.find_spec("pycylon") else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5_000_000, help="rows per table (all ranks)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unique", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=900, help="per mpiexec launch (s)")
    ap.add_argument("--json", help="also write the measurements here")
    ap.add_argument("--phases", action="store_true",
                    help="account each op's phases (partition, split, pack, exchange, "
                         "reassemble, check, sample, local) per rank and print a breakdown")
    ap.add_argument("--scaling", metavar="R1,R2",
                    help="instead of the peers: hetflow at these rank counts with --per-rank "
                         "rows per rank and table, launches interleaved over --rounds rounds; "
                         "prints speed-ups and CPU ratios against the first rank count")
    ap.add_argument("--per-rank", type=int, default=2_000_000,
                    help="--scaling: rows per table at the first rank count (strong scaling: "
                         "the tables keep that size as ranks grow), or per rank with --weak")
    ap.add_argument("--weak", action="store_true",
                    help="--scaling with --per-rank rows on every rank (weak scaling)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds for --scaling")
    ap.add_argument("--ops", default="join,sort", help="ops for --scaling")
    ap.add_argument("--cylon", metavar="PYTHON", default=_here_if_pycylon(),
                    help="--scaling: also time Cylon itself (pycylon's merge with its sort and "
                         "hash join, its sort_values) on the same data, under this "
                         "interpreter, where pycylon and hetflow both import (pycylon pins "
                         "pyarrow 9-10, so usually an environment of its own; docs/engine.md); "
                         "default: this interpreter when pycylon imports here")
    ap.add_argument("--engine", default="hetflow",
                    choices=["hetflow", "cylon", "cylon-sort", "cylon-hash"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--mpi-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for the ranks (e.g. an MPICH CVAR); repeatable")
    ap.add_argument("--memory", action="store_true",
                    help="instead of the peers: each rank's peak RSS against its partition in "
                         "join, sort and group-by, int64 and string keys, --rows / --ranks rows "
                         "per rank and table, each in a launch of its own "
                         "(hetflow.experiments.engine_memory)")
    ap.add_argument("--wait-probe", action="store_true",
                    help="measure what waiting for a busy peer costs (MPICH's blocking wait, "
                         "with yield or async progress, vs the engine's sleeping wait)")
    ap.add_argument("--wait-probe-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wait-mode", choices=["blocking", "sleeping"], help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", choices=["join", "sort"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.wait_probe_worker:
        wait_probe_worker(args)
        return 0
    if args.wait_probe:
        return wait_probe(args)
    if args.scaling:
        return engine_scaling.scaling(args, hetflow_run, _ranks_env(args, _mpiexec()))
    if args.memory:
        found = engine_memory.report(args.rows // args.ranks, args.ranks, args.timeout)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "memory": found}, fh, indent=1)
        return 0

    print(f"hetflow engine benchmark: 2 tables x {args.rows:,} rows (int64 key, value), "
          f"unique={args.unique}, {args.ranks} ranks, {args.repeats} repeats, "
          f"{os.cpu_count()} cores; numbers on a shared machine are noisy", flush=True)
    het = {op: hetflow_run(op, args) for op in ("join", "sort")}
    peer, _ = peers(args.rows, args.ranks, args.unique, args.repeats)

    rows = []
    for op in ("join", "sort"):
        polars_med = statistics.median(peer[(op, "polars")][0])
        polars_min = min(peer[(op, "polars")][0])
        polars_cpu = statistics.median(peer[(op, "polars")][2])
        entries = [(f"hetflow {args.ranks} ranks ({het[op]['backend']})", het[op]["times"],
                    het[op]["rows_out"], het[op]["cpu"])]
        entries += [(f"{name} (1 process)", *peer[(op, name)])
                    for name in ("polars", "pyarrow", "duckdb")]
        for name, times, n, cpu in entries:
            med, cmed = statistics.median(times), statistics.median(cpu)
            rows.append({"op": op, "engine": name, "median_s": med, "min_s": min(times),
                         "rows_out": n, "vs_polars": med / polars_med,
                         "min_vs_polars": min(times) / polars_min, "cpu_s": cmed,
                         "cpu_vs_polars": cmed / polars_cpu})
    print()
    print(f"{'op':<5} {'engine':<28} {'median s':>9} {'min s':>8} {'rows out':>11} "
          f"{'x polars':>9} {'min x':>6} {'cpu s':>7} {'cpu x':>6}")
    for r in rows:
        print(f"{r['op']:<5} {r['engine']:<28} {r['median_s']:>9.3f} {r['min_s']:>8.3f} "
              f"{r['rows_out']:>11,} {r['vs_polars']:>9.2f} {r['min_vs_polars']:>6.2f} "
              f"{r['cpu_s']:>7.3f} {r['cpu_vs_polars']:>6.2f}")
    print("x polars: median wall time / polars' median; min x: best / polars' best; cpu s: CPU "
          "seconds of all ranks or threads (median), a measure of work that load does not inflate")
    print()
    print("peak memory per rank (input partition = the rank's share of the tables the op reads)")
    print(f"{'op':<5} {'rank':>4} {'partition MiB':>14} {'base RSS':>9} {'peak RSS':>9} "
          f"{'peak/part':>10} {'(peak-base)/part':>17}")
    for op in ("join", "sort"):
        for m in het[op]["memory"]:
            print(f"{op:<5} {m['rank']:>4} {m['partition_mib']:>14.1f} {m['base_rss_mib']:>9.1f} "
                  f"{m['peak_rss_mib']:>9.1f} {m['peak_rss_mib'] / m['partition_mib']:>10.2f} "
                  f"{(m['peak_rss_mib'] - m['base_rss_mib']) / m['partition_mib']:>17.2f}")
    print("\nbase RSS = interpreter with pyarrow, mpi4py and the engine loaded (after a 1,000-row "
          "warm-up), before any data; peak RSS = highest RSS during the timed operations; "
          "targets: join <= 1.0x polars, sort <= 1.5x polars, (peak-base)/partition < 3")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": rows,
                       "memory": {op: het[op]["memory"] for op in het},
                       "host": {"cores": os.cpu_count(), "python": platform.python_version(),
                                "machine": platform.machine()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
