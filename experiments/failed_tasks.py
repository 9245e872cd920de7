"""A pool outlives many failed tasks: ``python -m hetflow.experiments.failed_tasks [--failed N]``.

Runs ``N`` failed tasks (default 10,000) on one pool of 2 ranks with the default
``max_kept_comms``, in batches submitted at once: half are 2-rank tasks whose rank 1 sends
rank 0 a message it never receives and raises (rank 0 returns), half 1-rank tasks that
raise. Each rank keeps the communicators of the 2-rank ones (see ``_rank.release_comm``):
MPICH's context ids ran out at about the 1,023rd and the world died; the pool now replaces
a world whose ranks keep ``max_kept_comms``. Then good 2-rank tasks run. Prints the failed
tasks (each checked for its typed error), the good tasks after them (each result checked),
the worlds replaced, and the ranks' RSS at start and end. ``HETFLOW_MPIEXEC`` picks the MPI.
(A task whose rank 0 waits in a collective for the rank that raised costs a stopped rank and
a restarted world, about 4 s each: tests/test_pool_kept_comms.py runs one.)
"""
from __future__ import annotations

import argparse
import time

import hetflow


@hetflow.mpi_app(ranks=2, returns="all")
def sends_then_raises(comm, i):
    if comm.Get_rank() == 1:
        comm.send("stale", dest=0, tag=5)
        raise ValueError(f"failed {i}")
    return "returned"


@hetflow.mpi_app(ranks=1)
def raises(comm, i):
    raise KeyError(f"failed {i}")


@hetflow.mpi_app(ranks=2, returns="all")
def good(comm, i):
    return comm.allreduce(i)


def ranks_rss_mib(executor) -> list:
    import psutil

    out = []
    for slot in executor._slots.values():
        if slot.alive:
            try:
                out.append(round(psutil.Process(slot.pid).memory_info().rss / 2 ** 20, 1))
            except psutil.NoSuchProcess:
                pass
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failed", type=int, default=10_000)
    parser.add_argument("--good", type=int, default=200)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--max-kept-comms", type=int, default=None,
                        help="the pool's limit (default: the pool's default)")
    args = parser.parse_args(argv)
    from parsl.dataflow.dflow import DataFlowKernelLoader
    from mpi4py import MPI

    t0 = time.perf_counter()
    failed = wrong = 0
    limit = {} if args.max_kept_comms is None else {"max_kept_comms": args.max_kept_comms}
    with hetflow.runtime("pool", max_ranks=2, **limit):
        executor = DataFlowKernelLoader.dfk().executors["pool"]
        assert good(0).result() == [0, 0]
        rss_start = ranks_rss_mib(executor)
        rss_max = list(rss_start)
        for start in range(0, args.failed, args.batch):
            batch = [(sends_then_raises if i % 2 == 0 else raises)(i)
                     for i in range(start, min(start + args.batch, args.failed))]
            for i, future in enumerate(batch, start):
                try:
                    future.result()
                    wrong += 1
                except hetflow.TaskLost:
                    wrong += 1
                except hetflow.TaskFailed as exc:
                    kind = "ValueError" if i % 2 == 0 else "KeyError"
                    ok = exc.exception_type == kind and f"failed {i}" in str(exc)
                    failed += ok
                    wrong += not ok
            rss_max = [max(a, b) for a, b in zip(rss_max, ranks_rss_mib(executor))]
        futures = [good(i) for i in range(args.good)]
        good_ok = sum(f.result() == [2 * i, 2 * i] for i, f in enumerate(futures))
        rss_end = ranks_rss_mib(executor)
        recycled = executor.recycled
        limit = executor.max_kept_comms
    print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    print(f"failed tasks with their typed error: {failed} of {args.failed} (wrong: {wrong})")
    print(f"good tasks after them, right: {good_ok} of {args.good}")
    print(f"worlds replaced for kept communicators: {recycled} (max_kept_comms={limit})")
    print(f"rank RSS MiB: start {rss_start}, end {rss_end}, max seen {rss_max}")
    print(f"wall {time.perf_counter() - t0:.1f} s, load {open('/proc/loadavg').read().split()[:3]}")
    return 0 if failed == args.failed and good_ok == args.good and not wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
