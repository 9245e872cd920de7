"""Rank-side half of the radical executor's RAPTOR path (imports no RADICAL-Pilot).

A RAPTOR ``MPIWorker`` rank calls :func:`raptor_rank` with the task's private
communicator (``None`` for a one-rank task). It runs hetflow's shared
:func:`run_on_rank` and leaves in the task dir what the client needs to judge
the task even if the worker never reports: this rank's pid (to find and stop
the worker), its outcome, and death evidence (``os._exit`` code, fatal-signal
stack) exactly as the one-launch-per-task path does.
"""
from __future__ import annotations

from hetflow.executors._rank import run_on_rank
from hetflow.executors.taskdir import TaskDir


def raptor_rank(comm, payload: bytes, taskdir: str, sys_path: list[str],
                attempt: str | None = None) -> bool:
    """Run one rank's share in a persistent RAPTOR worker; True if it succeeded.

    ``attempt``: the RP task's uid. A task whose worker was recycled before it started
    runs again under a new uid, while its old copy may still wait in the RAPTOR master's
    queue; that copy finds another attempt named in the task dir (or no task dir) and
    returns at once, so the task's function runs once."""
    taskdir = TaskDir(taskdir)
    if attempt is not None and not taskdir.is_attempt(attempt):
        return True
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    # The worker outlives the task, so the evidence hooks are undone afterwards.
    undo = taskdir.record_deaths(comm.Get_rank())
    try:
        outcome = run_on_rank(payload, comm, sys_path=sys_path)
        taskdir.write_outcome(outcome)
    finally:
        undo()
    return outcome.ok


def noop() -> None:
    """The runtime's start-up probe (its payload's function). It lives here, in a module
    every rank imports anyway: by reference from ``hetflow.executors.radical`` it made each
    rank of a new worker import the client's stack (Parsl, through the executor kernel),
    ~1 CPU-s a rank before the probe could run."""
