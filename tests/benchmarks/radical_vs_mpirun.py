"""Side-by-side: start-up, close, and per-task overhead, radical vs mpirun (one run).

    python tests/benchmarks/radical_vs_mpirun.py [--tasks 20] [--slots 2]

Prints figures and ratios to mpirun; never fails on a time.
"""
import argparse
import statistics
import time

import hetflow


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return comm.Get_rank()


@hetflow.mpi_app(ranks=2)
def nap(comm, seconds):
    time.sleep(seconds)
    return seconds


def measure(name, tasks, slots):
    out = {}
    t0 = time.time()
    ctx = hetflow.runtime(name, max_ranks=slots)
    dfk = ctx.__enter__()
    out["start_s"] = time.time() - t0
    try:
        ex = dfk.executors[name]
        if hasattr(ex, "times"):
            out["session_s"] = ex.times.session_s
            out["pilot_active_s"] = ex.times.pilot_active_s
        noop().result()                                   # warm-up, not counted
        t1 = time.time()
        futs = [noop() for _ in range(tasks)]
        [f.result() for f in futs]
        out["noop_wall_per_task_s"] = (time.time() - t1) / tasks
        out["noop_overhead_s"] = statistics.mean(
            hetflow.task_times(f).overhead_s for f in futs)
        for secs in (0.1, 1.0):
            futs = [nap(secs) for _ in range(5)]
            [f.result() for f in futs]
            out[f"overhead_sleep_{secs}s"] = statistics.mean(
                hetflow.task_times(f).overhead_s for f in futs)
    finally:
        t2 = time.time()
        ctx.__exit__(None, None, None)
        out["close_s"] = time.time() - t2
        if hasattr(ex, "times"):
            out["rp_close_s"] = ex.times.close_s
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    results = {name: measure(name, args.tasks, args.slots) for name in ("mpirun", "radical")}
    keys = sorted(set(results["mpirun"]) | set(results["radical"]))
    print(f"{'metric':28s} {'mpirun':>10s} {'radical':>10s} {'ratio':>8s}")
    for key in keys:
        a, b = results["mpirun"].get(key), results["radical"].get(key)
        ratio = f"{b / a:8.2f}" if a and b else "       -"
        fa = f"{a:10.3f}" if a is not None else "         -"
        fb = f"{b:10.3f}" if b is not None else "         -"
        print(f"{key:28s} {fa} {fb} {ratio}")


if __name__ == "__main__":
    main()
