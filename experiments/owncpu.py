"""The report's runtime-CPU column: the CPU each runtime spends on itself, in cores, idle and
while a task runs (measured by :mod:`hetflow.executors.runtime_cpu`).

The runner opens its runtimes with ``sample_s=SAMPLE_S`` (each rank samples its CPU when a
task starts and when it returns: what subtracting the task's own CPU needs) and measures each
runtime with no task twice, for the config's ``idle_s`` seconds each (``idle(dfk)``, on the
session row): right after it started (``start_runtime_cores``: workers still starting,
imports) and after its last task, before shut-down (``idle_runtime_cores``: settled). It
measures each task from submit to result (``task_window()``, on the task row).

Rows written before Dec 8 have ``idle_runtime_cores`` only, measured right after start: the
report reads it as ``start_runtime_cores`` (``start_cores``).
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List

#: Seconds an idle runtime is measured after its start.
IDLE_S = 2.0
#: The ranks' sampling interval in experiments: longer than any task, so a rank takes two
#: samples per task (entering, returning).
SAMPLE_S = 3600.0


def _meter(dfk=None):
    import parsl

    from hetflow.executors.runtime_cpu import RuntimeCPU

    return RuntimeCPU((dfk or parsl.dfk()).hetflow_token)


def idle(dfk, field: str = "idle_runtime_cores", seconds: float = IDLE_S) -> Dict[str, float]:
    """The session row's fields: the runtime's own CPU over ``seconds`` with no task, as
    ``field`` (``"start_runtime_cores"`` right after start, ``"idle_runtime_cores"`` after
    the last task)."""
    meter = _meter(dfk)
    meter.start()
    time.sleep(seconds)
    window = meter.stop()
    return {field: window["runtime_cores"], "runtime_processes": window["processes"],
            "idle_s": seconds}


def start_cores(row: dict):
    """A session row's CPU in the first ``IDLE_S`` seconds after start (older rows called it
    ``idle_runtime_cores``)."""
    if "start_runtime_cores" in row:
        return row["start_runtime_cores"]
    return row.get("idle_runtime_cores")


def settled_cores(row: dict):
    """A session row's CPU with no task after its tasks (None for rows from before Dec 8)."""
    return row.get("idle_runtime_cores") if "start_runtime_cores" in row else None


@contextlib.contextmanager
def task_window():
    """Around one task's submit and result: yields a dict; put the task's future in it as
    ``"future"``; afterwards it holds the task row's fields (``runtime_cpu_s``, ``runtime_cores``,
    ``task_cpu_s``)."""
    import hetflow

    meter = _meter()
    meter.start()
    fields: dict = {}
    yield fields
    future = fields.pop("future", None)
    samples = [hetflow.task_samples(future)] if future is not None else []
    window = meter.stop(samples)
    if not samples or not samples[0]:
        return                                   # no samples: the task's own CPU is unknown
    fields.update(runtime_cpu_s=window["runtime_cpu_s"], runtime_cores=window["runtime_cores"],
                  task_cpu_s=window["task_cpu_s"])


def lines(rows: List[dict], stat) -> List[str]:
    """The report's runtime-CPU table for one run's rows ([] when none was measured);
    ``stat(rows, field)`` writes a cell (the report's own, so the column reads like the rest)."""
    by_executor: Dict[str, List[dict]] = {}
    for r in rows:
        if (r.get("kind") == "session" and start_cores(r) is not None) or \
                (r.get("kind") == "task" and r.get("runtime_cores") is not None):
            by_executor.setdefault(r["executor"], []).append(r)
    if not by_executor:
        return []
    body, window_s = [], max((r.get("idle_s", IDLE_S) for r in rows if r.get("kind") == "session"),
                             default=IDLE_S)
    for executor, found in sorted(by_executor.items()):
        tasks = [r for r in found if r["kind"] == "task"]
        sessions = [r for r in found if r["kind"] == "session"]
        settled = [dict(r, cores=settled_cores(r)) for r in sessions
                   if settled_cores(r) is not None]
        started = [dict(r, cores=start_cores(r)) for r in sessions]
        body.append(f"| {executor} | {stat(settled, 'cores') if settled else 'not measured'} | "
                    f"{stat(started, 'cores')} | {stat(tasks, 'runtime_cores')} | {len(tasks)} |")
    return [f"Runtime CPU, in cores: the CPU of the runtime's own processes (client, launchers, "
            f"pilot agent, brokers, idle ranks) per wall second: idle ({window_s:g} s with no task "
            f"after the runtime's last task: settled), in the first {window_s:g} s after its start "
            f"(workers still starting: a start-up cost, not an idle one) and while a task ran "
            f"(submit to result, its ranks' CPU inside the task taken out). \"not measured\": "
            f"the run predates the settled measure (Dec 8).", "",
            f"| Executor | Runtime CPU idle | Runtime CPU, first {window_s:g} s | Runtime CPU, task running "
            "| Tasks |",
            "|---|---|---|---|---|", *body, ""]
