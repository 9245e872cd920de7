"""The paper's measurement protocol, as it runs on the ranks of one MPI task.

Reconstructed from the Radical-Cylon experiment scripts: per rank, tables of two
int64 columns (key, value) with keys uniform in ``[0, unique x total rows)``,
seeded by the rank; then ``iterations`` times ``barrier; t0; op; barrier; t1``,
the iteration's time being the mean over ranks. The task reports, from rank 0,
the per-iteration times, data generation, the in-task total (engine import,
generation and all iterations) and memory; and, around the iterations, each rank's CPU
seconds (``rank_core_share``: the share of a core a rank got), the machine's load, the CPU of
the runtime's own processes and of all others, and whether the machine was ``busy`` (see
``experiments/machine.py``).

This module imports only the standard library at the top: ranks start fast, and
``python -m hetflow.experiments.protocol`` is the bare ``mpiexec`` baseline (no hetflow runtime).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

#: Seed of the join's right-hand table (the engine seeds it per rank with ``(seed, rank)``;
#: the left table is seeded by the rank alone, the paper's choice), so the two sides
#: differ and every run of a configuration sees the same data.
RIGHT_SEED = 1_000_003


def _rss_mb() -> float:
    """This process's peak resident set, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_s() -> float:
    """This process's user + system CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cylon_task(comm, op: str, rows_per_rank: int, iterations: int, unique: float = 0.9,
               dump_dir: str | None = None) -> dict:
    """Run ``op`` ("join" or "sort") on generated tables under the paper's protocol.

    ``dump_dir``: also write each rank's input partitions there as Parquet (the
    single-machine peers then read exactly the same data).
    """
    t_begin = time.perf_counter()
    from hetflow import frame  # engine import counts as environment set-up, as in the paper
    from hetflow.frame import barrier

    rank, size = comm.Get_rank(), comm.Get_size()
    # A one-row table first: the engine's (and pyarrow's) lazy first-use imports land in the
    # set-up time, as the paper's environment set-up, not in the data generation time.
    frame.generate(comm, 1, unique=unique)
    barrier(comm)
    setup_s = time.perf_counter() - t_begin
    g0 = time.perf_counter()
    left = frame.generate(comm, rows_per_rank, unique=unique)  # seeded by the rank
    right = (frame.generate(comm, rows_per_rank, unique=unique, seed=RIGHT_SEED)
             if op == "join" else None)
    barrier(comm)
    gen_s = time.perf_counter() - g0
    if dump_dir:
        import pyarrow.parquet as pq

        os.makedirs(dump_dir, exist_ok=True)
        pq.write_table(left.local, os.path.join(dump_dir, f"left-{rank:04d}.parquet"))
        if right is not None:
            pq.write_table(right.local, os.path.join(dump_dir, f"right-{rank:04d}.parquet"))
    # What else ran meanwhile (rank 0 reads every process's CPU around the iterations) and
    # how much CPU each rank got during them: a rank that waited for a core shows it.
    pids = comm.gather(os.getpid(), root=0)
    window = None
    if rank == 0:
        from hetflow.experiments.machine import Window

        window = Window().start()
    cpu0 = _cpu_s()
    times, rows_out, path = [], 0, ""
    for _ in range(iterations):
        # The engine's sleeping barrier, not MPICH's: its blocking barrier busy-polls, so on a
        # node with more runnable processes than cores the rank that finishes first would burn
        # the CPU its peer still needs, and the time measured would be partly that burn.
        barrier(comm)
        t0 = time.perf_counter()
        out = frame.join(left, right, on="key", how="inner") if op == "join" else frame.sort(left, "key")
        barrier(comm)
        times.append(time.perf_counter() - t0)
        rows_out = out.local.num_rows
        path = getattr(out, "backend", "")
        del out
    op_cpu_s = _cpu_s() - cpu0
    machine = window.stop(ranks=pids) if window is not None else {}
    total_s = time.perf_counter() - t_begin
    gathered = comm.gather({"op_cpu_s": op_cpu_s, "times": times, "rows_out": rows_out, "rss_mb": _rss_mb(),
                            "gen_s": gen_s, "setup_s": setup_s, "total_s": total_s,
                            "path": path}, root=0)
    if rank != 0:
        return {}
    per_iter = [sum(g["times"][i] for g in gathered) / size for i in range(iterations)]
    return {
        "op": op, "ranks": size, "rows_per_rank": rows_per_rank, "iterations": iterations,
        "op_iter_s": per_iter, "op_mean_s": sum(per_iter) / iterations,
        "setup_s": max(g["setup_s"] for g in gathered),
        "gen_s": max(g["gen_s"] for g in gathered),
        "fn_total_s": max(g["total_s"] for g in gathered),
        "rows_out": sum(g["rows_out"] for g in gathered),
        "peak_rss_mb": max(g["rss_mb"] for g in gathered),
        "sum_rss_mb": sum(g["rss_mb"] for g in gathered),
        "engine_path": gathered[0]["path"],
        # CPU seconds each rank used during the iterations, and the share of a core it got
        "op_cpu_s": [g["op_cpu_s"] for g in gathered],
        "rank_core_share": (sum(g["op_cpu_s"] for g in gathered) / size / sum(per_iter)
                            if sum(per_iter) > 0 else None),
        **machine,
    }


def bare_main(argv=None) -> int:
    """``mpiexec -n R python -m hetflow.experiments.protocol '{"op": ..., ...}'``: no runtime at all.

    Rank 0 prints one JSON line with the task's report plus the in-function
    start and finish wall-clock stamps (to split the launch's overhead out).
    """
    from mpi4py import MPI

    args = json.loads((argv or sys.argv[1:])[0])
    comm = MPI.COMM_WORLD.Dup()
    started = time.time()
    report = cylon_task(comm, **args)
    finished = time.time()
    if comm.Get_rank() == 0:
        report.update(started=started, finished=finished)
        print("HETFLOW_BENCH " + json.dumps(report), flush=True)
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(bare_main())
