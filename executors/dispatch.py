"""The kernel's queue: its task record, the runtime's scheduler under one lock, and the thread
that starts what it places.

Every change to the queue or the slots (a task submitted, slots freed, a task re-queued, a
runtime reshaping its slots through :meth:`TaskQueue.placement`) *kicks* the dispatch thread,
which asks the scheduler for the tasks that can start now (:meth:`SlotScheduler.pop_ready`,
whose cost does not grow with the queue) and hands each to ``launch`` outside the lock. When
the queue's head cannot start, ``blocked(task)`` is told once per head and per reshaping
(``placement()``), not once per freed slot, and only when the scheduler says a reshaping
may help (:meth:`SlotScheduler.may_reshape`): a runtime that can reshape its slots (the pool
consolidating its worlds) acts then, and a deep queue does not wake it for every task.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import CancelledError, Future, TimeoutError as FutureTimeout
from concurrent.futures._base import (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, LOGGER,
                                      PENDING, RUNNING, InvalidStateError)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence

from hetflow.executors.scheduler import SlotScheduler
from hetflow.spec import Resources
from hetflow.tasks import TaskState, TaskTimes

if TYPE_CHECKING:
    from hetflow.executors.rankio import TaskFiles
    from hetflow.executors.watch import Deadline


#: The one lock of every :class:`TaskFuture`'s state: held for a few attribute writes (no
#: callback runs under it); re-entrant, as ``concurrent.futures.wait`` takes each future's
#: ``_condition`` in turn.
_FUTURES = threading.RLock()
_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_CANCELLED = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED))


class TaskFuture(Future):
    """A task's future, as the executor returns it: a ``concurrent.futures.Future`` (what
    Parsl's DFK takes, and ``wait``/``as_completed`` work on) with no lock of its own.

    ``Future()`` makes a ``Condition`` (with its RLock, a deque and five bound methods) and
    two lists per task, 10 objects the cyclic gc tracks while the task is queued; with
    100,000 tasks queued they made the collector's full passes long. Here the state changes
    under one lock shared by every TaskFuture, a ``Condition`` over it is made only for a
    thread that waits on this future, and one callback (Parsl's) is kept as itself.
    """

    def __init__(self):             # not Future's: see the class docstring
        self._state = PENDING
        self._result = None
        self._exception = None
        self._cond: Optional[threading.Condition] = None
        self._waiting: Optional[list] = None     # ``wait``/``as_completed``'s, once any
        self._callbacks: Any = None              # one callable, or a list of them

    @property
    def _condition(self) -> threading.Condition:
        """The Condition a waiting thread sleeps on (made at the first wait)."""
        with _FUTURES:
            if self._cond is None:
                self._cond = threading.Condition(_FUTURES)
            return self._cond

    @property
    def _waiters(self) -> list:
        with _FUTURES:
            if self._waiting is None:
                self._waiting = []
            return self._waiting

    @property
    def _done_callbacks(self) -> list:
        callbacks = self._callbacks
        return [] if callbacks is None else callbacks if type(callbacks) is list else [callbacks]

    def done(self) -> bool:
        return self._state in _DONE

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def running(self) -> bool:
        return self._state == RUNNING

    def add_done_callback(self, fn) -> None:
        with _FUTURES:
            if self._state not in _DONE:
                callbacks = self._callbacks
                if callbacks is None:
                    self._callbacks = fn
                elif type(callbacks) is list:
                    callbacks.append(fn)
                else:
                    self._callbacks = [callbacks, fn]
                return
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - as Future's own: logged, not raised
            LOGGER.exception("exception calling callback for %r", self)

    def _invoke_callbacks(self) -> None:
        callbacks = self._callbacks
        if callbacks is None:
            return
        for fn in callbacks if type(callbacks) is list else (callbacks,):
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - as Future's own: logged, not raised
                LOGGER.exception("exception calling callback for %r", self)

    def _wait(self, timeout: Optional[float]) -> None:
        if self._state not in _DONE:
            with _FUTURES:
                self._condition.wait_for(lambda: self._state in _DONE, timeout)
        if self._state in _CANCELLED:
            raise CancelledError()
        if self._state != FINISHED:
            raise FutureTimeout()

    def result(self, timeout: Optional[float] = None):
        self._wait(timeout)
        if self._exception is not None:
            try:
                raise self._exception
            finally:
                self = None      # (as Future's) no cycle through the traceback's frame
        return self._result

    def exception(self, timeout: Optional[float] = None):
        self._wait(timeout)
        return self._exception

    def cancel(self) -> bool:
        with _FUTURES:
            if self._state in (RUNNING, FINISHED):
                return False
            if self._state in _CANCELLED:
                return True
            self._state = CANCELLED
            if self._cond is not None:
                self._cond.notify_all()
        self._invoke_callbacks()
        return True

    def set_running_or_notify_cancel(self) -> bool:
        with _FUTURES:
            if self._state == CANCELLED:
                self._state = CANCELLED_AND_NOTIFIED
                for waiter in self._waiting or ():
                    waiter.add_cancelled(self)
                return False
            if self._state == PENDING:
                self._state = RUNNING
                return True
            raise RuntimeError(f"Future in unexpected state: {self._state}")

    def set_result(self, result) -> None:
        self._settle(result, None)

    def set_exception(self, exception) -> None:
        self._settle(None, exception)

    def _settle(self, result, exception) -> None:
        with _FUTURES:
            if self._state in _DONE:
                raise InvalidStateError(f"{self._state}: {self!r}")
            self._result, self._exception, self._state = result, exception, FINISHED
            for waiter in self._waiting or ():
                waiter.add_result(self) if exception is None else waiter.add_exception(self)
            if self._cond is not None:
                self._cond.notify_all()
        self._invoke_callbacks()


@dataclass(eq=False)
class Task:
    """The kernel's record of one task; ``future.hetflow_task`` points to it."""

    id: int
    resources: Resources
    payload: bytes
    future: Future
    times: TaskTimes
    state: TaskState = TaskState.NEW
    #: Its slots and GPU ids (``ranks x gpus_per_rank``, rank-major) once placed (lists;
    #: an empty tuple, no object of its own, while queued).
    slots: Sequence = ()
    devices: Sequence = ()
    #: The verdict the kernel decided (walltime, cancel, shutdown); wins over the runtime's.
    error: Optional[BaseException] = None
    deadline: Optional[Deadline] = None
    #: The runtime's own handle on the running task (a launch, an RP task, ...).
    handle: Any = None
    #: Its files dir as the client follows it (rank output, returned ranks, stacks).
    files: Optional[TaskFiles] = None
    #: Whether its ranks write in its files dir (made when it starts); see ``own_stacks``.
    files_dir: bool = True
    #: Its ranks' resource samples, when sampling is on (:mod:`hetflow.executors.monitoring`).
    samples: Any = None

    @property
    def done(self) -> bool:
        return self.future._state in _DONE      # (a TaskFuture's, or any Future's) no lock


class TaskQueue:
    """Queued tasks, the runtime's :class:`SlotScheduler`, and the dispatch thread."""

    def __init__(self, name: str, scheduler: SlotScheduler, launch: Callable,
                 blocked: Callable):
        #: Held while the queue or the slots change; the kernel keeps its task table under it.
        self.lock = threading.RLock()
        self.scheduler = scheduler
        self._name = name
        self._on_ready, self._on_blocked = launch, blocked
        self._kicked = threading.Condition(self.lock)
        self._pending = False
        self._closed = False
        self._reshaped = 0                  # placement() calls: the slots may have changed
        self._told: tuple = (None, -1)      # (head's weakref, _reshaped) last told blocked()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
        self._thread.start()

    def close(self) -> List:
        """Stop dispatching; the queued tasks, in queue order (the queue is empty after)."""
        with self.lock:
            self._closed = True
            queued = self.scheduler.drain()
            self.kick()
        return queued

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def kick(self) -> None:
        """Wake the dispatcher: slots were freed or tasks queued (call with the lock held)."""
        self._pending = True
        self._kicked.notify()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._pending:
                    self._kicked.wait()
                self._pending = False
                if self._closed:
                    return
            self.dispatch()

    def dispatch(self) -> None:
        """Start what fits now, on the calling thread (the dispatch thread, or a runtime's
        thread that just freed slots: :meth:`release` with ``now``)."""
        with self.lock:
            placed = self._place()
        self._hand_over(*placed)

    def _place(self) -> tuple:
        """Under the lock: take what fits; ``(ready, the blocked head to tell of, or None)``."""
        if self._closed:
            return [], None
        ready = self.scheduler.pop_ready()
        for task, slots, devices in ready:
            task.slots, task.devices = list(slots), list(devices)
            task.state = TaskState.EXECUTING
        blocked = self.scheduler.blocked
        told, reshaped = self._told
        tell = blocked is not None and (told is None or told() is not blocked[0]
                                        or reshaped != self._reshaped) \
            and self.scheduler.may_reshape(blocked)
        if tell:
            self._told = (weakref.ref(blocked[0]), self._reshaped)
        return ready, blocked[0] if tell else None

    def _hand_over(self, ready, blocked) -> None:
        """Outside the lock: start what was placed, tell the runtime of a blocked head."""
        for task, *_ in ready:
            self._on_ready(task)
        if blocked is not None:
            self._on_blocked(blocked)

    # ------------------------------------------------------------------ queue and slots
    def push(self, task, slots: int, gpus: int, now: bool = False) -> None:
        """Queue ``task``; ``now``: the caller calls :meth:`dispatch` itself (outside the
        lock), else the dispatch thread is woken."""
        with self.lock:
            task.state = TaskState.SCHEDULING
            self.scheduler.push(task, slots, gpus)
            if not now:
                self.kick()

    def remove(self, task) -> bool:
        """Take ``task`` out of the queue; whether it was queued."""
        with self.lock:
            return self.scheduler.remove(task)

    def drain(self) -> List:
        """Empty the queue; the tasks that were in it."""
        with self.lock:
            return self.scheduler.drain()

    def release(self, slots=(), devices=(), now: bool = False) -> None:
        """Free ``slots`` and ``devices``; ``now``: start what fits on this thread at once
        (no hand-over to the dispatch thread), else wake the dispatch thread."""
        with self.lock:
            if slots:
                self.scheduler.release(slots)
            if devices:
                self.scheduler.release_devices(devices)
            if not now:
                self.kick()
                return
            placed = self._place()          # in the same hold of the lock
        self._hand_over(*placed)

    def requeue(self, tasks, release: bool, need: Callable) -> None:
        """Queue running ``tasks`` again, first; ``need(task)``: its ``(slots, gpus)``."""
        with self.lock:
            for task in tasks:
                if release and task.slots:
                    self.scheduler.release(task.slots)
                self.scheduler.release_devices(task.devices)
                if task.deadline is not None:
                    task.deadline.cancel()
                task.slots, task.devices = (), ()
                task.state, task.deadline = TaskState.SCHEDULING, None
                self.scheduler.push_front(task, *need(task))
            self.kick()

    @contextlib.contextmanager
    def placement(self, wake: bool = False) -> Iterator[SlotScheduler]:
        """The scheduler under the lock, to read or reshape; ``wake``: dispatch again after."""
        with self.lock:
            self._reshaped += 1
            yield self.scheduler
            if wake:
                self.kick()
