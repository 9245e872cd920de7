"""The rank-side runner every executor shares (imports no Parsl: ranks start fast).

``python -m hetflow.executors._rank TASKDIR`` is what one launch-per-task
executor runs on each rank: read the payload from the task dir (its format:
:mod:`hetflow.executors.taskdir`), run this rank's share on ``COMM_WORLD`` (the
launch is the task's world), write this rank's outcome there.
A rank whose share raised calls ``Abort`` after reporting, so no peer hangs in a
collective it will never complete. Each rank runs under a supervisor (see
:mod:`hetflow.executors._supervise`) that records how it ended.
"""
from __future__ import annotations

import os
import pickle
import sys
import time

if __name__ == "__main__":
    # ``python -m`` runs this file as __main__: run the importable module instead, so reports
    # pickle as hetflow.executors._rank.*, and stop here rather than define everything twice.
    from hetflow.executors import _rank

    sys.exit(_rank.main())

from collections.abc import Callable

from hetflow.executors._ranksample import sampling
from hetflow.executors._supervise import KILLED_EXIT, supervise
from hetflow.executors.taskdir import TaskDir, user_umask

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


# TaskPayload and RankOutcome are plain classes, not dataclasses: ``dataclasses`` (with the
# ``inspect`` it imports) would cost a rank about as many instructions as mpi4py itself.

class TaskPayload:
    """Everything a rank needs to run its part of a task.

    It travels with ``resources`` as a dict, rebuilt into a :class:`~hetflow.spec.Resources`
    only when read: the runner takes the rank's resources from ``meta.json``, so a rank
    unpickling the payload never imports the spec module (a dataclass).
    """

    def __init__(self, task_id: int, func: Callable, args: tuple, kwargs: dict, resources,
                 tables: str | None = None, files: tuple | None = None,
                 arguments: bytes | None = None):
        self.task_id = task_id
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self._resources = resources
        #: Where a rank writes its partition of a returned DistributedTable (hetflow.tables).
        self.tables = tables
        #: ``(dir_on_client_node, dir_elsewhere, capture_output, client_pid, client_host,
        #: sample_s)``: where the ranks leave their output, stacks and resource samples
        #: (``_rankio``, ``_ranksample``: every ``sample_s`` seconds, None: off); None: no
        #: capture.
        self.files = files
        self._arguments = arguments      # (args, kwargs) as the client pickled them once

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
            import dataclasses

            resources = dataclasses.asdict(resources)
        if self._arguments is not None:
            return (_with_arguments, (self.task_id, self.func, self._arguments, resources,
                                      self.tables, self.files))
        return (TaskPayload, (self.task_id, self.func, self.args, self.kwargs, resources,
                              self.tables, self.files))

    def __repr__(self) -> str:
        return (f"TaskPayload(task_id={self.task_id!r}, func={self.func!r}, args={self.args!r}, "
                f"kwargs={self.kwargs!r}, resources={self.resources!r})")

    def dumps(self) -> bytes:
        """The payload pickled so that a rank loads its function without cloudpickle."""
        from hetflow.executors import _pickling

        return _pickling.dumps(self)


def _with_arguments(task_id: int, func: Callable, arguments: bytes, resources, tables,
                    files) -> TaskPayload:
    """A payload whose arguments the client pickled at the call (nested in the payload)."""
    args, kwargs = pickle.loads(arguments)
    return TaskPayload(task_id, func, args, kwargs, resources, tables, files)


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


