"""What a task is on the wire between the client and its ranks: the payload a rank runs,
the outcome it reports, and how the client turns the outcomes into the task's value or error.

Shared by every runtime; imported by the ranks too, so it imports nothing a no-op task does
not need (see ``tests/test_rank_imports.py``). The rank-side runner is
:mod:`hetflow.executors._rank`.
"""
from __future__ import annotations

import os
import pickle
import sys
from collections import namedtuple
from collections.abc import Callable

#: Values whose cloudpickle form is plain pickle's (so a rank need not import cloudpickle).
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``; a plain builtin value skips importing cloudpickle.

    The payload and the outcome files are read with plain ``pickle.loads`` (which is
    ``cloudpickle.loads``): a stream that needs cloudpickle (a function from ``__main__``,
    a lambda) imports it by itself, so a no-op task's ranks never do.
    """
    if type(obj) in _PLAIN:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    import cloudpickle

    return cloudpickle.dumps(obj)


#: Where a task's ranks leave their output, stacks and resource samples (``_rankio``,
#: ``_ranksample``): ``here``, the files dir for ranks on the client's node (in memory where
#: it can), ``elsewhere``, the one for ranks on other nodes (in the run dir, shared);
#: ``output``, whether the ranks' output is captured; ``client_pid``, ``client_host``, the
#: client's process and node; ``sample_s``, the seconds between two resource samples (None:
#: sampling off).
RankFiles = namedtuple("RankFiles", "here elsewhere output client_pid client_host sample_s")


# TaskPayload and RankOutcome are plain classes, not dataclasses: ``dataclasses`` (with the
# ``inspect`` it imports) would cost a rank about as many instructions as mpi4py itself.

class TaskPayload:
    """Everything a rank needs to run its part of a task.

    It travels with ``resources`` as a dict, rebuilt into a :class:`~hetflow.spec.Resources`
    only when read: the runner takes the rank's resources from ``meta.json``, so a rank
    unpickling the payload never imports the spec module (a dataclass).
    """

    def __init__(self, task_id: int, func: Callable, args: tuple, kwargs: dict, resources,
                 tables: str | None = None, files: RankFiles | None = None,
                 arguments: bytes | None = None):
        self.task_id = task_id
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self._resources = resources
        #: Where a rank writes its partition of a returned DistributedTable (hetflow.tables).
        self.tables = tables
        #: Where the ranks leave their output, stacks and resource samples
        #: (:data:`RankFiles`); None: no capture. It travels as a plain tuple (the class
        #: pickled with it cost the client 14 Python calls a task in cloudpickle), made a
        #: RankFiles again without a Python call (``tuple.__new__``).
        if files is not None and type(files) is not RankFiles:
            files = tuple.__new__(RankFiles, files)
        self.files = files
        self._arguments = arguments      # (args, kwargs) as the client pickled them once
        self._function: bytes | None = None   # func pickled alone (dumps), while pickling

    @property
    def resources(self):
        """The task's :class:`~hetflow.spec.Resources`."""
        if isinstance(self._resources, dict):
            from hetflow.spec import Resources

            self._resources = Resources(**self._resources)
        return self._resources

    def __reduce__(self):
        resources = self._resources
        if not isinstance(resources, dict):
            resources = resources.as_dict()
        files = None if self.files is None else tuple(self.files)
        if self._function is not None:
            return (_with_function, (self.task_id, self._function, self._arguments, resources,
                                     self.tables, files))
        if self._arguments is not None:
            return (_with_arguments, (self.task_id, self.func, self._arguments, resources,
                                      self.tables, files))
        return (TaskPayload, (self.task_id, self.func, self.args, self.kwargs, resources,
                              self.tables, files))

    def __repr__(self) -> str:
        return (f"TaskPayload(task_id={self.task_id!r}, func={self.func!r}, args={self.args!r}, "
                f"kwargs={self.kwargs!r}, resources={self.resources!r})")

    def dumps(self) -> bytes:
        """The payload pickled so that a rank loads its function without cloudpickle."""
        import hetflow.executors._pickling as _pickling   # (no importlib call, unlike from-import)

        if self._arguments is not None:
            self._function = _pickling.alone(self.func)
            if self._function is not None:      # then all else is plain data: pickle's own
                try:
                    return pickle.dumps(self, protocol=5)
                finally:
                    self._function = None
        return _pickling.dumps(self)


def _with_arguments(task_id: int, func: Callable, arguments: bytes, resources, tables,
                    files) -> TaskPayload:
    """A payload whose arguments the client pickled at the call (nested in the payload)."""
    args, kwargs = pickle.loads(arguments)
    return TaskPayload(task_id, func, args, kwargs, resources, tables, files)


