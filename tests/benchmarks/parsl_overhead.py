"""Start-up and per-task overhead, parsl vs mpirun executors, side by side in one run.

    python tests/benchmarks/parsl_overhead.py [--tasks 20]

Prints, per executor: runtime load time, time to the first result, wall time per
task for N no-op 2-rank tasks submitted at once and one at a time, and the mean
TaskTimes overhead; then the parsl/mpirun ratios. Never fails on a threshold.
"""
import argparse
import statistics
import time

import hetflow


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return comm.Get_size()


def measure(name: str, tasks: int) -> dict:
    t0 = time.perf_counter()
    with hetflow.runtime(name, max_ranks=4):
        loaded = time.perf_counter()
        assert noop().result() == 2
        first = time.perf_counter()
        futures = [noop() for _ in range(tasks)]
        assert [f.result() for f in futures] == [2] * tasks
        batch = time.perf_counter()
        overheads = [hetflow.task_times(f).overhead_s for f in futures]
        serial = []
        for _ in range(tasks):
            s = time.perf_counter()
            assert noop().result() == 2
            serial.append(time.perf_counter() - s)
    closed = time.perf_counter()
    return {"load_s": loaded - t0, "first_result_s": first - t0,
            "batch_per_task_s": (batch - first) / tasks,
            "serial_per_task_s": statistics.mean(serial),
            "mean_overhead_s": statistics.mean(overheads), "close_s": closed - batch - sum(serial)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20)
    args = parser.parse_args()
    results = {name: measure(name, args.tasks) for name in ("mpirun", "parsl")}
    keys = list(results["mpirun"])
    print(f"{'metric':<20}{'mpirun':>10}{'parsl':>10}{'parsl/mpirun':>14}")
    for key in keys:
        m, p = results["mpirun"][key], results["parsl"][key]
        print(f"{key:<20}{m:>10.3f}{p:>10.3f}{p / m:>14.2f}")


if __name__ == "__main__":
    main()
