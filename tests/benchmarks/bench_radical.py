"""radical vs mpirun, one run side by side: start-up, close, per-task overhead.

Run: ``python tests/benchmarks/bench_radical.py``. Prints seconds and ratios; never
fails on a time.
"""
import time

import hetflow


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return comm.Get_rank()


@hetflow.mpi_app(ranks=2)
def nap(comm, seconds):
    time.sleep(seconds)
    return seconds


def measure(name: str, **options) -> dict:
    out = {}
    t0 = time.time()
    with hetflow.runtime(name, max_ranks=4, **options) as dfk:
        out["start_s"] = time.time() - t0
        noop().result()                                   # warm
        t = time.time()
        futures = [noop() for _ in range(20)]
        [f.result() for f in futures]
        out["20_noop_s"] = time.time() - t
        for seconds in (0.1, 1.0):
            overheads = []
            for _ in range(3):
                f = nap(seconds)
                f.result()
                overheads.append(hetflow.task_times(f).overhead_s)
            out[f"overhead_{seconds}s_task"] = sorted(overheads)[1]
        ex = dfk.executors[name]
        t_close = time.time()
    out["close_s"] = time.time() - t_close
    out.update({f"rp_{k}": v for k, v in getattr(ex, "timings", {}).items()})
    return out


if __name__ == "__main__":
    import sys

    # "exec": the radical runtime with every task as an RP MPI executable task.
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    results = {"mpirun": measure("mpirun"), "radical": measure("radical", mode=mode)}
    keys = sorted(set(results["mpirun"]) | set(results["radical"]))
    print(f"{'metric':28s} {'mpirun':>10s} {'radical':>10s} {'ratio':>8s}   (radical mode={mode})")
    for key in keys:
        a, b = results["mpirun"].get(key), results["radical"].get(key)
        ratio = f"{b / a:8.2f}" if a and b else "       -"
        print(f"{key:28s} {a if a is not None else float('nan'):10.3f} "
              f"{b if b is not None else float('nan'):10.3f} {ratio}")
