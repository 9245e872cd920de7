"""In-process, one rank: step through an MPI app with ``pdb`` and see the real traceback.

``hetflow.runtime("debug")`` runs each task in the client's own process on
``MPI.COMM_SELF``, one task at a time, so a breakpoint in the app stops right
there and an exception keeps its original traceback (``TaskFailed.exception``).
It is written only against the executor protocol (:mod:`hetflow.executors.kernel`):
its size is the measure of what a runtime must write.
"""
from __future__ import annotations

from hetflow.executors._rank import run_on_rank
from hetflow.executors.kernel import Executor, Task


class DebugExecutor(Executor):
    """Runs every task in this process, on ``COMM_SELF``: tasks must ask for one rank."""

    unsupported = {"walltime": "the debug runtime runs tasks in the client's own process, "
                               "which it cannot stop",
                   "cancel_running": "a task running in the client's own process cannot be "
                                     "stopped"}

    def __init__(self, label: str = "debug"):
        super().__init__(label, max_ranks=1)

    def _start(self, task: Task) -> None:
        from mpi4py import MPI

        # On the kernel's dispatch thread: one slot, so one task at a time anyway.
        outcome = run_on_rank(task.payload, MPI.COMM_SELF, keep_exception=True)
        self.complete(task, {0: outcome})

    def _stop(self, task: Task, error) -> None:
        pass   # nothing to stop: the task runs to its end; the kernel's verdict wins
