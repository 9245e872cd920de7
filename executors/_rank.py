"""The rank-side runner every executor shares (imports no Parsl: ranks start fast).

What travels between client and ranks (the payload, the outcomes, how the client reads
them) is :mod:`hetflow.executors.payload`; MPI's named shared memory,
:mod:`hetflow.executors._mpishm`.

``python -m hetflow.executors._rank TASKDIR`` is what one launch-per-task
executor runs on each rank: read the payload from the task dir (its format:
:mod:`hetflow.executors.taskdir`), run this rank's share on ``COMM_WORLD`` (the
launch is the task's world), write this rank's outcome there.
A rank whose share raised calls ``Abort`` after reporting, so no peer hangs in a
collective it will never complete. Each rank runs under a supervisor (see
:mod:`hetflow.executors._supervise`) that records how it ended.
"""
from __future__ import annotations

import functools
import os
import pickle
import sys
import time

if __name__ == "__main__":
    # ``python -m`` runs this file as __main__: run the importable module instead, so reports
    # pickle as hetflow.executors._rank.*, and stop here rather than define everything twice.
    from hetflow.executors import _rank

    sys.exit(_rank.main())

from hetflow.executors._mpishm import forget_mpi_shm_names
from hetflow.executors._ranksample import sampling
from hetflow.executors._supervise import KILLED_EXIT, supervise
from hetflow.executors.payload import RankOutcome, TaskPayload, dumps, error_outcome, host
from hetflow.executors.taskdir import TaskDir, user_umask


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


def bind_threads(cores_per_rank: int) -> None:
    """The threads a rank that outlives its tasks (a pool or RAPTOR worker) runs: BLAS and
    OpenMP read ``OMP_NUM_THREADS``; polars sizes its pool once, when first imported, so the
    worker keeps its first task's size. (RAPTOR's ranks did without it, and ran polars on
    every core: a 2-rank sort on a 2-core node had 4 busy threads.)"""
    os.environ["OMP_NUM_THREADS"] = str(cores_per_rank)
    os.environ.setdefault("POLARS_MAX_THREADS", str(cores_per_rank))


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
                keep_exception: bool = False, user_comm=None) -> RankOutcome:
    """Run one rank's share of a task on ``comm`` (the task's communicator).

    The app gets ``comm.Dup()``, never ``comm`` itself, so library traffic and
    user traffic can't cross; or ``user_comm``, a duplicate the caller keeps (and frees,
    or not, itself). ``sys_path`` (the client's) is prepended first, so
    functions defined in the client's modules unpickle. Never raises: errors
    become the outcome.
    """
    rank = comm.Get_rank()
    started = time.time()
    for entry in reversed(sys_path):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        payload: TaskPayload = pickle.loads(payload_bytes)
    except Exception as exc:  # e.g. the function's module is not importable on this rank
        return error_outcome(rank, exc, started, time.time(), "could not unpickle the task: ")
    with _capture(payload.files, rank) as capture, \
            sampling(capture, payload.files, rank) as sampler:
        owned = user_comm is None
        if owned:      # the peers awaited and the task's own duplicate made: one collective
            user_comm = arrive(comm)
        else:          # the caller's kept duplicate: only the peers awaited
            arrive(comm, duplicate=False)
        own_umask = user_umask()
        failed = True
        try:
            started = time.time()
            value = call_app(payload, user_comm)
            finished = time.time()
            if type(value).__name__ == "DistributedTable":
                from hetflow import tables

                if tables.is_table(value):   # its partition, kept or written: the client assembles
                    value = tables.hand_over(value, comm, payload.tables, payload.task_id)
            failed = False
        except BaseException as exc:  # SystemExit on a rank is a task failure too
            outcome = error_outcome(rank, exc, started, time.time())
            if keep_exception:
                outcome.original = exc
            sampler.outcome = outcome        # its last samples go with it
            return outcome
        finally:
            os.umask(own_umask)
            if owned:
                release_comm(user_comm, failed)
    try:
        value_bytes = dumps(value)
    except Exception as exc:
        outcome = error_outcome(rank, exc, started, finished, "return value cannot be pickled: ")
    else:
        outcome = RankOutcome(rank=rank, host=host(), pid=os.getpid(), ok=True,
                              value=value_bytes, started=started, finished=finished)
    outcome.samples = sampler.compact
    return outcome


def call_app(payload: TaskPayload, user_comm):
    """Call the task's function on this rank: the one place user code runs, with the task's
    communicator current (``hetflow.task_comm``) and handed-over tables materialised."""
    from hetflow._task import task_comm

    args, kwargs = payload.args, payload.kwargs
    tables = sys.modules.get("hetflow.tables")   # imported by unpickling a handed-over table
    with task_comm(user_comm):
        if tables is not None:
            args, kwargs = tables.materialize(args, kwargs, user_comm)
        return payload.func(*args, **kwargs)


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
    if files.client_host == host():
        if files.client_pid == os.getpid():
            return _NoCapture()
        directory = files.here
    else:
        from hetflow._private import private_dir

        directory = files.elsewhere
        try:
            private_dir(directory)
        except OSError:
            return _NoCapture()
    from hetflow.executors._rankio import Capture

    return Capture(directory, rank, files.output)


