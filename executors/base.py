"""What every hetflow executor shares.

- :class:`HetflowExecutor`: the Parsl executor base (``start``/``submit``/``shutdown``
  plus resource checks, task timestamps and cancellation bookkeeping).
- The rank-side runner (:func:`run_on_rank`, in ``_rank.py``): unpickle, build the
  task's private communicator, call, report one :class:`RankOutcome` per rank.
  Every executor uses it, so behaviour is identical across runtimes by construction.
- :func:`collect`: turn the per-rank outcomes into the future's value or a typed error.
- :class:`TaskTimes`: the common timestamp schema used by the comparison reports.
- :class:`SlotScheduler`: FIFO-with-bounded-backfill packing of tasks onto rank slots.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import re
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from parsl.executors.base import ParslExecutor

from hetflow.errors import (ConfigError, ExecutorBroken, ResourcesUnavailable, TaskFailed,
                            TaskLost)
from hetflow.executors._rank import RankOutcome, TaskPayload, run_on_rank  # noqa: F401 (re-export)
from hetflow.spec import Resources


# --------------------------------------------------------------------------- timestamps
@dataclass
class TaskTimes:
    """Per-task wall-clock timestamps (``time.time()``), one schema for every executor.

    submitted: the executor accepted the task; launched: its processes / slot were
    started; started and finished: rank 0 entered and left the user function;
    delivered: the result was set on the future.
    """

    executor: str
    ranks: int
    submitted: float = float("nan")
    launched: float = float("nan")
    started: float = float("nan")
    finished: float = float("nan")
    delivered: float = float("nan")

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
        d.update(function_s=self.function_s, overhead_s=self.overhead_s)
        return d


def task_times(future) -> Optional[TaskTimes]:
    """The :class:`TaskTimes` of a finished task, from its AppFuture or executor future."""
    # An AppFuture answers any attribute with a new future (Parsl's __getattr__), so look
    # for its task record first and read the executor future's stamps from there.
    record = future.__dict__.get("task_record") if hasattr(future, "__dict__") else None
    if record is not None:
        future = record.get("exec_fu")
    return future.__dict__.get("hetflow_times") if future is not None else None


def task_state(future) -> str:
    """The task's state: NEW, SCHEDULING, EXECUTING, DONE, FAILED or CANCELED.

    Executors that track states (the pool) stamp ``hetflow_state`` on their
    futures; for the others it is derived from the futures (NEW until an
    executor has the task, EXECUTING until it is done).
    """
    record = future.__dict__.get("task_record") if hasattr(future, "__dict__") else None
    exec_fu = record.get("exec_fu") if record is not None else future
    if exec_fu is not None:
        state = exec_fu.__dict__.get("hetflow_state")
        if state is not None:
            return state
    done = future if record is not None else exec_fu
    if done is None or not done.done():
        return "NEW" if exec_fu is None else "EXECUTING"
    if done.cancelled():
        return "CANCELED"
    exc = done.exception()
    if exc is None:
        return "DONE"
    from hetflow.errors import TaskCancelled
    return "CANCELED" if isinstance(exc, TaskCancelled) else "FAILED"


def collect(outcomes: Dict[int, RankOutcome], resources: Resources, *, task_id=None,
            returncode: Optional[int] = None, stderr_tail: str = "", executor: str = "",
            deaths: Optional[Dict[int, tuple]] = None):
    """The task's value from its ranks' outcomes, or the typed error that explains why not.

    A rank that raised beats a rank that vanished (ranks killed because a peer
    failed are collateral, not the cause); among vanished ranks, one that left
    death evidence (``deaths``, ordered cause first: see ``_rank.read_deaths`` and
    ``MPILaunch.deaths``) is named as the cause.
    """
    failed = [o for o in outcomes.values() if not o.ok]
    if failed:
        first = min(failed, key=lambda o: (o.finished, o.rank))
        exc = None
        if first.exception:
            try:
                exc = pickle.loads(first.exception)
            except Exception:
                exc = None
        raise TaskFailed(
            f"task {task_id} ({executor}): rank {first.rank} of {resources.ranks} raised "
            f"{first.exception_type}: {first.message}",
            rank=first.rank, host=first.host, exception=exc, exception_type=first.exception_type,
            remote_traceback=first.traceback, task_id=task_id)
    missing = [r for r in range(resources.ranks) if r not in outcomes]
    if missing:
        signal = -returncode if returncode is not None and returncode < 0 else None
        how = (f"killed by signal {signal}" if signal else
               f"launcher exit code {returncode}" if returncode is not None else "no report")
        deaths = {r: d for r, d in (deaths or {}).items() if r in missing}
        if deaths:
            rank = next(iter(deaths))    # producers order them: the cause first
            what, text = deaths[rank]
            named = re.search(r"signal (\d+)", what)
            if named and signal is None:
                signal = int(named.group(1))
            others = [r for r in missing if r != rank]
            message = (f"task {task_id} ({executor}): rank {rank} of {resources.ranks} {what} "
                       f"without reporting ({how})")
            if others:
                message += f"; rank(s) {others} were stopped with it"
        else:
            rank, text = missing[0], ""
            message = (f"task {task_id} ({executor}): rank(s) {missing} of {resources.ranks} "
                       f"died without reporting ({how})")
        raise TaskLost(message, rank=rank, exitcode=returncode, signal=signal,
                       stderr_tail=stderr_tail, task_id=task_id, remote_traceback=text or None)
    if resources.returns == "all":
        return [outcomes[r].load_value() for r in range(resources.ranks)]
    return outcomes[0].load_value()


# --------------------------------------------------------------------------- scheduling
class SlotScheduler:
    """Packs tasks onto ``capacity`` slots: FIFO, with backfill that cannot starve.

    A task that does not fit lets later, smaller ones pass it at most
    ``max_bypass`` times; after that nothing passes it until it has run.
    ``acquire``/``release`` hand out concrete slot numbers (used for pinning).
    """

    def __init__(self, capacity: int, max_bypass: int = 16):
        self.capacity = capacity
        self.max_bypass = max_bypass
        self.free = list(range(capacity))
        self.queue: deque = deque()  # entries: [item, slots_needed, bypassed]

    def push(self, item, slots: int) -> None:
        self.queue.append([item, slots, 0])

    def remove(self, item) -> bool:
        for entry in self.queue:
            if entry[0] is item:
                self.queue.remove(entry)
                return True
        return False

    def pop_ready(self) -> List[tuple]:
        """Entries that can start now, as ``(item, slots)``; their slots are taken."""
        return self.pop_ready_with(self.take_free)

    def take_free(self, item, need: int) -> Optional[list]:
        """Take the first ``need`` free slots for ``item``, or None when fewer are free."""
        if need > len(self.free):
            return None
        slots, self.free = self.free[:need], self.free[need:]
        return slots

    def pop_ready_with(self, take) -> List[tuple]:
        """The FIFO-with-bounded-backfill pass, with ``take(item, need)`` finding the slots.

        ``take`` returns the slots it took for the item, or None if it does not fit
        now; subclasses with their own placement rules (the pool's worlds) supply it.
        """
        ready = []
        blocked_head = None
        for entry in list(self.queue):
            item, need, _ = entry
            allowed = blocked_head is None or blocked_head[2] < self.max_bypass
            slots = take(item, need) if allowed else None
            if slots is not None:
                self.queue.remove(entry)
                ready.append((item, slots))
                if blocked_head is not None:
                    blocked_head[2] += 1
            elif blocked_head is None:
                blocked_head = entry
        return ready

    def release(self, slots) -> None:
        self.free = sorted(self.free + list(slots))


# --------------------------------------------------------------------------- executor base
def machine_gpus() -> int:
    """GPUs visible on this machine (0 when there are none or no driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() not in ("", "-1")])
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        return 0


