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


class TableHandoffError(InputError):
    """A ``frame.DistributedTable`` a task returned cannot be handed over (or read back)."""


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
        if getattr(self, "output_tail", ""):
            text += "\n\nThe task's rank output (tail):\n" + self.output_tail.rstrip()
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


class NullValues(InputError):
    """A column handed to a consumer that cannot take nulls (a tensor) has some; the message
    names it (raised on every rank)."""


class BackendUnavailable(ResourcesUnavailable):
    """A compute backend (GPU via cupy, pycylon) was requested but cannot run here."""


class PartitionFailed(HetflowError):
    """A collective frame operation failed on some ranks in their own part of the work after
    its data moved (a local join, an aggregation's finishing step); raised on every rank of the
    task, so none is left waiting in the next collective.

    ``operation`` names the step, ``ranks`` the ranks that failed, ``errors`` each one's
    ``"Type: message"`` and ``remote_tracebacks`` each one's traceback text; on a failing rank
    the original exception is also chained as ``__cause__``.
    """

    def __init__(self, message: str, *, operation: str = "", ranks=(), errors=None,
                 remote_tracebacks=None):
        super().__init__(message)
        self.operation = operation
        self.ranks = tuple(ranks)
        self.errors = dict(errors or {})
        self.remote_tracebacks = dict(remote_tracebacks or {})

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


# --------------------------------------------------------------------------- built in one place
# Every runtime reports the same failure with the same type and wording: these build them.

def walltime_exceeded(task_id, executor: str, walltime, detail: str = "") -> WalltimeExceeded:
    """The task ran past its walltime; ``detail`` says what the runtime did about its ranks."""
    return WalltimeExceeded(f"task {task_id} ({executor}) exceeded its walltime of {walltime} s "
                            f"and was stopped{detail}", walltime=walltime, task_id=task_id)


def with_stacks(error: BaseException, state: str, stacks: dict) -> BaseException:
    """``error`` (a task stopped while running) with ``state`` (which ranks had returned,
    which still ran) and ``stacks`` (``{rank: Python stack}``, taken as it was stopped) in its
    message; ``error.stacks`` keeps them."""
    text = error.args[0] if error.args else str(error)
    if state:
        text += f"; {state}"
    for rank, stack in sorted(stacks.items()):
        text += f"\n\nPython stack of rank {rank} when the task was stopped:\n{stack.rstrip()}"
    error.args = (text,) + tuple(error.args[1:])
    error.stacks = dict(stacks)
    return error


def cancelled(task_id, executor: str, running: bool) -> TaskCancelled:
    """The task was cancelled, while it waited or while it ran."""
    return TaskCancelled(f"task {task_id} ({executor}) was cancelled "
                         f"{'while running' if running else 'before it started'}")


def shut_down(task_id, executor: str) -> ExecutorBroken:
    """The executor shut down before the task finished."""
    return ExecutorBroken(f"executor {executor!r} shut down before task {task_id} finished")


#: What torch says to DDP code run with no process group (none made; ``init_process_group``
#: reading RANK/MASTER_ADDR, which no task's environment sets), and the way out.
_NO_PROCESS_GROUP = ("Default process group has not been initialized", "using env:// rendezvous")
PROCESS_GROUP_HINT = ("hint: a task's ranks have no torch.distributed process group, and no "
                      "RANK or MASTER_ADDR to make one from: wrap the training in "
                      "`with hetflow.torch.process_group():`, which builds it on the task's "
                      "ranks (docs/torch.md)")


def rank_raised(task_id, executor: str, ranks: int, outcome, exception) -> TaskFailed:
    """A rank's function raised: ``outcome`` is its report, ``exception`` the original (or None)."""
    error = TaskFailed(
        f"task {task_id} ({executor}): rank {outcome.rank} of {ranks} raised "
        f"{outcome.exception_type}: {outcome.message}",
        rank=outcome.rank, host=outcome.host, exception=exception,
        exception_type=outcome.exception_type, remote_traceback=outcome.traceback,
        task_id=task_id)
    if any(text in str(outcome.message) for text in _NO_PROCESS_GROUP):
        error.add_note(PROCESS_GROUP_HINT)
    return error


def rank_lost(task_id, executor: str, ranks: int, missing, deaths, returncode=None,
              stderr_tail: str = "", detail: str = "") -> TaskLost:
    """Ranks ``missing`` never reported; ``deaths`` (cause first) says how, where known;
    ``detail`` says what the runtime did about it."""
    import re

    signal = -returncode if returncode is not None and returncode < 0 else None
    how = (f"killed by signal {signal}" if signal else
           f"launcher exit code {returncode}" if returncode is not None else "no report")
    deaths = {r: d for r, d in (deaths or {}).items() if r in missing}
    if deaths:
        rank = next(iter(deaths))
        what, text = deaths[rank]
        named = re.search(r"signal (\d+)", what)
        if named and signal is None:
            signal = int(named.group(1))
        others = [r for r in missing if r != rank]
        message = (f"task {task_id} ({executor}): rank {rank} of {ranks} {what} "
                   f"without reporting ({how})")
        if others:
            message += f"; rank(s) {others} were stopped with it"
    else:
        rank, text = missing[0], ""
        message = (f"task {task_id} ({executor}): rank(s) {list(missing)} of {ranks} "
                   f"died without reporting ({how})")
    return TaskLost(message + detail, rank=rank, exitcode=returncode, signal=signal,
                    stderr_tail=stderr_tail, task_id=task_id, remote_traceback=text or None)


def worker_lost(task_id, executor: str, cause: BaseException) -> TaskLost:
    """The worker (or pilot process) running the task was lost; ``cause`` is what said so."""
    error = TaskLost(f"task {task_id} ({executor}): the worker running it was lost "
                     f"({type(cause).__name__}: {cause})", task_id=task_id)
    error.__cause__ = cause
    return error


def resident_lost(task_id, executor: str, slots, lost) -> TaskLost:
    """A task's resident data lived on ranks (``slots``) of which ``lost`` are gone."""
    return TaskLost(f"task {task_id} ({executor}): its resident data lived on pool slot(s) "
                    f"{list(lost)}, which were lost (rank died or the pool restarted); re-create it",
                    rank=list(slots).index(lost[0]), task_id=task_id)
