"""The CPU a runtime spends on itself: its client, launchers, pilot agent, brokers, idle ranks.

A runtime's processes are the client's own (``hetflow.runtime`` runs in it: Parsl's
DataFlowKernel, the executor's threads) and every process that carries the runtime's
guardian token in its environment (``hetflow._guardian``: whatever the runtime started,
however it was started). :class:`RuntimeCPU` reads their CPU seconds from ``/proc``
(``utime + stime``, plus ``cutime + cstime``: the CPU of children they have waited for, so a
launcher's ranks that ended inside a window still count, through the launcher and the client
that reaped them). Over a window:

    runtime CPU = the CPU of those processes in the window
                  - the CPU the tasks' ranks spent inside the task (their resource samples,
                    :mod:`hetflow.executors._ranksample`: the final sample's CPU seconds
                    minus the first's, from entering the task to returning)

in cores: divided by the window's wall seconds. An idle runtime's window has no task. What
ranks do outside the task (start-up, imports, waiting for the next task) is the runtime's.
A process that ended in the window without being waited for by one of these (re-parented
to init) is not counted; one that started in it counts whole.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Iterable, Optional, Tuple

from hetflow._guardian import START_TICKS, marked_processes, stat_fields

_TICK = os.sysconf("SC_CLK_TCK")
#: Indexes into ``stat_fields``: utime, stime, cutime, cstime (proc(5) fields 14-17).
_CPU = (11, 12, 13, 14)


def process_cpu(pid) -> Optional[Tuple[int, float]]:
    """``(start ticks, CPU seconds)`` of ``pid`` and the children it waited for, or None."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return int(fields[START_TICKS]), sum(int(fields[i]) for i in _CPU) / _TICK


def task_cpu(samples_by_rank: Dict[int, list]) -> float:
    """CPU seconds a task's ranks spent in it: final sample minus first, summed over ranks."""
    total = 0.0
    for rows in samples_by_rank.values():
        if len(rows) >= 2:
            first, last = rows[0], rows[-1]
            total += (last["cpu_user_s"] + last["cpu_system_s"]
                      - first["cpu_user_s"] - first["cpu_system_s"])
    return total


class RuntimeCPU:
    """Windows of a runtime's own CPU use (see the module docstring).

    ``token``: the runtime's guardian token (``dfk.hetflow_token``); ``client``: the client's
    pid (this process).
    """

    def __init__(self, token: str, client: Optional[int] = None):
        self.token, self.client = token, os.getpid() if client is None else client
        self._start: Dict[int, Tuple[int, float]] = {}
        self._t0 = 0.0

    def snapshot(self) -> Dict[int, Tuple[int, float]]:
        """``{pid: (start ticks, CPU seconds)}`` of the runtime's processes now."""
        found = {}
        for pid in {self.client, *marked_processes(self.token)}:
            cpu = process_cpu(pid)
            if cpu is not None:
                found[pid] = cpu
        return found

    def start(self) -> None:
        """Open a window."""
        self._start = self.snapshot()
        self._t0 = time.monotonic()

    def stop(self, tasks: Iterable[Dict[int, list]] = ()) -> dict:
        """Close the window: ``{"wall_s", "cpu_s", "task_cpu_s", "runtime_cpu_s",
        "runtime_cores", "processes"}``, ``tasks`` being the samples (``task_samples``) of
        the tasks that ran in it."""
        wall = time.monotonic() - self._t0
        spent = time.thread_time()
        end = self.snapshot()
        # The client's own reading of /proc (this call) is the measurement's, not the runtime's.
        spent = time.thread_time() - spent
        cpu = 0.0
        for pid, (started, seconds) in end.items():
            before = self._start.get(pid)
            cpu += seconds - (before[1] if before and before[0] == started else 0.0)
        cpu -= spent
        in_tasks = sum(task_cpu(samples) for samples in tasks)
        own = max(0.0, cpu - in_tasks)
        return {"wall_s": wall, "cpu_s": cpu, "task_cpu_s": in_tasks, "runtime_cpu_s": own,
                "runtime_cores": own / wall if wall > 0 else float("nan"),
                "processes": len(end)}
