"""Rank-side half of the radical executor's RAPTOR path (imports no RADICAL-Pilot).

A RAPTOR ``MPIWorker`` rank calls :func:`raptor_rank` with the task's private
communicator (``None`` for a one-rank task). It runs hetflow's shared
:func:`run_on_rank` and leaves in the task dir what the client needs to judge
the task even if the worker never reports: this rank's pid (to find and stop
the worker), its outcome, and death evidence (``os._exit`` code, fatal-signal
stack) exactly as the one-launch-per-task path does.
"""
from __future__ import annotations

import faulthandler
import json
import os
from typing import List

from hetflow.executors._rank import run_on_rank, write_outcome


def raptor_rank(comm, payload: bytes, taskdir: str, sys_path: List[str]) -> bool:
    """Run one rank's share in a persistent RAPTOR worker; True if it succeeded."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    rank = comm.Get_rank()
    with open(os.path.join(taskdir, f"pid-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    # The worker outlives the task, so the evidence hooks are undone afterwards.
    fault = open(os.path.join(taskdir, f"fault-{rank}.txt"), "w")
    faulthandler.enable(file=fault, all_threads=False)
    real_exit = os._exit

    def _exit(code: int = 0):
        try:
            with open(os.path.join(taskdir, f"exit-{rank}.json"), "w") as out:
                json.dump({"exitcode": code}, out)
        finally:
            real_exit(code)

    os._exit = _exit
    try:
        outcome = run_on_rank(payload, comm, sys_path=sys_path)
        write_outcome(taskdir, outcome)
    finally:
        os._exit = real_exit
        faulthandler.disable()
        fault.close()
    return outcome.ok
