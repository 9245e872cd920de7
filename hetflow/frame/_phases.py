"""Optional per-phase accounting of the engine's collective operations (for the benchmark).

``with phase("exchange"):`` around a step adds its wall and CPU seconds to a per-process tally
when accounting is on (:func:`enable`), and costs one attribute test when it is off. Phases nest;
each records its *exclusive* time (a nested phase's time is taken out of its parent's), so the
phases of one operation add up to the operation's time. CPU seconds are this process's (all its
threads), so a rank that busy-waits in MPI shows CPU time there, and one that sleeps does not.
Each phase also counts the page faults it took: the fresh memory it touched, which the kernel
zeroes (part of its CPU seconds, see docs/engine.md).
"""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from typing import Dict, List, Tuple

_on = False
_totals: Dict[str, List[float]] = {}  # name -> [wall s, cpu s, page faults]
_stack: List[List[float]] = []  # per open phase: [child wall, child cpu, child faults]


def enable(on: bool = True) -> None:
    """Turn accounting on (or off) for this process and clear the tally."""
    global _on
    _on = bool(on)
    _totals.clear()
    _stack.clear()


def take() -> Dict[str, Tuple[float, float, int]]:
    """The tally so far as {phase: (wall s, cpu s, page faults)}, and a fresh one started."""
    out = {k: (v[0], v[1], int(v[2])) for k, v in _totals.items()}
    _totals.clear()
    return out


@contextmanager
def phase(name: str):
    """Account the enclosed step under ``name`` (see the module docstring)."""
    if not _on:
        yield
        return
    _stack.append([0.0, 0.0, 0])
    f0 = _faults()
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        faults = _faults() - f0
        child = _stack.pop()
        tally = _totals.setdefault(name, [0.0, 0.0, 0])
        tally[0] += wall - child[0]
        tally[1] += cpu - child[1]
        tally[2] += faults - child[2]
        if _stack:
            _stack[-1][0] += wall
            _stack[-1][1] += cpu
            _stack[-1][2] += faults


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
