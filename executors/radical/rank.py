"""Rank-side half of the radical executor's RAPTOR path (imports no RADICAL-Pilot).

A RAPTOR ``MPIWorker`` rank calls :func:`raptor_rank` with the task's private
communicator (``None`` for a one-rank task). It runs hetflow's shared
:func:`run_on_rank` and leaves in the task dir what the client needs to judge
the task even if the worker never reports: this rank's pid (to find and stop
the worker), its outcome, and death evidence (``os._exit`` code, fatal-signal
stack) exactly as the one-launch-per-task path does.
"""
from __future__ import annotations

import os

from hetflow.executors._rank import bind_gpus, bind_threads, run_on_rank
from hetflow.executors.taskdir import TaskDir


def raptor_rank(comm, payload: bytes, taskdir: str, sys_path: list[str],
                attempt: str | None = None, devices=None, gpus_per_rank: int = 0,
                cores_per_rank: int = 1) -> bool:
    """Run one rank's share in a persistent RAPTOR worker; True if it succeeded.

    ``attempt``: the RP task's uid. A task whose worker was recycled before it started
    runs again under a new uid, while its old copy may still wait in the RAPTOR master's
    queue; that copy finds another attempt named in the task dir (or no task dir) and
    returns at once, so the task's function runs once. ``devices``: the task's GPU ids,
    bound per rank by the runtimes' one binding (``_rank.bind_gpus``), for this task only;
    ``cores_per_rank``: the threads the rank's libraries run (``_rank.bind_threads``)."""
    taskdir = TaskDir(taskdir)
    if attempt is not None and not taskdir.is_attempt(attempt):
        return True
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    # The worker outlives the task, so the evidence hooks are undone afterwards.
    undo = taskdir.record_deaths(comm.Get_rank())
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    bind_threads(cores_per_rank)
    try:
        bind_gpus(devices, _local_index(comm) if devices else 0, gpus_per_rank)
        outcome = run_on_rank(payload, comm, sys_path=sys_path)
        taskdir.write_outcome(outcome)
    finally:
        undo()
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    return outcome.ok


def _local_index(comm) -> int:
    """This rank's index among the task's ranks on its node (a worker's ranks span nodes
    and tasks, so the launcher's local rank is not the task's)."""
    host = os.uname().nodename
    hosts = comm.allgather(host)
    return hosts[:comm.Get_rank()].count(host)


def noop() -> None:
    """The runtime's start-up probe (its payload's function). It lives here, in a module
    every rank imports anyway: by reference from ``hetflow.executors.radical`` it made each
    rank of a new worker import the client's stack (Parsl, through the executor kernel),
    ~1 CPU-s a rank before the probe could run."""
