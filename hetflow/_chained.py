"""A task that did not run because a task it depends on failed: the root cause printed last.

Parsl fails such a task with ``DependencyError: Dependency failure for task 2. The
representative cause is via task 1``, the root cause chained above it, so a traceback ends
with the words that explain least. hetflow's retry handler (which Parsl calls with every
failure, this one included) makes it a :class:`DependencyFailed` instead: still a Parsl
``DependencyError`` (code that catches that keeps working, and Parsl still skips retries
and records the task as a dependency failure), and a :class:`hetflow.TaskFailed` carrying
the root failure's rank, host and original exception, whose message ends with the root
cause (its remote traceback, when a rank raised).
"""
from __future__ import annotations

from parsl.dataflow.errors import DependencyError

from hetflow.errors import TaskFailed


class DependencyFailed(DependencyError, TaskFailed):
    """The task did not run: a task it depends on failed. ``root`` is that failure; ``rank``,
    ``host``, ``exception`` and ``remote_traceback`` are the root's when a rank raised."""

    def __str__(self) -> str:
        return self.args[0] if self.args else DependencyError.__str__(self)


def explain(error: DependencyError, task_record) -> DependencyFailed:
    """Turn Parsl's ``error`` (about ``task_record``'s task) into a :class:`DependencyFailed`
    in place (the same object: Parsl goes on with it), its message ending with the root cause."""
    if isinstance(error, DependencyFailed):
        return error
    root = error.__cause__
    sequence = list(getattr(error, "_cause_sequence", ()))
    name = task_record.get("func_name") if hasattr(task_record, "get") else None
    what = f"task {error.task_id}" + (f" ({name})" if name else "")
    if sequence:
        chain = f"it depends on {sequence[0]}" + "".join(
            f", which depends on {s}" for s in sequence[1:]) + ", which failed"
    else:
        chain = "a task it depends on failed"
    text = f"{what} did not run: {chain}"
    if root is not None:
        text += f":\n\n{type(root).__name__}: {root}"
        for note in getattr(root, "__notes__", ()):
            text += f"\n{note}"
    error.__class__ = DependencyFailed
    error.args = (text,)
    error.root = root
    for attribute in ("rank", "host", "exception", "exception_type", "remote_traceback"):
        setattr(error, attribute, getattr(root, attribute, None))
    if error.exception is None and root is not None and not isinstance(root, TaskFailed):
        error.exception, error.exception_type = root, type(root).__name__
    # The root is in the message already: printing it again above this one would bury the
    # root cause in the middle of the traceback, where Parsl's error left it.
    error.__cause__ = None
    error.__suppress_context__ = True
    return error