class HetflowExecutor(ParslExecutor):
    """Base of hetflow's Parsl executors: resource checks, timestamps, cancellation."""

    #: Largest task (in rank slots) this executor can ever run; set by subclasses.
    max_ranks: int = 1
    #: GPUs this executor can hand out; subclasses may override.
    gpus: int = 0
    #: Features this runtime truly cannot provide, feature -> reason. The parity suite
    #: then expects NotSupported naming the feature. Known features: "walltime",
    #: "cancel_running", "resident_data".
    unsupported: Dict[str, str] = {}

    def __init__(self, *, label: str, max_ranks: Optional[int] = None,
                 gpus: Optional[int] = None):
        super().__init__()
        self.label = label
        cores = os.cpu_count() or 1
        self.max_ranks = cores if max_ranks is None else max_ranks
        if isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int) or self.max_ranks < 1:
            raise ConfigError(f"max_ranks must be a positive int, got {max_ranks!r}")
        self.gpus = machine_gpus() if gpus is None else gpus
        self._task_counter = 0
        self._lock = threading.Lock()

    def check_resources(self, resources: Resources) -> None:
        """Raise ResourcesUnavailable for a task this executor can never run."""
        if resources.cores > self.max_ranks:
            raise ResourcesUnavailable(
                f"task needs {resources.ranks} rank(s) x {resources.cores_per_rank} core(s) = "
                f"{resources.cores} slot(s), but executor {self.label!r} has max_ranks="
                f"{self.max_ranks}")
        if resources.ranks * resources.gpus_per_rank > self.gpus:
            raise ResourcesUnavailable(
                f"task needs {resources.ranks * resources.gpus_per_rank} GPU(s), but executor "
                f"{self.label!r} sees {self.gpus} on this machine")

    def new_task(self, resource_specification) -> tuple:
        """Validate a submission: ``(task_id, resources, future with TaskTimes)``."""
        resources = Resources.from_spec(resource_specification)
        self.check_resources(resources)
        with self._lock:
            task_id = self._task_counter
            self._task_counter += 1
        future: Future = Future()
        future.parsl_executor_task_id = task_id
        future.hetflow_times = TaskTimes(executor=self.label, ranks=resources.ranks,
                                         submitted=time.time())
        return task_id, resources, future

    @staticmethod
    def deliver(future: Future, value: Any = None, error: Optional[BaseException] = None,
                times: Optional[dict] = None) -> None:
        """Set a result or error once, stamping ``delivered`` first."""
        t = future.hetflow_times
        for key, stamp in (times or {}).items():
            setattr(t, key, stamp)
        t.delivered = time.time()
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    @staticmethod
    def payload(task_id, func, args, kwargs, resources) -> bytes:
        """The pickled task every rank runs (pickled once, in the submitting thread)."""
        return TaskPayload(task_id=task_id, func=func, args=args, kwargs=kwargs,
                           resources=resources).dumps()

    @staticmethod
    def client_sys_path() -> List[str]:
        """The client's import path, handed to ranks so its modules' functions unpickle."""
        return [p for p in sys.path if p]

    def next_ready(self, scheduler: SlotScheduler, cond: threading.Condition) -> Optional[list]:
        """Wait (with ``cond`` held) until tasks can start: ``pop_ready``'s list, None once stopping."""
        while not self._stopping and not (ready := scheduler.pop_ready()):
            cond.wait()
        return None if self._stopping else ready

    def drain_queue(self, scheduler: SlotScheduler, cond: threading.Condition) -> list:
        """Stop taking tasks: set ``_stopping``, empty ``scheduler``'s queue, wake waiters.

        Call with ``cond`` held; returns the items that were still queued.
        """
        self._stopping = True
        queued = [entry[0] for entry in scheduler.queue]
        scheduler.queue.clear()
        cond.notify_all()
        return queued

    def fail_unfinished(self, tasks) -> None:
        """Fail every ``(task_id, future)`` left at shutdown with ExecutorBroken."""
        for task_id, future in tasks:
            self.deliver(future, error=ExecutorBroken(
                f"executor {self.label!r} shut down before task {task_id} finished"))

    def monitor_resources(self) -> bool:
        # Parsl's resource monitor watches one process tree; MPI ranks are many.
        return False


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
        from hetflow.errors import NotSupported
        raise NotSupported(f"executor {record['executor']!r} cannot cancel tasks")
    return executor.cancel(exec_fu)
