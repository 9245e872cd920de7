"""What an experiment writes as it runs: the results file (``Recorder``, one JSON line a
row), its progress on the terminal (``Progress``), and a runtime's life around a block of
tasks (``runtime_session``: start-up and shut-down times, the runtime's own idle CPU)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from typing import List, Optional

from hetflow.experiments import owncpu
from hetflow.experiments.config import ExperimentConfig
from hetflow.experiments.env import host_info, library_versions

#: The executor name of the bare baseline: ``mpiexec -n R python ...`` with no hetflow runtime.
BARE = "mpiexec"
#: Seconds one task may take before it is recorded as an error (nothing may hang a report).
TASK_TIMEOUT_S = 900.0


def cores() -> int:
    return os.cpu_count() or 1


def executors_of(cfg) -> List[str]:
    """The config's hetflow runtimes (the bare ``mpiexec`` baseline is not one)."""
    return [e for e in cfg.executors if e != BARE]


class Recorder:
    """Appends rows to the results file, stamping each with the run's shared fields."""

    def __init__(self, path: str, run_id: Optional[str] = None):
        self.path = path
        self.run_id = run_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.rows = 0

    def write(self, **row) -> dict:
        row = {"run_id": self.run_id, "time": time.time(), **row,
               "host": host_info(), "versions": library_versions()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row, default=_jsonable) + "\n")
        self.rows += 1
        return row


def _jsonable(value):
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


class Progress:
    """One experiment's progress: a tqdm bar on a terminal (nothing otherwise), then one
    summary line, on a terminal or not."""

    def __init__(self, experiment: str, total: int, stream=None):
        from hetflow._progress import bar

        self.experiment = experiment
        self.total = max(total, 1)
        self.done = 0
        self.errors = 0
        self.skipped = 0
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.note = ""
        self._bar = bar(self.total, f"[{experiment}]", self.stream)

    def step(self, note: str = "", n: int = 1, error: bool = False, skipped: bool = False) -> None:
        n = min(n, self.total - self.done)
        self.done += n
        self.errors += int(error)
        self.skipped += n if skipped else 0
        self.note = note
        self._bar.set_postfix_str(self._problems() + note, refresh=False)
        self._bar.update(n)

    def _problems(self) -> str:
        text = f"{self.errors} error(s), " if self.errors else ""
        return text + (f"{self.skipped} not run, " if self.skipped else "")

    def close(self) -> None:
        self._bar.close()
        problems = self._problems().rstrip(", ")
        self.stream.write(f"[{self.experiment}] {self.done}/{self.total} in "
                          f"{time.perf_counter() - self.t0:.1f}s"
                          + (f", {problems}" if problems else "") + "  done\n")
        self.stream.flush()


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__


@contextlib.contextmanager
def runtime_session(cfg: ExperimentConfig, name: str, rec: Recorder, max_ranks: int):
    """Start runtime ``name`` for the block, recording start-up and shut-down times.

    Yields None (after recording a row) when the runtime is not installed or
    fails to start, so the experiment moves on to the next executor.
    """
    from hetflow.runtime import available_runtimes, runtime

    if name not in available_runtimes():
        rec.write(kind="skipped", experiment=cfg.name, executor=name,
                  reason=f"runtime {name!r} is not installed "
                         f"(installed: {sorted(available_runtimes())})")
        yield None
        return
    options = {"max_ranks": max_ranks, **cfg.executor_options.get(name, {})}
    t0 = time.perf_counter()
    manager = runtime(name, sample_s=owncpu.SAMPLE_S, **options)
    try:
        dfk = manager.__enter__()
    except Exception as exc:  # noqa: BLE001 - a runtime that won't start is a result too
        rec.write(kind="error", experiment=cfg.name, executor=name, stage="start",
                  error=first_line(exc))
        yield None
        return
    startup_s = time.perf_counter() - t0
    own_cpu = owncpu.idle(dfk, "start_runtime_cores", cfg.idle_s)
    session = {"startup_s": startup_s, "options": options}
    try:
        yield session
        own_cpu.update(owncpu.idle(dfk, seconds=cfg.idle_s))   # settled: after the last task
    finally:
        t1 = time.perf_counter()
        try:
            manager.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - a runtime that fails to stop is recorded, not fatal
            rec.write(kind="error", experiment=cfg.name, executor=name, stage="shutdown",
                      error=first_line(exc))
        rec.write(kind="session", experiment=cfg.name, executor=name,
                  max_ranks=options["max_ranks"],
                  options=options, startup_s=startup_s, shutdown_s=time.perf_counter() - t1,
                  **own_cpu)
