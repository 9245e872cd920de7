"""Lowering a process's CPU priority, and its threads' (standard library only: RP's RAPTOR
master and worker import it in the pilot; see ``executors/radical/priority.py`` for why).

Only lowering is done, which needs no privileges. Linux's autogroup scheduler shares the
CPU between sessions first: a session's group is lowered by writing its nice value to
``/proc/self/autogroup``; within a group, threads are weighed by their own nice value.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

#: The nice value a runtime's own processes get (the lowest).
NICE = 19
#: The environment variable that tells RP's RAPTOR master and worker to lower themselves.
ENV = "HETFLOW_YIELD_CPU"


def wanted() -> bool:
    """Whether this process was asked to lower itself (``$HETFLOW_YIELD_CPU`` is "1")."""
    return os.environ.get(ENV) == "1"


def lower_group(nice: int = NICE) -> bool:
    """Lower this process's autogroup (its session) to ``nice``; False where there is none."""
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(nice))
        return True
    except OSError:
        return False


def thread_ids(pid: int) -> list:
    """The ids of process ``pid``'s threads (none if it has gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def lower_threads(pid: int = 0, nice: int = NICE, keep: Iterable[Optional[int]] = ()) -> int:
    """Lower every thread of process ``pid`` (0: this one) to ``nice`` but those in ``keep``
    (thread ids); threads they start later inherit it. Returns how many were lowered."""
    pid = pid or os.getpid()
    keep = {t for t in keep if t}
    lowered = 0
    for tid in thread_ids(pid):
        if tid in keep:
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            lowered += 1
        except OSError:      # gone meanwhile
            continue
    return lowered
