"""The report's runtime-CPU column: the CPU each runtime spends on itself, in cores, idle and
while a task runs (measured by :mod:`hetflow.executors.runtime_cpu`).

The runner opens its runtimes with ``sample_s=SAMPLE_S`` (each rank samples its CPU when a
task starts and when it returns: what subtracting the task's own CPU needs), measures each
runtime for ``IDLE_S`` seconds after it started with no task (``idle(dfk)``, on the session
row), and each task from submit to result (``task_window()``, on the task row).
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


def idle(dfk) -> Dict[str, float]:
    """The session row's fields: the runtime's own CPU while no task runs."""
    meter = _meter(dfk)
    meter.start()
    time.sleep(IDLE_S)
    window = meter.stop()
    return {"idle_runtime_cores": window["runtime_cores"], "runtime_processes": window["processes"]}


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
        if (r.get("kind") == "session" and r.get("idle_runtime_cores") is not None) or \
                (r.get("kind") == "task" and r.get("runtime_cores") is not None):
            by_executor.setdefault(r["executor"], []).append(r)
    if not by_executor:
        return []
    body = []
    for executor, found in sorted(by_executor.items()):
        tasks = [r for r in found if r["kind"] == "task"]
        body.append(f"| {executor} | {stat(found, 'idle_runtime_cores')} | "
                    f"{stat(tasks, 'runtime_cores')} | {len(tasks)} |")
    return [f"Runtime CPU, in cores: the CPU of the runtime's own processes (client, launchers, "
            f"pilot agent, brokers, idle ranks) per wall second, idle ({IDLE_S:g} s after "
            f"start) and while a task ran (submit to result, its ranks' CPU inside the task "
            f"taken out):", "",
            "| Executor | Runtime CPU idle | Runtime CPU, task running | Tasks |",
            "|---|---|---|---|", *body, ""]
