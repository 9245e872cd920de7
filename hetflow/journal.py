"""Crash-safe checkpointing of finished MPI tasks: ``hetflow.runtime(..., checkpoint=DIR)``.

A campaign killed half-way (client SIGKILLed, node lost) is restarted with the
same ``checkpoint`` directory and re-runs only the tasks that had not finished.

It plugs into Parsl's memoization (the DataFlowKernel hashes each task's app and
arguments, and skips a task whose hash has a stored result) but replaces Parsl's
single append-only ``tasks.pkl``, which a kill in mid-write leaves truncated so
that the next start refuses the whole file, by one file per finished task,
written to a temp name, flushed and renamed into place: a record is either
whole or absent.

The journal unpickles what it finds, so it refuses (:class:`~hetflow.ConfigError`)
a directory that another user owns or that its group or others can write to: a
record planted there would run code as the workflow's owner. A new directory is
created 0700, records 0600.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from concurrent.futures import Future
from typing import Dict, List, Optional

from parsl.dataflow.memoization import BasicMemoizer, CheckpointCommand, id_for_memo, make_hash

from hetflow.errors import ConfigError

logger = logging.getLogger(__name__)

_SUFFIX = ".result"


class Journal(BasicMemoizer):
    """A Parsl memoizer whose checkpoint is a directory of atomically written task results."""

    def __init__(self, directory: str):
        super().__init__(checkpoint_mode="task_exit", checkpoint_files=[])
        self.directory = os.path.abspath(directory)
        if os.path.isdir(self.directory):     # fail before any runtime starts
            check_private(self.directory)

    def start(self, *, run_dir: str, config_run_dir: str) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        check_private(self.directory)
        super().start(run_dir=run_dir, config_run_dir=config_run_dir)
        self.memo_lookup_table.update(self.load())

    def check_memo(self, task) -> Optional[Future]:
        """Parsl's lookup, but a task whose arguments Parsl cannot hash (NumPy arrays, Arrow
        tables, ...) is keyed by their pickled bytes instead of failing: a checkpointed
        runtime memoizes every MPI app, so it must accept every picklable argument."""
        if not self.memoize or not task["memoize"]:
            task["hashsum"] = None
            return None
        try:
            hashsum = make_hash(task)
        except ValueError:                    # "unknown type for memoization"
            hashsum = _pickled_hash(task)
        task["hashsum"] = hashsum
        if hashsum is None:
            return None
        return self.memo_lookup_table.get(hashsum)

    def load(self) -> Dict[str, Future]:
        """Hash -> resolved future, for every whole record in the journal."""
        table: Dict[str, Future] = {}
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(_SUFFIX):
                continue  # temp files of a write that was interrupted
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as fh:
                    value = pickle.load(fh)
            except Exception as exc:  # noqa: BLE001 - an unreadable record means: run it again
                logger.warning("checkpoint record %s unreadable (%s): the task will run again",
                               path, exc)
                continue
            future: Future = Future()
            future.set_result(value)
            table[name[:-len(_SUFFIX)]] = future
        logger.info("checkpoint %s: %d finished task(s) restored", self.directory, len(table))
        return table

    def _checkpoint_these_tasks(self, checkpoint_queue: List[CheckpointCommand]) -> None:
        for command in checkpoint_queue:
            hashsum = command.task_record.get("hashsum")
            if command.exception is not None or not hashsum:
                continue  # failures are not results: they run again on restart
            try:
                data = pickle.dumps(command.result)
            except Exception as exc:  # noqa: BLE001 - any pickling failure: run on, unjournaled
                logger.warning("task %s: result cannot be checkpointed (%s)",
                               command.task_record["id"], exc)
                continue
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, os.path.join(self.directory, hashsum + _SUFFIX))
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            self.checkpointed_tasks += 1

    def records(self) -> int:
        """How many finished tasks the journal holds."""
        return sum(1 for n in os.listdir(self.directory) if n.endswith(_SUFFIX))


def check_private(directory: str) -> None:
    """Raise ConfigError unless only this user can write to ``directory`` (it follows a
    symlink: the target is what counts)."""
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise ConfigError(f"checkpoint directory {directory!r} belongs to uid {st.st_uid}, not "
                          f"to this user ({os.getuid()}): its records are unpickled, so only "
                          "a directory of your own is accepted")
    if st.st_mode & 0o022:
        raise ConfigError(f"checkpoint directory {directory!r} can be written by its group or "
                          f"by others (mode {st.st_mode & 0o777:o}): its records are unpickled, "
                          f"so a record planted there would run code as you; "
                          f"run chmod go-w {directory!r} (or use a private directory)")


def _pickled_hash(task) -> Optional[str]:
    """A key from the pickled arguments (equal values give equal keys for NumPy/Arrow data;
    where pickling is not deterministic the cost is a re-run, never a wrong result)."""
    import cloudpickle

    kwargs = {k: v for k, v in task["kwargs"].items() if k not in task["ignore_for_cache"]}
    try:
        data = cloudpickle.dumps((task["args"], sorted(kwargs.items())))
    except Exception as exc:  # noqa: BLE001 - not hashable at all: run it, don't journal it
        logger.warning("task %s: arguments cannot be keyed for the checkpoint (%s)",
                       task["id"], exc)
        return None
    return "p" + hashlib.md5(id_for_memo(task["func"]) + data).hexdigest()
