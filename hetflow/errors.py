"""One error hierarchy for every runtime.

Every error is picklable (it crosses process boundaries on its way back to the
caller's future) and says what was wrong, where, and what was expected.
"""
from __future__ import annotations

import concurrent.futures


class HetflowError(Exception):
    """Base class of every error hetflow raises."""


class ConfigError(HetflowError, ValueError):
    """A resource spec, option or executor setting is invalid (raised at call time)."""


class ResourcesUnavailable(ConfigError):
    """The task asks for more than the runtime can ever give (ranks, cores, GPUs)."""


class InputError(HetflowError, ValueError):
    """The task's input is wrong (missing column, mismatched schema, corrupt file).

    Retrying cannot help, so the retry handler never retries it.
    """


class NotSupported(HetflowError, NotImplementedError):
    """The runtime cannot do what was asked; the message names the feature."""


class LaunchError(HetflowError):
    """A launcher (mpiexec, a Parsl block, a pilot) failed before the task ran."""

    def __init__(self, message: str, *, command=None, logs=()):
        super().__init__(message)
        self.command = command
        self.logs = tuple(logs)

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))

    def __str__(self):
        text = self.args[0] if self.args else ""
        if self.command:
            text += f"\n  command: {' '.join(map(str, self.command))}"
        for path in self.logs:
            text += f"\n  log: {path}"
        return text


class TaskFailed(HetflowError):
    """A rank of the task raised; carries the rank, the host and the remote traceback.

    ``exception`` is the original exception when it could be unpickled here
    (it is also chained as ``__cause__``), ``exception_type`` always its name.
    """

    def __init__(self, message: str, *, rank=None, host=None, exception=None,
                 exception_type=None, remote_traceback=None, task_id=None):
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.exception = exception
        self.exception_type = exception_type or (type(exception).__name__ if exception else None)
        self.remote_traceback = remote_traceback
        self.task_id = task_id
        if exception is not None:
            self.__cause__ = exception

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))

    def __str__(self):
        text = self.args[0] if self.args else ""
        if self.remote_traceback:
            text += "\n\nRemote traceback (rank %s on %s):\n%s" % (
                self.rank, self.host, self.remote_traceback.rstrip())
        return text


class TaskLost(TaskFailed):
    """A rank died without reporting (killed by a signal or exited non-zero)."""

    def __init__(self, message: str, *, exitcode=None, signal=None, stderr_tail="", **kw):
        super().__init__(message, **kw)
        self.exitcode = exitcode
        self.signal = signal
        self.stderr_tail = stderr_tail

    def __str__(self):
        text = super().__str__()
        if self.stderr_tail:
            text += "\n\nLauncher stderr (tail):\n" + self.stderr_tail.rstrip()
        return text


class WalltimeExceeded(TaskFailed):
    """The task ran past its ``walltime`` and was stopped."""

    def __init__(self, message: str, *, walltime=None, **kw):
        super().__init__(message, **kw)
        self.walltime = walltime


class TaskCancelled(HetflowError, concurrent.futures.CancelledError):
    """The task was cancelled before it finished."""


class ExecutorBroken(HetflowError, concurrent.futures.BrokenExecutor):
    """The executor can no longer run tasks; every pending future fails with this."""


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    if state.get("exception") is not None:
        err.__cause__ = state["exception"]
    return err


class KeyColumnError(InputError, KeyError):
    """A key column named by an operation is not in the table (raised on every rank)."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return self.args[0] if self.args else ""


class SchemaMismatch(InputError):
    """Ranks' partitions, or the two sides of a join, disagree on column types."""


class BackendUnavailable(ResourcesUnavailable):
    """A compute backend (GPU via cupy, pycylon) was requested but cannot run here."""
