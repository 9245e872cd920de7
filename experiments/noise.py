"""When a figure or a comparison can be trusted: the report's rules.

- A figure is the median over its repeats with the spread ``[min–max]``; fewer than
  :data:`MIN_N` repeats is marked ``(n=N)``: not a result.
- A figure any of whose repeats ran on a busy machine (``busy``: other processes used CPU
  meanwhile, see ``experiments/machine.py``) is marked ``‡``.
- Two figures compare as a ratio only where their ``[min–max]`` ranges do not overlap and
  each has ``MIN_N`` repeats; otherwise "within noise" (overlap) or "n<3".
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, List

#: Repeats a figure needs to count as a result.
MIN_N = 3
BUSY_MARK = "‡"
LEGEND = (f"Figures: median [min–max] over repeats; (n=N): fewer than {MIN_N} repeats, not a "
          f"result; {BUSY_MARK}: at least one repeat ran while other processes used CPU (the "
          "machine was busy, see the rows' `others_cores`, `load1`). A comparison is a ratio "
          "only where both ranges do not overlap and both have n ≥ 3; otherwise it says "
          "\"within noise\" (or n<3).")


def values(rows: Iterable[dict], field: str) -> List[float]:
    out = []
    for r in rows:
        v = r.get(field)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def marks(rows: List[dict], field: str) -> str:
    """`` (n=N)`` and/or `` ‡`` for the rows behind one figure."""
    n = len(values(rows, field))
    text = f" (n={n})" if 0 < n < MIN_N else ""
    if any(r.get("busy") for r in rows if field in r):
        text += f" {BUSY_MARK}"
    return text


def compare(base: List[dict], mine: List[dict], field: str,
            show: Callable[[float, float], str]) -> str:
    """``show(mine_median, base_median)`` where both have MIN_N values and disjoint ranges;
    "within noise" where the ranges overlap; "n<3" where either is short; "–" if empty."""
    a, b = values(base, field), values(mine, field)
    if not a or not b:
        return "–"
    if len(a) < MIN_N or len(b) < MIN_N:
        return f"n<{MIN_N}"
    if min(b) <= max(a) and min(a) <= max(b):
        return "within noise"
    return show(_median(b), _median(a))


def _median(vals: List[float]) -> float:
    s = sorted(vals)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def ratio(mine: float, base: float, digits: int = 2) -> str:
    return f"{mine / base:.{digits}f}x" if base else "–"
