"""``hetflow.runtime(name)``: load a Parsl DataFlowKernel on one hetflow executor.

Executors are found by name through the ``hetflow.executors`` entry-point group,
so a third party adds a runtime by declaring one in its own package metadata.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from importlib.metadata import entry_points
from typing import Any, Dict, Iterator, Optional

from hetflow._guardian import Guardian
from hetflow.errors import ConfigError, InputError, NotSupported, ResourcesUnavailable, TaskCancelled

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hetflow.executors"

#: Parsl's retry budget when hetflow's handler decides per task (fail costs are 0/1/infinite).
_RETRY_BUDGET = 1_000_000


#: Runtimes that need an optional extra: name -> (the module it imports, the extra).
EXTRAS = {"radical": ("radical.pilot", "radical")}


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):     # a missing parent package, or one blocked in sys.modules
        return False


def _missing_extra(name: str) -> Optional[str]:
    """The install command a runtime's extra needs, or None when it is installed."""
    module, extra = EXTRAS.get(name, (None, None))
    if module is None or _importable(module):
        return None
    return f"pip install 'hetflow[{extra}]'"


def available_runtimes() -> Dict[str, Any]:
    """Runtime name -> entry point, for every hetflow executor installed with what it needs."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)
            if _missing_extra(ep.name) is None}


def executor_class(name: str):
    """The executor class registered under ``name``."""
    found = available_runtimes()
    if name not in found:
        install = _missing_extra(name)
        if install is not None:
            raise ConfigError(f"runtime {name!r} needs the {EXTRAS[name][0]} package, which is "
                              f"not installed: {install}")
        raise ConfigError(f"unknown runtime {name!r}; installed: {sorted(found)}")
    return found[name].load()


def _script_name() -> str:
    """The file of the first caller outside hetflow and contextlib (what Parsl's own
    search for a workflow name would find, were hetflow.runtime not in the way)."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(here + os.sep) and os.path.basename(path) != "contextlib.py":
            return os.path.basename(path)
        frame = frame.f_back
    return "unnamed"


def retryable(exc: BaseException) -> bool:
    """False for failures a retry cannot fix: bad config, bad input, cancellation."""
    never = (ConfigError, InputError, NotSupported, ResourcesUnavailable, TaskCancelled)
    if isinstance(exc, never):
        return False
    inner = getattr(exc, "exception", None)
    if isinstance(inner, never):
        return False
    return True


def retry_cost(exc: BaseException, task_record) -> float:
    """Parsl ``retry_handler``: retry up to the app's ``retries`` unless the error is final.

    Parsl's error for a task whose dependency failed becomes a
    :class:`~hetflow.DependencyFailed` here, its message ending with the root cause."""
    from parsl.dataflow.errors import DependencyError

    if isinstance(exc, DependencyError):
        from hetflow import _chained

        _chained.explain(exc, task_record)   # Parsl skips a dependency failure's retries
    spec = task_record.get("resource_specification") or {}
    allowed = (spec.get("hetflow") or {}).get("retries", 0)
    if not retryable(exc) or task_record["fail_count"] > allowed:
        return _RETRY_BUDGET + 1
    return 1


def make_config(executor, *, run_dir: str, monitoring=None, memoizer=None, **config_options):
    """A Parsl Config around one hetflow executor, with hetflow's retry policy."""
    from parsl.config import Config

    options = dict(executors=[executor], run_dir=run_dir, retries=_RETRY_BUDGET,
                   retry_handler=retry_cost, initialize_logging=False, monitoring=monitoring,
                   usage_tracking=0)
    options.update(getattr(executor, "parsl_config_options", lambda: {})())
    if memoizer is not None:
        options["memoizer"] = memoizer
    options.update(config_options)
    return Config(**options)


