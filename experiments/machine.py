"""What else the machine did while a measurement ran: its load, and the CPU that processes
other than the measurement's own used (psutil).

A measurement's own processes are its ranks and, under a hetflow runtime, every process that
runtime started (they carry its guardian's mark, see ``hetflow._guardian``) and its client.
:class:`Window` reads every process's CPU seconds at its start and stop; a row then says
``others_cores`` (CPU of all other processes, in cores), ``op_runtime_cores`` (the runtime's own,
the ranks excepted), ``load1`` and ``busy``: others used more than :data:`BUSY_CORES`.
A process that started and ended inside the window is not seen (others' CPU is a floor).
"""
from __future__ import annotations

import os
import time
from typing import Dict, Iterable, Optional

#: Other processes using more than this many cores during a measurement mark it busy.
BUSY_CORES = 0.25


def _cpu_all() -> Dict[int, float]:
    import psutil

    out = {}
    for proc in psutil.process_iter():
        try:
            t = proc.cpu_times()
            out[proc.pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


def runtime_processes() -> set:
    """Pids of this runtime's processes: those carrying the same guardian mark as this one,
    and the client the guardian watches (its parent). Empty outside a hetflow runtime."""
    import psutil

    from hetflow._guardian import ENV_PREFIX, marked_processes

    token = next((k[len(ENV_PREFIX):] for k in os.environ if k.startswith(ENV_PREFIX)), None)
    if token is None:
        return set()
    pids = set(marked_processes(token))
    for proc in psutil.process_iter():
        try:
            if token in " ".join(proc.cmdline()):       # the guardian: its parent is the client
                pids.update({proc.pid, proc.ppid()})
        except psutil.Error:
            continue
    return pids


class Window:
    """CPU of every process between :meth:`start` and :meth:`stop` (see the module doc)."""

    def start(self) -> "Window":
        self.t0 = time.monotonic()
        self.before = _cpu_all()
        return self

    def stop(self, ranks: Iterable[int] = (), own: Optional[set] = None,
             busy_cores: float = BUSY_CORES) -> dict:
        after = _cpu_all()
        dt = max(time.monotonic() - self.t0, 1e-9)
        ranks = set(ranks)
        own = (runtime_processes() if own is None else set(own)) | ranks | {os.getpid()}
        used = {pid: after[pid] - self.before.get(pid, 0.0) for pid in after}
        others = sum(v for pid, v in used.items() if pid not in own and v > 0) / dt
        return {"load1": os.getloadavg()[0], "others_cores": others,
                "op_runtime_cores": sum(used.get(p, 0.0) for p in own - ranks) / dt,
                "busy": others > busy_cores}
