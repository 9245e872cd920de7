"""Parsl's HighThroughputExecutor in MPI mode, running hetflow MPI apps.

:class:`ParslMPIExecutor` *is* a Parsl ``MPIExecutor`` (HTEX with
``enable_mpi_mode``) on a ``LocalProvider`` with a ``SimpleLauncher``, built on
the executor kernel (:mod:`hetflow.executors.kernel`), so it works in
``hetflow.runtime("parsl")`` and in a user's own ``parsl.Config``.

How a task runs: the kernel queues it until its rank slots are free, then
:meth:`~ParslMPIExecutor._start` hands it to HTEX with the app's
:class:`~hetflow.spec.Resources` as Parsl's ``parsl_resource_specification``;
Parsl's MPI task scheduler (in the worker pool's manager) gives the task that
many node-list entries and sets ``$PARSL_MPI_PREFIX``; the HTEX worker runs
:func:`~hetflow.executors._parsl_worker.run_mpi_task`, which launches the shared
rank-side runner under that prefix and kills the whole tree when the client's
cancel marker appears (walltime, cancel, shutdown: the kernel decides them all).
The client turns the ranks' reports into the value or typed error, as ``mpirun`` does.

Local node list: MPI mode only knows Slurm or PBS node lists and runs one MPI
task per listed "node" at a time. On a bare machine the executor writes a
``PBS_NODEFILE`` listing ``localhost`` once per rank slot (``max_ranks`` lines),
so each line is one core slot and tasks of different sizes run side by side.
Inside a Slurm allocation the lines name the allocation's nodes, once per CPU,
node-packed in Slurm's order (``max_ranks`` defaults to its CPUs), and the worker
pool is told to read that file rather than ``$SLURM_NODELIST``.

Started by the batch system (``slurm={"nodes": 2, ...}``): the block is a Slurm
job submitted by Parsl's ``SlurmProvider`` (``sbatch``; its queue wait is the
first task's wait), the worker pool runs in the job's first node and writes the
node file from the job's own environment before it starts (the client cannot know
the nodes in advance); launches are then Hydra's (``mpiexec -hosts <the job's
nodes>``, proxies started with ``srun``), never a bare ``srun`` without ``--mpi``.
HTEX's scale-in at shutdown cancels the job.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
from concurrent.futures import Future
from typing import Dict, Optional

from parsl.executors.high_throughput.executor import DEFAULT_LAUNCH_CMD
from parsl.executors.high_throughput.mpi_executor import MPIExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider, SlurmProvider

from hetflow._guardian import start_ticks
from hetflow import errors
from hetflow.errors import ConfigError, LaunchError
from hetflow.executors._parsl_worker import POLL_S, RANK_TMPDIR, run_mpi_task
from hetflow.executors.kernel import Executor, Task
from hetflow.executors import allocation as batch
from hetflow.executors.providers import Placement, Provider, runtime_place
from hetflow.executors._forensics import kill_tree
from hetflow.executors.taskdir import TaskDir, private_umask
from hetflow.spec import Resources


def parsl_resource_spec(resources: Resources) -> dict:
    """Parsl's ``parsl_resource_specification`` for one hetflow task.

    Every node-list entry is one core slot, so the task takes ``ranks x
    cores_per_rank`` entries (``num_nodes``) and runs ``ranks`` processes
    (``num_ranks``) one per entry (``ranks_per_node=1``). All three keys are given:
    Parsl hangs on a spec with ``num_ranks`` alone and writes ``-ppn 2.0`` when
    ``ranks_per_node`` is derived.
    """
    return {"num_nodes": resources.cores, "ranks_per_node": 1, "num_ranks": resources.ranks}


#: Longest dir whose 'pymp-XXXXXXXX/listener-XXXXXXXX' still fits a Unix socket path (107).
_MAX_SOCKET_DIR = 70


def _short_private_dir(preferred_parent: str) -> str:
    """A fresh dir for the worker pool's TMPDIR, short enough for the Unix socket
    multiprocessing binds in it: under ``preferred_parent`` (the run dir, removed with
    it) when that is short, else in the temp dir, else in /tmp."""
    for parent in (preferred_parent, tempfile.gettempdir(), "/tmp"):
        if len(parent) + len("/hf-XXXXXXXX") <= _MAX_SOCKET_DIR and os.access(parent, os.W_OK):
            return tempfile.mkdtemp(prefix="hf-", dir=parent)
    raise ConfigError(f"no writable temp dir short enough for a Unix socket path "
                      f"(tried {preferred_parent!r}, {tempfile.gettempdir()!r}, '/tmp')")


def _parsl_commands() -> dict:
    """Start Parsl's interchange and worker pool with this interpreter.

    Parsl's defaults find ``interchange.py`` and ``process_worker_pool.py`` on
    ``PATH``, which misses them when a venv's python is run without activating it.
    """
    return {"launch_cmd": DEFAULT_LAUNCH_CMD.replace(
        "process_worker_pool.py",
        f"{sys.executable} -m parsl.executors.high_throughput.process_worker_pool", 1)}


# ---------------------------------------------------------------- the provider, translated
def parsl_provider(place: Placement, worker_init: str):
    """Parsl's ``ExecutionProvider`` of the worker pool's one block on ``place``: a
    ``LocalProvider`` here, else the batch job's own (one task per node, ``slots_per_node``
    CPUs each)."""
    job = place.job
    if job is None:
        return _PrivateLocalProvider(launcher=SimpleLauncher(), init_blocks=1, min_blocks=1,
                                     max_blocks=1, nodes_per_block=1, worker_init=worker_init)
    if job.system not in _BATCH_PROVIDERS:
        raise ConfigError(f"parsl has no ExecutionProvider for batch system {job.system!r} "
                          f"(known: {sorted(_BATCH_PROVIDERS)})")
    return _BATCH_PROVIDERS[job.system](
        partition=job.partition, nodes_per_block=place.nodes,
        cores_per_node=place.slots_per_node, exclusive=False,
        walltime=_hms(job.walltime_s), init_blocks=1, min_blocks=1,
        max_blocks=1, launcher=SimpleLauncher(),
        scheduler_options="".join(f"{line}\n" for line in job.directives),
        worker_init=worker_init)


def nodefile_lines(place: Placement, path: str, slots: int) -> str:
    """Write the worker pool's node file (one line per slot) now where ``place`` knows
    its hosts, else return the shell line that writes it inside the block's job."""
    if place.hosts is None:
        return shlex.join([*place.job.hosts_command, path, str(slots)])
    with open(path, "w") as fh:
        fh.write("".join(f"{host}\n" for host in place.hosts))
    return ""