def _with_function(task_id: int, function: bytes, arguments: bytes, resources, tables,
                   files) -> TaskPayload:
    """A payload whose function was pickled alone (``_pickling.alone``), arguments too."""
    return _with_arguments(task_id, pickle.loads(function), arguments, resources, tables, files)


class RankOutcome:
    """One rank's report: its value (pickled) or its error, and when it ran."""

    #: The fields, in order (also what ``repr`` and ``==`` use).
    FIELDS = ("rank", "host", "pid", "ok", "value", "exception", "exception_type", "message",
              "traceback", "started", "finished")
    __hash__ = None   # mutable and compared by value

    def __init__(self, rank: int, host: str, pid: int, ok: bool, value: bytes = b"",
                 exception: bytes = b"", exception_type: str = "", message: str = "",
                 traceback: str = "", started: float = float("nan"),
                 finished: float = float("nan"), original: BaseException | None = None):
        self.rank, self.host, self.pid, self.ok = rank, host, pid, ok
        self.value, self.exception, self.exception_type = value, exception, exception_type
        self.message, self.traceback = message, traceback
        self.started, self.finished = started, finished
        #: The exception itself, traceback and all, where the rank ran in the client's own
        #: process (the debug runtime); never pickled.
        self.original = original
        #: The rank's resource samples when the task ended before any was written to its
        #: files dir (``_ranksample.Sampler``); None otherwise.
        self.samples = None

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __repr__(self) -> str:
        return "RankOutcome(" + ", ".join(f"{name}={getattr(self, name)!r}"
                                          for name in self.FIELDS) + ")"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["original"] = None
        return state

    def load_value(self):
        return pickle.loads(self.value)


def error_outcome(rank: int, exc: BaseException, started: float, finished: float,
                   where: str = "") -> RankOutcome:
    import traceback

    try:
        exc_bytes = dumps(exc)
        pickle.loads(exc_bytes)
    except Exception:  # noqa: BLE001 - the exception itself cannot travel: keep its text
        exc_bytes = b""
    return RankOutcome(rank=rank, host=host(), pid=os.getpid(), ok=False,
                       exception=exc_bytes, exception_type=type(exc).__qualname__,
                       message=(where + str(exc)), started=started, finished=finished,
                       traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


_HOST: list = []


def host() -> str:
    """This node's name (what socket.gethostname() returns, without importing socket), read
    once per process: a pool rank asked twice per task (a ``uname`` syscall each)."""
    if not _HOST:
        _HOST.append(os.uname().nodename)
    return _HOST[0]


def collect(outcomes: dict, task_id, resources, executor: str, *,
            returncode: int | None = None, stderr_tail: str = "", deaths: dict | None = None,
            detail: str = ""):
    """The task's value from its ranks' outcomes, or the typed error that explains why not.

    A rank that raised beats a rank that vanished (ranks stopped because a peer
    failed are collateral); among vanished ranks, ``deaths`` (cause first, see
    ``TaskDir.deaths``) names the cause; ``detail`` ends a lost task's message.
    """
    import hetflow.errors as errors         # (no importlib call per task, unlike from-import)

    failed = [o for o in outcomes.values() if not o.ok]
    if failed:
        first = min(failed, key=lambda o: (o.finished, o.rank))
        try:
            exception = first.original or (pickle.loads(first.exception) if first.exception
                                            else None)
        except Exception:  # noqa: BLE001 - its class may not exist here: keep the text
            exception = None
        raise errors.rank_raised(task_id, executor, resources.ranks, first, exception)
    missing = [r for r in range(resources.ranks) if r not in outcomes]
    if missing:
        raise errors.rank_lost(task_id, executor, resources.ranks, missing, deaths, returncode,
                               stderr_tail, detail)
    origin = f"task {task_id} ({executor})"
    if resources.returns == "all":
        values = [outcomes[r].load_value() for r in range(resources.ranks)]
        tables = sys.modules.get("hetflow.tables")     # imported by unpickling a Partition
        if tables is not None and any(isinstance(v, tables.Partition) for v in values):
            return [tables.assemble(values, origin)] * len(values)
        return values
    value = outcomes[0].load_value()
    tables = sys.modules.get("hetflow.tables")
    if tables is not None and isinstance(value, tables.Partition):
        # The whole table, never rank 0's part alone: every rank's partition.
        return tables.assemble([value] + [outcomes[r].load_value()
                                          for r in range(1, resources.ranks)], origin)
    return value