def _error_outcome(rank: int, exc: BaseException, started: float, finished: float,
                   where: str = "") -> RankOutcome:
    import traceback

    try:
        exc_bytes = dumps(exc)
        pickle.loads(exc_bytes)
    except Exception:  # the exception itself cannot travel: keep its text
        exc_bytes = b""
    return RankOutcome(rank=rank, host=_host(), pid=os.getpid(), ok=False,
                       exception=exc_bytes, exception_type=type(exc).__qualname__,
                       message=(where + str(exc)), started=started, finished=finished,
                       traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _host() -> str:
    return os.uname().nodename      # what socket.gethostname() returns, without importing socket


def visible_devices(devices, local_rank: int, gpus_per_rank: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the ``local_rank``-th of a task's ranks on one node: its
    own block of ``gpus_per_rank`` ids out of ``devices`` (the ids given to the task's ranks
    on that node, in local-rank order); "" for a rank that gets none (a CPU task).

    The one binding every runtime uses (launch per task, RAPTOR ranks, the pool's slots),
    so ranks never share a device and hetflow.torch finds the same one everywhere.
    """
    first = local_rank * gpus_per_rank
    if gpus_per_rank <= 0 or first + gpus_per_rank > len(devices):
        return ""
    return ",".join(str(d) for d in devices[first:first + gpus_per_rank])


def bind_gpus(devices, local_rank: int, gpus_per_rank: int) -> None:
    """Set ``CUDA_VISIBLE_DEVICES`` (see :func:`visible_devices`); ``devices`` None (the
    runtime hands out no device ids: Slurm's own binding, or no GPUs declared) leaves it as
    the launcher set it."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, local_rank, gpus_per_rank)


def bind_rank_environment(resources: dict, local_rank: int) -> None:
    """Set threads and GPU binding for this rank before user code imports anything.

    ``resources`` is the task's :class:`~hetflow.spec.Resources` as a dict (``meta.json``),
    with ``devices``: the device ids the kernel gave the task (see
    :meth:`~hetflow.executors.kernel.Executor.rank_resources`).
    """
    os.environ["OMP_NUM_THREADS"] = str(resources["cores_per_rank"])
    # polars sizes its pool when first imported (the frame engine's kernels, or user code)
    os.environ["POLARS_MAX_THREADS"] = str(resources["cores_per_rank"])
    bind_gpus(resources.get("devices"), local_rank, resources["gpus_per_rank"])


def run_on_rank(payload_bytes: bytes, comm, *, sys_path: list[str] = (),
                keep_exception: bool = False) -> RankOutcome:
    """Run one rank's share of a task on ``comm`` (the task's communicator).

    The app gets ``comm.Dup()``, never ``comm`` itself, so library traffic and
    user traffic can't cross. ``sys_path`` (the client's) is prepended first, so
    functions defined in the client's modules unpickle. Never raises: errors
    become the outcome.
    """
    from hetflow._task import task_comm

    rank = comm.Get_rank()
    started = time.time()
    for entry in reversed(sys_path):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        payload: TaskPayload = pickle.loads(payload_bytes)
    except Exception as exc:  # e.g. the function's module is not importable on this rank
        return _error_outcome(rank, exc, started, time.time(), "could not unpickle the task: ")
    with _capture(payload.files, rank) as capture, sampling(capture, payload.files):
        arrive(comm)
        user_comm = comm.Dup()
        own_umask = user_umask()
        failed = True
        try:
            started = time.time()
            args, kwargs = payload.args, payload.kwargs
            tables = sys.modules.get("hetflow.tables")   # imported by unpickling a handed-over table
            with task_comm(user_comm):
                if tables is not None:
                    args, kwargs = tables.materialize(args, kwargs, user_comm)
                value = payload.func(*args, **kwargs)
            finished = time.time()
            if type(value).__name__ == "DistributedTable":
                from hetflow import tables

                if tables.is_table(value):   # its partition, kept or written: the client assembles
                    value = tables.hand_over(value, comm, payload.tables, payload.task_id)
            failed = False
        except BaseException as exc:  # SystemExit on a rank is a task failure too
            outcome = _error_outcome(rank, exc, started, time.time())
            if keep_exception:
                outcome.original = exc
            return outcome
        finally:
            os.umask(own_umask)
            release_comm(user_comm, failed)
    try:
        value_bytes = dumps(value)
    except Exception as exc:
        return _error_outcome(rank, exc, started, finished, "return value cannot be pickled: ")
    return RankOutcome(rank=rank, host=_host(), pid=os.getpid(), ok=True,
                       value=value_bytes, started=started, finished=finished)



class _NoCapture:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _capture(files, rank: int):
    """The rank's output and stack capture (see ``_rankio``); none in the client's own
    process (the debug runtime: its output is already on the client's console)."""
    if not files:
        return _NoCapture()
    here, elsewhere, output, client_pid, client_host = files[:5]
    if client_host == _host():
        if client_pid == os.getpid():
            return _NoCapture()
        directory = here
    else:
        from hetflow._private import private_dir

        directory = elsewhere
        try:
            private_dir(directory)
        except OSError:
            return _NoCapture()
    from hetflow.executors._rankio import Capture

    return Capture(directory, rank, output)


#: How a rank waits for its peers before a task starts (:func:`arrive`): this many polls,
#: then sleeps from the first to the longest.
_ARRIVE_POLLS = 200
_ARRIVE_FIRST_SLEEP, _ARRIVE_MAX_SLEEP = 1e-4, 5e-3


#: Communicators of failed tasks, never freed (see :func:`release_comm`).
_QUARANTINED: list = []


def release_comm(comm, failed: bool) -> None:
    """Free a task's communicator, unless its task failed on this rank: then keep it for
    the life of the process. A peer may have sent on it what this rank never received (a
    rank that raised while its peer entered a collective), and a freed communicator's
    context id is reused by the next one created: Open MPI 4.1.4 then matched the stale
    message in the next task's first collective, which never completed (measured: a
    2-rank task whose rank 1 raised while rank 0 waited in ``Barrier``, then a 3-rank
    task on the same ranks). A persistent rank (pool, RAPTOR) keeps one or two per failed
    task."""
    if failed:
        _QUARANTINED.append(comm)
        return
    try:
        comm.Free()
    except Exception:   # best effort: the task's result is what matters
        pass


def arrive(comm) -> None:
    """Wait until every rank of ``comm`` has reached this point, asleep after a short poll.

    MPICH's blocking calls busy-poll, so a rank that unpickles its task first (or gets it
    first) would spin in the first collective while its peers still import the task's
    modules, and on a node with more ranks than cores the spinners take the CPU those
    peers need. Seen in a RAPTOR worker of 4 ranks on 2 busy cores: three ranks used
    0.9-1.4 CPU-s in 10 s spinning (mostly in the kernel, yielding) while the fourth, with
    work to do, got 0.03 CPU-s.
    """
    if comm.Get_size() == 1:
        return
    arrived = comm.Ibarrier()
    for _ in range(_ARRIVE_POLLS):
        if arrived.Test():
            return
    delay = _ARRIVE_FIRST_SLEEP
    while not arrived.Test():
        time.sleep(delay)
        delay = min(delay * 2, _ARRIVE_MAX_SLEEP)


def local_rank() -> int:
    """This rank's index on its node, from the launcher's environment."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
                "SLURM_LOCALID", "PALS_LOCAL_RANKID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def collect(outcomes: dict, task_id, resources, executor: str, *,
            returncode: int | None = None, stderr_tail: str = "", deaths: dict | None = None,
            detail: str = ""):
    """The task's value from its ranks' outcomes, or the typed error that explains why not.

    A rank that raised beats a rank that vanished (ranks stopped because a peer
    failed are collateral); among vanished ranks, ``deaths`` (cause first, see
    ``TaskDir.deaths``) names the cause; ``detail`` ends a lost task's message.
    """
    from hetflow import errors

    failed = [o for o in outcomes.values() if not o.ok]
    if failed:
        first = min(failed, key=lambda o: (o.finished, o.rank))
        try:
            exception = first.original or (pickle.loads(first.exception) if first.exception
                                            else None)
        except Exception:  # its class may not exist here: keep the text
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


#: Named shared-memory segments MPICH creates at ``MPI_Init`` for a node's ranks and removes
#: only at ``MPI_Finalize``: the segment of a world whose rank was killed (a walltime, a
#: cancel, a crash) stayed in /dev/shm for good, RAM until the node reboots (about 180
#: segments, 430 MB, per run of the test suite). Open MPI's segments are left alone: its
#: peers attach to them by name after initialisation.
_MPI_SHM_PREFIX = "/dev/shm/mpich_shm_"


def forget_mpi_shm_names(world, taskdir: TaskDir) -> None:
    """Unlink the names of the MPICH segments this rank mapped at ``MPI_Init``, once every
    rank of ``world`` has (a barrier): the mappings stay valid, nobody opens them by name
    again, and nothing is left in /dev/shm however the world ends. Segments that cannot go
    yet (Open MPI's) are noted in ``taskdir`` for the client to remove once the world has
    ended (``launch.forget_recorded_shm``)."""
    if world.Get_size() > 1:
        world.Barrier()              # every rank, mapped segments or not (no rank waits alone)
    mapped = mapped_mpi_shm("self", KILLED_WORLD_SHM)
    unlink_mpi_shm(p for p in mapped if p.startswith(_MPI_SHM_PREFIX))
    left = {p for p in mapped if not p.startswith(_MPI_SHM_PREFIX)}
    if left:
        taskdir.record_shm(world.Get_rank(), os.uname().nodename, left)


def unlink_mapped_mpi_shm() -> int:
    """Unlink the names of the MPICH segments this rank has mapped (see
    :func:`forget_mpi_shm_names`; without its barrier, for a world known to be past its
    start on every rank). Returns how many."""
    return unlink_mpi_shm(mapped_mpi_shm("self"))


#: Named shared memory of an MPI world that outlives its ranks when they are killed: MPICH's
#: segments, and Open MPI's (whose peers attach to them by name after start-up, so they
#: can be removed only once the whole world is dead: see launch.kill_tree).
KILLED_WORLD_SHM = (_MPI_SHM_PREFIX, "/dev/shm/vader_segment.")
#: What a killed process tree leaves besides: those, and the named semaphores of Python's
#: multiprocessing started by spawn (a Parsl worker pool's queues and counters), whose names
#: only its finalizers or its resource tracker (killed with the tree) would have removed.
#: Only those a process opened by name are seen (in its maps): the creator maps a
#: temporary name that glibc already unlinked.
KILLED_TREE_SHM = KILLED_WORLD_SHM + ("/dev/shm/sem.mp-",)


def mapped_mpi_shm(pid, prefixes=(_MPI_SHM_PREFIX,)) -> set:
    """Paths under ``prefixes`` (default: MPICH's segments) that process ``pid`` ("self":
    this one) maps and whose names are still linked (an exited or foreign process: none)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return {path for path in (line.split(None, 5)[5].strip() for line in fh
                                      if "/dev/shm/" in line)
                    if path.startswith(prefixes) and not path.endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


def unlink_mpi_shm(paths) -> int:
    """Unlink these segment names; returns how many were still there."""
    gone = 0
    for path in paths:
        try:
            os.unlink(path)
            gone += 1
        except OSError:              # a peer of this node unlinked it first
            pass
    return gone


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    taskdir = TaskDir(argv[0])
    if taskdir.stop_requested():
        # Stopped (walltime, cancel) before this rank started: a launch the runtime could not
        # stop yet (RP's agent was still starting it) must not run the task after its verdict.
        return KILLED_EXIT
    supervise(taskdir)                     # from here on: the rank (the supervisor's child)
    meta = taskdir.read_meta()
    bind_rank_environment(meta["resources"], local_rank())
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    taskdir.record_deaths(world.Get_rank())
    expected = meta["resources"]["ranks"]
    if world.Get_size() != expected:
        # A launcher that starts R processes without wiring them into one world (``srun``
        # without ``--mpi=pmi2`` where the site's MpiDefault is none) exits 0 silently.
        from hetflow.errors import LaunchError

        now = time.time()
        outcome = _error_outcome(world.Get_rank(), LaunchError(
            f"the launcher started this rank in a world of {world.Get_size()} rank(s), not "
            f"{expected}: its processes were not wired into one MPI world (srun needs "
            f"--mpi=pmi2 with the mpich wheel)"), now, now)
    else:
        forget_mpi_shm_names(world, taskdir)
        outcome = run_on_rank(taskdir.read_payload(), world, sys_path=meta["sys_path"])
    taskdir.write_outcome(outcome)
    if not outcome.ok and world.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        world.Abort(1)
    return 0

