"""Side-by-side overhead benchmark: ``python -m hetflow.executors._pool_bench [runtimes...]``.

Runs, through the normal ``mpi_app`` + Parsl DFK path, on each runtime in turn:
- latency: N no-op 2-rank tasks one after another; per-task overhead is the mean
  of TaskTimes.overhead_s (submit to delivery, minus time in the function);
- throughput: N no-op 2-rank tasks submitted at once; tasks/s over the whole batch.
Prints one table and the ratios against mpirun. Never fails on a time: it only reports.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import hetflow


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return None


def measure(name: str, n: int, options: dict) -> dict:
    t0 = time.perf_counter()
    with hetflow.runtime(name, **options):
        start_s = time.perf_counter() - t0
        noop().result()                                      # warm: imports on the ranks
        overheads = []
        t = time.perf_counter()
        for _ in range(n):
            fut = noop()
            fut.result()
            overheads.append(hetflow.task_times(fut).overhead_s)
        sequential_s = time.perf_counter() - t
        t = time.perf_counter()
        futs = [noop() for _ in range(n)]
        for fut in futs:
            fut.result()
        batch_s = time.perf_counter() - t
    return {"runtime": name, "start_s": start_s,
            "overhead_ms": 1e3 * statistics.mean(overheads),
            "overhead_p50_ms": 1e3 * statistics.median(overheads),
            "sequential_ms": 1e3 * sequential_s / n,
            "tasks_per_s": n / batch_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetflow.executors._pool_bench")
    parser.add_argument("runtimes", nargs="*", default=["pool", "mpirun"])
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--max-ranks", type=int, default=4)
    args = parser.parse_args(argv)
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
    base = next((r for r in rows if r["runtime"] == "mpirun"), None)
    if base:
        for r in rows:
            if r is not base:
                print(f"{r['runtime']} vs mpirun: overhead 1/"
                      f"{base['overhead_ms'] / r['overhead_ms']:.0f}, throughput x"
                      f"{r['tasks_per_s'] / base['tasks_per_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