def hours_minutes_seconds(limit) -> str:
    """A Slurm time limit (see ``allocation.time_limit_s``) as ``HH:MM:SS``."""
    return _hms(batch.time_limit_s(limit, "parsl"))


def _hms(total: int) -> str:
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


class _PrivateLocalProvider(LocalProvider):
    """Parsl's LocalProvider whose blocks (submit script, its output files, the worker
    pool and everything under it) are created owner-only (see ``taskdir.private_umask``):
    a block may be started later, by Parsl's strategy thread, outside ``hetflow.runtime``'s
    start-up."""

    def submit(self, command, tasks_per_node, job_name="parsl.localprovider"):
        with private_umask():
            return super().submit(command, tasks_per_node, job_name)


class _PrivateSlurmProvider(SlurmProvider):
    """Parsl's SlurmProvider whose submit scripts and job output are owner-only."""

    def submit(self, command, tasks_per_node, job_name="parsl.slurm"):
        with private_umask():
            return super().submit(command, tasks_per_node, job_name)


#: Parsl's ExecutionProvider for a provider's batch system.
_BATCH_PROVIDERS = {"slurm": _PrivateSlurmProvider}


def _worker_count(max_ranks) -> int:
    """HTEX's workers per block: one per rank slot. A bad ``max_ranks`` gets 1 here
    (Parsl's type check would raise first) and the kernel's ConfigError just after."""
    if isinstance(max_ranks, bool) or not isinstance(max_ranks, int) or max_ranks < 1:
        return 1
    return max_ranks