#: How a rank waits for its peers before a task starts (:func:`arrive`): this many polls,
#: then sleeps from the first to the longest. The longest is what a rank may oversleep its
#: last peer's arrival by, per task: 5 ms cost a 2-rank no-op task on a loaded 2-core
#: machine about a third of its ranks' time (py-spy); 1 ms wakes a waiting rank 1,000
#: times a second, well under 1% of a core.
_ARRIVE_POLLS = 200
_ARRIVE_FIRST_SLEEP, _ARRIVE_MAX_SLEEP = 5e-5, 1e-3


#: Communicators of failed tasks, never freed (see :func:`release_comm`).
_QUARANTINED: list = []


def kept_comms() -> int:
    """How many communicators of failed tasks this process keeps (see :func:`release_comm`)."""
    return len(_QUARANTINED)


def release_comm(comm, failed: bool) -> None:
    """Free a task's communicator, unless its task failed on this rank: then keep it for
    the life of the process. A peer may have sent on it what this rank never received (a
    rank that raised while its peer entered a collective), and a freed communicator's
    context id is reused by the next one created: Open MPI 4.1.4 then matched the stale
    message in the next task's first collective, which never completed (measured: a
    2-rank task whose rank 1 raised while rank 0 waited in ``Barrier``, then a 3-rank
    task on the same ranks). A persistent rank (pool, RAPTOR) keeps one or two per failed
    task, and each holds one of the MPI's context ids (MPICH has about 2,048): the pool
    replaces a world whose ranks keep ``max_kept_comms``. A communicator of one rank is
    freed all the same: no peer can have sent on it."""
    if failed and comm.Get_size() > 1:
        _QUARANTINED.append(comm)
        return
    try:
        comm.Free()
    except Exception:   # best effort: the task's result is what matters
        pass


def arrive(comm, duplicate: bool = True):
    """Wait until every rank of ``comm`` has reached this point, asleep after a short poll;
    return ``comm``'s duplicate, the task's own communicator (``Idup``: the one collective
    both waits for the peers and makes it, where ``Ibarrier`` then ``Dup`` cost two, the
    second a busy-polling one); ``duplicate`` False: only wait (``Ibarrier``), return None
    (a pool rank that keeps a duplicate per cached communicator).

    MPICH's blocking calls busy-poll, so a rank that unpickles its task first (or gets it
    first) would spin in the first collective while its peers still import the task's
    modules, and on a node with more ranks than cores the spinners take the CPU those
    peers need. Seen in a RAPTOR worker of 4 ranks on 2 busy cores: three ranks used
    0.9-1.4 CPU-s in 10 s spinning (mostly in the kernel, yielding) while the fourth, with
    work to do, got 0.03 CPU-s.
    """
    if comm.Get_size() == 1:               # local: no peer to wait for
        return comm.Dup() if duplicate else None
    if not duplicate:
        wait(comm.Ibarrier())
        return None
    copy, arrived = comm.Idup()
    wait(arrived)
    return copy


def wait(request) -> None:
    """Complete ``request`` (or a list of them) polling, then asleep (see :data:`_ARRIVE_POLLS`)."""
    if isinstance(request, list):
        from mpi4py import MPI

        done = functools.partial(MPI.Request.Testall, request)
    else:
        done = request.Test
    for _ in range(_ARRIVE_POLLS):
        if done():
            return
    delay = _ARRIVE_FIRST_SLEEP
    while not done():
        time.sleep(delay)
        delay = min(delay * 2, _ARRIVE_MAX_SLEEP)


def duplicate(comm):
    """``comm.Dup()``, waited for asleep (:func:`wait`): MPICH's blocking ``Dup`` busy-polls
    while a peer is not there yet."""
    copy, request = comm.Idup()
    wait(request)
    return copy


def meet(comm, ranks) -> None:
    """Return once every rank of ``ranks`` (ranks of ``comm``, this one among them) has
    called ``meet(comm, ranks)``, asleep meanwhile (:func:`wait`): each sends every other an
    empty message and waits for theirs. ``comm`` is one the ranks keep for it alone, so no
    other message matches; calls over the same ranks come in the same order on each."""
    me = comm.Get_rank()
    token, requests = bytearray(1), []
    for peer in ranks:
        if peer != me:
            requests.append(comm.Irecv(bytearray(1), source=peer, tag=0))
            requests.append(comm.Isend(token, dest=peer, tag=0))
    if requests:
        wait(requests)


def group_comm(world, meeting, ranks):
    """A communicator over ``ranks`` of ``world`` (``Create_group``: collective over those
    ranks only), made once they are all there (:func:`meet` on ``meeting``, a duplicate of
    ``world`` kept for it). MPI's ``Create_group`` busy-polls while a peer is not there yet:
    on a 2-core node running 32 pool ranks, a rank's peer gets the CPU a few ms later, and
    py-spy had a rank's time 7-13% in ``Create_group`` and the ``Dup`` after it, yielding."""
    meet(meeting, ranks)
    group = world.group.Incl(list(ranks))
    try:
        return world.Create_group(group)
    finally:
        group.Free()


def local_rank() -> int:
    """This rank's index on its node, from the launcher's environment."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
                "SLURM_LOCALID", "PALS_LOCAL_RANKID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


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
        outcome = error_outcome(world.Get_rank(), LaunchError(
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

