"""The watch policy: every time limit a runtime enforces, in one component.

Three ideas, each one named constant or setting:

- **walltime**: a task's own limit (``Resources.walltime``); the kernel arms it when
  the task starts and, when it passes, calls the runtime's ``_stop`` hook with
  :class:`~hetflow.WalltimeExceeded`.
- **failed-peer grace** (:data:`PEER_GRACE_S`): after one rank of a task failed or
  vanished, how long its peers may go on before they are taken to wait in a
  collective that will never complete, and the runtime's stop hook ends them.
- **evidence grace** (:data:`EVIDENCE_GRACE_S`): how long a dead rank's supervisor
  (or a pilot's launch script) gets to record how the rank ended before the error
  is built from what is known.

:class:`Watch` is a timer thread with cancellable deadlines; the kernel keeps one
per executor, and a launcher away from the client (Parsl's worker) keeps its own.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

#: Seconds a task's peers may run on after one of its ranks failed or vanished.
#: Hydra stops a dead rank's peers in milliseconds, but under load it was once seen
#: never to notice; MPI cannot interrupt a rank that waits in a collective.
PEER_GRACE_S = 2.0
#: Seconds a dead rank's supervisor (or pilot) gets to record how the rank ended.
EVIDENCE_GRACE_S = 2.0
#: How often running ranks' processes are polled where they cannot be waited on.
POLL_S = 0.02


class Deadline:
    """One armed deadline; :meth:`cancel` disarms it (idempotent)."""

    __slots__ = ("when", "action", "cancelled", "_owner")

    def __init__(self, when: float, action: Callable[[], None], watch=None):
        self.when = when
        self.action = action
        self.cancelled = False
        self._owner = watch

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.action = None          # what it would have run (a task) is not kept
            if self._owner is not None:
                self._owner._cancelled()

    def remaining(self) -> float:
        return self.when - time.monotonic()


class Watch:
    """Runs actions at deadlines (``time.monotonic()``), on one daemon thread."""

    def __init__(self, name: str = "hetflow-watch"):
        self._name = name
        self._heap: list = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._dead = 0              # cancelled deadlines still in the heap (about)

    def after(self, seconds: float, action: Callable[[], None]) -> Deadline:
        """Run ``action()`` in ``seconds`` unless the returned deadline is cancelled first."""
        deadline = Deadline(time.monotonic() + seconds, action, self)
        with self._cond:
            if self._closed:
                deadline.cancel()
                return deadline
            heapq.heappush(self._heap, (deadline.when, next(self._order), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return deadline

    def _cancelled(self) -> None:
        """A deadline was cancelled: once most are, drop them (a walltime per task must not
        keep every delivered task's deadline until it would have passed)."""
        with self._cond:
            self._dead += 1
            if self._dead > 64 and self._dead * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].cancelled]
                heapq.heapify(self._heap)
                self._dead = 0

    def close(self) -> None:
        """Disarm everything and end the thread."""
        with self._cond:
            self._closed = True
            for _, _, deadline in self._heap:
                deadline.cancelled, deadline.action = True, None
            self._heap.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or
                                            self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, _, deadline = heapq.heappop(self._heap)
                if deadline.cancelled:
                    self._dead = max(0, self._dead - 1)
                    continue
                action = deadline.action
            if action is None:              # cancelled just now
                continue
            try:
                action()
            except Exception:  # one failing action must not end every watch (logged)
                logger.exception("%s: a deadline action failed", self._name)