class ParslMPIExecutor(Executor, MPIExecutor):
    """Parsl's MPI-mode HighThroughputExecutor running hetflow MPI apps on this machine.

    ``max_ranks`` rank slots (default: the machine's cores) are listed in the
    node file; a task that can never fit fails at once with
    :class:`~hetflow.ResourcesUnavailable`. ``heartbeat_period`` and
    ``heartbeat_threshold`` (seconds) bound how long a killed worker pool goes
    unnoticed; ``python`` is the interpreter the ranks run; ``worker_init`` is
    shell run before the worker pool starts; ``keep_task_dirs`` keeps the task dirs
    of successful tasks too.

    ``slurm``: start the worker pool as a batch user would from a login node, as a
    Slurm job of Parsl's ``SlurmProvider`` (``{"nodes": 2, "ntasks": 4, "partition":
    ..., "time": "30", "args": [more sbatch options]}``, as the pool's); ``max_ranks``
    defaults to ``ntasks``, else the nodes' CPUs; ``time`` (Slurm's format) defaults to
    60 minutes, after which Slurm ends the block (Parsl starts another). ``address``:
    the client's interface the worker pool connects back to (loopback by default: the
    test cluster's nodes are this host).

    ``encrypted`` (default True): HTEX's sockets (interchange <-> client, interchange
    <-> worker pool) use CurveZMQ with Parsl's per-run certificates, checked by a ZAP
    handler that admits only the run's own client key, so no other process can submit
    work or feed back results (Parsl's ``MPIExecutor`` defaults to ``encrypted=False``).
    Only an explicit ``encrypted=False`` turns it off.

    The kernel comes first in the class order: its ``submit``, ``start`` and
    ``shutdown`` are the executor's, and HTEX's own are called by name to carry
    tasks to the workers.
    """

    #: A handed-over task may wait for the worker pool to start: its walltime counts from
    #: the worker's launch (see _await_launch).
    reports_launch = True

    def __init__(self, label: str = "parsl", *, max_ranks: Optional[int] = None,
                 gpus=None, python: Optional[str] = None,
                 heartbeat_period: int = 2, heartbeat_threshold: int = 8,
                 keep_task_dirs: bool = False, worker_init: str = "", encrypted: bool = True,
                 slurm: Optional[dict] = None, provider: Optional[Provider] = None,
                 address: str = "127.0.0.1"):
        if heartbeat_threshold <= heartbeat_period:
            raise ConfigError(f"heartbeat_threshold ({heartbeat_threshold}) must exceed "
                              f"heartbeat_period ({heartbeat_period})")
        #: Where the worker pool runs (hetflow's provider; ``self.provider`` is Parsl's).
        place = runtime_place(slurm, provider, max_ranks, gpus)
        self.runs_on, max_ranks = place.provider, place.max_ranks
        super().__init__(
            label, max_ranks=max_ranks, gpus=place.gpus,
            # From here on, MPIExecutor's options (the kernel passes them on).
            provider=parsl_provider(self.runs_on.placement(_worker_count(max_ranks)),
                                    worker_init),
            address=address, **_parsl_commands(),
            max_workers_per_block=_worker_count(
                (os.cpu_count() or 1) if max_ranks is None else max_ranks),
            mpi_launcher="mpiexec", heartbeat_period=heartbeat_period,
            heartbeat_threshold=heartbeat_threshold, poll_period=10, encrypted=encrypted,
            # A lost worker pool must not poison the executor: start a new block.
            block_error_handler=False)
        self.interchange_launch_cmd = [sys.executable, "-m",
                                       "parsl.executors.high_throughput.interchange"]
        self.python = python
        self.keep_task_dirs = keep_task_dirs
        self.worker_init = worker_init
        self._jobs_lock = threading.Lock()   # a _Job's failed_early/ended: decided once

    def parsl_config_options(self) -> dict:
        """Config settings ``hetflow.runtime`` uses with this executor (fast block checks)."""
        return {"strategy_period": 0.2}

    # ------------------------------------------------------------------ runtime
    def _start_runtime(self) -> None:
        """Write the node file, point the worker pool at it, then start HTEX."""
        self.nodefile = os.path.join(self.run_root, "nodefile")
        bindir = os.path.dirname(os.path.abspath(self.python or sys.executable))
        place = self.runs_on.placement(self.max_ranks)
        write_nodefile = nodefile_lines(place, self.nodefile, self.max_ranks)
        # The worker pool's multiprocessing Manager makes a 'pymp-*' dir in TMPDIR that
        # nobody removes when the pool is killed at shutdown: give the pool a TMPDIR of
        # its own, removed in _stop_runtime (the ranks get the client's back).
        self.worker_tmp = _short_private_dir(self.run_root)
        self.provider.worker_init = "\n".join(filter(None, [
            write_nodefile,
            *(f"export {name}={shlex.quote(value)}" for name, value in place.env.items()),
            f"export PBS_NODEFILE={self.nodefile}",
            # Parsl's MPI mode reads $SLURM_NODELIST before $PBS_NODEFILE: inside an
            # allocation that would give it one entry per node, not one per slot.
            "unset SLURM_NODELIST",
            f'export {RANK_TMPDIR}="${{TMPDIR-}}" TMPDIR={self.worker_tmp}',
            # The launcher ("mpiexec") and hetflow must resolve in the worker.
            f'export PATH="{bindir}:$PATH"',
            self.worker_init]))
        MPIExecutor.start(self)

    def _stop_runtime(self) -> None:
        """Stop the interchange and worker pool; end launchers that outlived their worker."""
        try:
            MPIExecutor.shutdown(self)
        finally:
            shutil.rmtree(getattr(self, "worker_tmp", ""), ignore_errors=True)
            # A launcher started after the tasks were stopped, before HTEX went down.
            for task in self.live_tasks():
                self._kill_launcher(self._taskdir(task))

    # ------------------------------------------------------------------ tasks
    def _taskdir(self, task: Task) -> TaskDir:
        return TaskDir(os.path.join(self.run_root, f"task-{task.id:06d}"))

    @property
    def _taskdirs(self) -> Dict[Future, str]:
        """Each unfinished task's dir, by its future (where its ``launcher.json`` appears)."""
        return {task.future: self._taskdir(task).path for task in self.live_tasks()}

    def _start(self, task: Task) -> None:
        """Hand the task to HTEX: its slots are free, so Parsl's MPI scheduler runs it now.

        Parsl's MPI task scheduler has its own backlog, but with 2026.10 it recurses
        without end (RecursionError in the manager, then a hang) when a freed node
        cannot fit the smallest waiting task. The kernel's queue hands a task over only
        when its node-file entries are free, so that backlog stays empty.
        """
        task.handle = _Job(self._taskdir(task))
        inner = MPIExecutor.submit(self, run_mpi_task, parsl_resource_spec(task.resources),
                                   task.payload, self.rank_resources(task),
                                   self.client_sys_path(), task.handle.taskdir.path,
                                   self.python)
        inner.add_done_callback(functools.partial(self._ended, task))
        self._await_launch(task)

    def _await_launch(self, task: Task) -> None:
        """Tell the kernel when the worker has launched the task (its ``launcher.json``), so
        the walltime counts from there, not from a worker pool still starting."""
        if task.done or task.handle.ended:
            return
        info = task.handle.taskdir.read_launcher()
        if info is not None:
            self.launched(task, at=info.get("launched"))
        else:
            self.call_later(POLL_S, lambda: self._await_launch(task))

    def _stop(self, task: Task, error) -> None:
        """Leave the cancel marker the worker polls for; at shutdown also kill the job.

        A task its worker has not launched yet is failed at once; its slots stay taken
        until HTEX's future is done (the worker skips it), so Parsl's backlog stays empty.
        """
        job: _Job = task.handle or _Job(self._taskdir(task))
        job.taskdir.ask_to_stop()
        if self.stopping:
            # HTEX's scale-in kills the worker pool; launchers run in their own sessions.
            self._kill_launcher(job.taskdir)
            return
        with self._jobs_lock:
            early = (error is not None and task.handle is not None and not job.ended
                     and not task.done and job.taskdir.read_launcher() is None)
            if early:
                job.failed_early = True
        if early:
            self.finish(task, release=False)

    def _ended(self, task: Task, inner: Future) -> None:
        """HTEX's future is done: deliver the worker's report (or its loss)."""
        job: _Job = task.handle
        if task.deadline is None:           # ended before _await_launch saw the launch
            info = job.taskdir.read_launcher()
            if info is not None:
                task.times.launched = info.get("launched", task.times.launched)
        with self._jobs_lock:               # decided once against _stop's early failure
            job.ended = not job.failed_early
        try:
            report = inner.result()
        except BaseException as exc:  # noqa: BLE001 - the worker (or its pool) was lost
            self._kill_launcher(job.taskdir, block_lost=type(exc).__name__ == "ManagerLost")
            report = exc
        if job.failed_early:                # delivered by _stop: only the slots are left
            self.release(task.slots)
        elif isinstance(report, BaseException):
            self.finish(task, error=errors.worker_lost(task.id, self.label, report))
        elif report["status"] == "launch_error":
            self.finish(task, error=LaunchError(f"task {task.id} ({self.label}): "
                                                 f"{report['error']}", command=report["command"],
                                                 logs=report["logs"]))
        else:
            self.complete(task, report["outcomes"], returncode=report["returncode"],
                           stderr_tail=report["stderr_tail"], deaths=report["deaths"])
            if task.future.exception() is None and not self.keep_task_dirs:
                job.taskdir.remove()

    def _kill_launcher(self, taskdir: TaskDir, block_lost: bool = False) -> None:
        """Kill a task's launcher tree when its worker can no longer do so (local only).

        With ``block_lost`` (Parsl reported the manager lost) also the rest of that
        worker pool: its workers outlive the manager, blocked on pipes nobody reads.
        A start-time check guards against killing a recycled pid; a process-group
        id is never reused while any member lives.
        """
        info = taskdir.read_launcher()
        if info is None or info.get("host") != socket.gethostname():
            return
        try:
            pid = int(info["pid"])
            if start_ticks(pid) == info["start_ticks"]:
                kill_tree(pid)
        except (KeyError, TypeError, ValueError):
            pass
        pgid = info.get("block_pgid")
        if block_lost and pgid and pgid != os.getpgid(0):
            try:
                os.killpg(int(pgid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@dataclasses.dataclass
class _Job:
    """A task handed to HTEX. ``failed_early``: ``_stop`` failed its future before the
    worker launched it (its slots are freed when HTEX's future is done); ``ended``:
    HTEX's future is done and delivers the task (``_stop`` no longer may)."""

    taskdir: TaskDir
    failed_early: bool = False
    ended: bool = False
