"""The report's numbers and tables: a results file's rows, each run's latest, and a field's
median with its spread (``stat``), written as Markdown tables."""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

from hetflow.experiments import noise


# --------------------------------------------------------------------------- loading
def load_rows(path: str) -> List[dict]:
    """Every row of a results file (blank lines ignored)."""
    rows = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from exc
    return rows


def latest_runs(rows: Sequence[dict]) -> Dict[str, List[dict]]:
    """Experiment -> the rows of its latest run in the file (a file may hold several runs)."""
    last: Dict[str, str] = {}
    for r in rows:
        if r.get("kind") == "run":
            last[r["experiment"]] = r["run_id"]
    out: Dict[str, List[dict]] = defaultdict(list)
    for r in rows:
        if last.get(r.get("experiment")) == r.get("run_id"):
            out[r["experiment"]].append(r)
    return dict(out)


# --------------------------------------------------------------------------- numbers
values = noise.values    # a field's finite numbers over the rows


def median(rows, field) -> Optional[float]:
    vals = values(rows, field)
    return statistics.median(vals) if vals else None


def fmt(v: Optional[float], digits: int = 3) -> str:
    """Seconds (or any number) to 3 significant digits; '–' when there is none."""
    if v is None:
        return "–"
    if v == 0:
        return "0"
    mag = abs(v)
    if mag >= 100:
        return f"{v:,.0f}"
    return f"{v:.{max(0, digits - 1 - int(math.floor(math.log10(mag))))}f}"


def stat(rows, field) -> str:
    """``median [min–max]`` over the rows that have ``field``, marked (``noise.marks``)
    when fewer than 3 or measured on a busy machine."""
    vals = values(rows, field)
    if not vals:
        return "–"
    med = statistics.median(vals)
    if len(vals) == 1:
        return fmt(med) + noise.marks(list(rows), field)
    return f"{fmt(med)} [{fmt(min(vals))}–{fmt(max(vals))}]" + noise.marks(list(rows), field)


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return lines + [""]


def ranks_label(ranks: int, oversubscribed: bool) -> str:
    return f"{ranks}†" if oversubscribed else str(ranks)


def group(rows, *keys) -> Dict[tuple, List[dict]]:
    out: Dict[tuple, List[dict]] = defaultdict(list)
    for r in rows:
        out[tuple(r.get(k) for k in keys)].append(r)
    return out


def executors_in(rows, run_row) -> List[str]:
    """Executors in the config's order, then any others seen (peers, bare mpiexec)."""
    seen = []
    for e in (run_row.get("config", {}).get("executors") or []):
        if e not in seen:
            seen.append(e)
    for r in rows:
        e = r.get("executor")
        if e and e not in seen:
            seen.append(e)
    return seen
