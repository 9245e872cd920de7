"""The client's view of a task: its state, its timestamps, cancelling it.

Executors keep one record per task (``hetflow.executors.kernel.Task``) and put it
on the future they return as ``future.hetflow_task``; these functions read it.
Core never imports an executor: it reaches them through the entry-point registry
(:mod:`hetflow.runtime`) and the Parsl DataFlowKernel that holds them.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hetflow.errors import NotSupported, TaskCancelled


class TaskState(str, enum.Enum):
    """Where a task is, as in RADICAL-Pilot: NEW -> SCHEDULING -> EXECUTING -> a final state.

    A ``str`` enum, so ``task_state(fut) == "DONE"`` holds.
    """

    NEW = "NEW"
    SCHEDULING = "SCHEDULING"
    EXECUTING = "EXECUTING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELED = "CANCELED"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of_outcome(cls, error: Optional[BaseException]) -> "TaskState":
        """The final state a task reaches with ``error`` (None: it succeeded)."""
        if error is None:
            return cls.DONE
        return cls.CANCELED if isinstance(error, TaskCancelled) else cls.FAILED


@dataclass
class TaskTimes:
    """Per-task wall-clock timestamps (``time.time()``), one schema for every executor.

    submitted: the executor accepted the task; launched: its processes / slot were
    started; started and finished: rank 0 entered and left the user function;
    delivered: the result was set on the future. ``returned``: when each rank's function
    returned (or raised), by rank, as the client saw its mark; a running task whose
    ``returned`` names some ranks but not all has ranks still at work, or waiting for the
    returned ones (see ``hetflow.task_output`` and the warning in the API docs).
    """

    executor: str
    ranks: int
    submitted: float = float("nan")
    launched: float = float("nan")
    started: float = float("nan")
    finished: float = float("nan")
    delivered: float = float("nan")
    returned: Dict[int, float] = field(default_factory=dict)

    @property
    def queue_s(self) -> float:
        """Seconds from submission until the task's processes started: the executor's own
        queue and, on a batch system, the batch queue (the wait a batch user pays)."""
        return self.launched - self.submitted

    @property
    def function_s(self) -> float:
        """Seconds spent in the user function on rank 0."""
        return self.finished - self.started

    @property
    def overhead_s(self) -> float:
        """Seconds from submission to delivery not spent in the function."""
        return (self.delivered - self.submitted) - self.function_s

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(queue_s=self.queue_s, function_s=self.function_s, overhead_s=self.overhead_s)
        return d


def _record(future):
    """``(Parsl task record or None, the executor's future or None)`` for an app or executor future."""
    # An AppFuture answers any attribute with a new future (Parsl's __getattr__): read __dict__.
    record = future.__dict__.get("task_record") if hasattr(future, "__dict__") else None
    if record is not None:
        exec_fu = record.get("exec_fu")
        # Parsl stores exec_fu only after adding its done-callback, so a task that ends at
        # once (the debug runtime runs it on submit) can resolve its AppFuture first. The
        # launch thread stores it microseconds later: wait for that, briefly.
        deadline = time.monotonic() + 2.0
        while exec_fu is None and future.done() and time.monotonic() < deadline:
            time.sleep(0.001)
            exec_fu = record.get("exec_fu")
        return record, exec_fu
    return None, future


def _executor_task(exec_fu):
    return exec_fu.__dict__.get("hetflow_task") if exec_fu is not None else None


def task_times(future) -> Optional[TaskTimes]:
    """The :class:`TaskTimes` of a task, from its AppFuture or executor future (None if unknown)."""
    task = _executor_task(_record(future)[1])
    return task.times if task is not None else None


def task_output(future) -> str:
    """The last 64 KiB of the task's rank output, as whole lines prefixed
    ``[task N rank R]`` ("" where the runtime's ``output`` is ``"off"``); while the task
    runs, what was read so far."""
    task = _executor_task(_record(future)[1])
    files = getattr(task, "files", None)
    return files.text() if files is not None else ""


def task_samples(future) -> Dict[int, List[dict]]:
    """The task's resource samples so far (read every second while it runs, and at its
    end), ``{rank: [sample, ...]}`` in time order: each a
    dict of the rank process's CPU, memory, I/O and GPU use (fields: see
    :mod:`hetflow.executors._ranksample`); ``{}`` where sampling is off (see
    ``hetflow.runtime(sample_s=...)``) or the task has not started."""
    task = _executor_task(_record(future)[1])
    samples = getattr(task, "samples", None)
    if samples is None:
        return {}
    return samples.snapshot()


def task_state(future) -> TaskState:
    """The task's :class:`TaskState`.

    A task not yet handed to an executor (waiting on its dependencies) is NEW; a
    future of an executor that keeps no hetflow record is judged by the future.
    """
    record, exec_fu = _record(future)
    task = _executor_task(exec_fu)
    if task is not None:
        return task.state
    done = future if record is not None else exec_fu
    if exec_fu is None:
        return TaskState.NEW if done is None or not done.done() else _final(done)
    return _final(done) if done.done() else TaskState.EXECUTING


def _final(done) -> TaskState:
    if done.cancelled():
        return TaskState.CANCELED
    return TaskState.of_outcome(done.exception())


def cancel(app_future) -> bool:
    """Cancel a hetflow task from its AppFuture; True if the executor stopped it.

    The future then fails with :class:`~hetflow.TaskCancelled`. A task still
    waiting on its dependencies (not yet handed to an executor) cannot be
    cancelled this way and returns False.
    """
    record = getattr(app_future, "task_record", None)
    if record is None:
        raise TypeError(f"expected a Parsl AppFuture, got {type(app_future).__name__}")
    exec_fu = record.get("exec_fu")
    if exec_fu is None or exec_fu.done():
        return False
    executor = record["dfk"].executors[record["executor"]]
    if not hasattr(executor, "cancel"):
        raise NotSupported(f"executor {record['executor']!r} cannot cancel tasks")
    return executor.cancel(exec_fu)