@contextlib.contextmanager
def runtime(name: str = "mpirun", *, run_dir: Optional[str] = None, keep_run_dir: bool = False,
            monitoring=None, memoizer=None, checkpoint: Optional[str] = None,
            config_options: Optional[dict] = None, output: Any = "console",
            progress: Optional[bool] = None, hang_warning_s: Optional[float] = None,
            sample_s: Optional[float] = None, **executor_options) -> Iterator[Any]:
    """Start runtime ``name`` (``"mpirun"``, ``"parsl"``, ``"radical"``, ``"pool"``) for the block.

    Yields the Parsl DataFlowKernel; MPI apps called inside the block run on it.
    ``run_dir`` (default: a fresh temp dir) holds Parsl's run info and the
    executor's task dirs and sandboxes; it is removed on exit unless
    ``keep_run_dir`` or ``run_dir`` was given, or a failed start's error names logs in
    it (``LaunchError.logs``: they stay, and a note on the error says so).
    ``checkpoint`` (a directory) journals every finished task's result there; a
    later runtime with the same directory skips those tasks (see
    :mod:`hetflow.journal`). ``output``: where the ranks' stdout and stderr go
    (``"console"``: the client's stdout, each line prefixed ``[task N rank R]``;
    ``"files"``: one file per task in the runtime's dir; ``"off"``; or a text stream).
    ``progress``: a bar of the block's tasks on stderr (default: when stderr is a
    terminal). ``hang_warning_s``: seconds after a task's first rank returned before a
    warning names the ranks still running. ``sample_s``: every rank of every task samples
    its CPU, memory and GPU use every ``sample_s`` seconds (``hetflow.task_samples``); a
    ``monitoring`` hub with ``resource_monitoring_enabled`` turns it on at its own
    interval and stores the samples in its database (see
    :mod:`hetflow.executors.monitoring`). Extra keywords go to the executor.

    Every process the runtime starts dies with the client, however the client
    ends (``kill -9`` included): a guardian process watches it (see
    :mod:`hetflow._guardian`); ``dfk.hetflow_token`` names the environment mark
    those processes carry.
    """
    import parsl

    cls = executor_class(name)
    if monitoring is not None and getattr(monitoring, "workflow_name", "") is None:
        # Parsl names the workflow after the first file on the stack that is not its own:
        # this one. Name it after the user's script instead.
        monitoring.workflow_name = _script_name()
    if checkpoint is not None:
        if memoizer is not None:
            raise ConfigError("give either checkpoint= or memoizer=, not both")
        from hetflow.journal import Journal

        memoizer = Journal(checkpoint)
    from hetflow._private import private_dir, private_umask, within

    owned = run_dir is None
    # mkdtemp makes the dir 0700; a given run_dir is made (or tightened to) 0700 too:
    # it holds pickles the runtime unpickles and the pool's key.
    base = tempfile.mkdtemp(prefix=f"hetflow-{name}-") if owned else os.path.abspath(run_dir)
    private_dir(base)
    # Before any executor starts: everything it starts carries the guardian's token, so
    # it all dies with the client, however the client dies (see hetflow._guardian).
    guardian = Guardian(base, remove=owned and not keep_run_dir)
    campaign = None
    try:
        executor = cls(**executor_options)
        executor.output = output
        if hang_warning_s is not None:
            executor.hang_warning_s = hang_warning_s
        if sample_s is not None:
            if isinstance(sample_s, bool) or not isinstance(sample_s, (int, float)) \
                    or not sample_s > 0:
                raise ConfigError(f"sample_s must be a positive number of seconds, got "
                                  f"{sample_s!r}")
            executor.sample_s = float(sample_s)
        from hetflow import _progress

        if progress or (progress is None and _progress.enabled()):
            campaign = executor.progress = _progress.Campaign(name)
        config = make_config(executor, run_dir=os.path.join(base, "runinfo"), monitoring=monitoring,
                             memoizer=memoizer, **(config_options or {}))
        # Parsl's run info, logs and certificates, and the processes the executor starts
        # (interchange, pilots, MPI worlds), are owner-only (see taskdir.private_umask).
        with private_umask():
            dfk = parsl.load(config)
        dfk.hetflow_checkpoint = checkpoint is not None
        dfk.hetflow_token = guardian.token
    except BaseException as exc:
        guardian.stop()
        if campaign is not None:
            campaign.close()
        if owned and not keep_run_dir:
            if any(within(str(p), base) for p in getattr(exc, "logs", ())):
                # The error points at logs in the run dir (a launcher's stderr, a pilot's
                # sandbox): they are what explains it, so the run dir stays.
                exc.add_note(f"hetflow kept the run dir {base} for these logs; remove it "
                             f"when done")
            else:
                shutil.rmtree(base, ignore_errors=True)
        raise
    interrupted = None
    try:
        yield dfk
    except KeyboardInterrupt as exc:
        interrupted = (exc, _running(dfk))
        raise
    finally:
        try:
            dfk.cleanup()
        finally:
            if interrupted is not None:
                _explain_interrupt(*interrupted)
            if campaign is not None:
                campaign.close()
            parsl.clear()
            try:
                # What the executors' shutdown ended may still be exiting: the close
                # returns once it has (see Guardian.settle).
                guardian.settle()
            finally:
                guardian.stop()
            if owned and not keep_run_dir:
                shutil.rmtree(base, ignore_errors=True)


def _running(dfk) -> list:
    """The hetflow tasks running now (their processes started), on every executor."""
    tasks = []
    for executor in dfk.executors.values():
        live = getattr(executor, "live_tasks", None)
        if live is not None:
            tasks += [t for t in live() if t.files is not None and not t.done]
    return tasks


def _explain_interrupt(interrupt: BaseException, tasks: list) -> None:
    """Ctrl-C in the block: the runtime's shutdown stopped the running ``tasks``, each with
    the Python stacks of its ranks still running; say so under the KeyboardInterrupt (the
    last thing printed), where a waiting ``result()`` would otherwise show only its own wait."""
    stopped = [t for t in tasks if t.error is not None]
    if not stopped:
        return
    text = (f"hetflow: interrupted while {len(stopped)} task(s) ran; the runtime shut down and "
            f"stopped them:")
    for task in stopped:
        text += f"\n\n{task.error}"
    interrupt.add_note(text)
