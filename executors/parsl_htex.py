"""Parsl's HighThroughputExecutor in MPI mode, running hetflow MPI apps.

:class:`ParslMPIExecutor` *is* a Parsl ``MPIExecutor`` (HTEX with
``enable_mpi_mode``) on a ``LocalProvider`` with a ``SimpleLauncher``, so it
works in ``hetflow.runtime("parsl")`` and in a user's own ``parsl.Config``.

How a task runs: the app's :class:`~hetflow.spec.Resources` become Parsl's
``parsl_resource_specification``; Parsl's MPI task scheduler (in the worker
pool's manager) gives the task that many node-list entries and sets
``$PARSL_MPI_PREFIX``; the HTEX worker runs
:func:`~hetflow.executors._parsl_worker.run_mpi_task`, which launches the shared
rank-side runner under that prefix, enforces the walltime, honours a cancel
marker and kills the whole tree. The client turns the ranks' reports into the
value or typed error with :func:`~hetflow.executors.base.collect`, as ``mpirun`` does.

Local node list: MPI mode only knows Slurm or PBS node lists and runs one MPI
task per listed "node" at a time. On a bare machine the executor writes a
``PBS_NODEFILE`` listing ``localhost`` once per rank slot (``max_ranks`` lines),
so each line is one core slot and tasks of different sizes run side by side.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from typing import Dict, Optional

from parsl.executors.high_throughput.executor import DEFAULT_LAUNCH_CMD
from parsl.executors.high_throughput.mpi_executor import MPIExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider

from hetflow.errors import (ConfigError, ExecutorBroken, LaunchError, TaskCancelled, TaskLost,
                            WalltimeExceeded)
from hetflow.executors._parsl_worker import (CANCEL_MARKER, LAUNCHER_FILE, RANK_TMPDIR,
                                             run_mpi_task)
from hetflow.executors.base import HetflowExecutor, SlotScheduler, TaskTimes, collect
from hetflow._guardian import start_ticks
from hetflow.executors.launch import kill_tree, timestamps
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


class ParslMPIExecutor(MPIExecutor):
    """Parsl's MPI-mode HighThroughputExecutor running hetflow MPI apps on this machine.

    ``max_ranks`` rank slots (default: the machine's cores) are listed in the
    node file; a task that can never fit fails at once with
    :class:`~hetflow.ResourcesUnavailable`. ``heartbeat_period`` and
    ``heartbeat_threshold`` (seconds) bound how long a killed worker pool goes
    unnoticed; ``python`` is the interpreter the ranks run.
    """

    #: Nothing in the parity suite is out of reach: walltime and cancellation are
    #: enforced by the worker-side launcher.
    unsupported: Dict[str, str] = {}

    def __init__(self, label: str = "parsl", *, max_ranks: Optional[int] = None,
                 gpus: Optional[int] = None, python: Optional[str] = None,
                 heartbeat_period: int = 2, heartbeat_threshold: int = 8,
                 keep_task_dirs: bool = False, worker_init: str = ""):
        cores = os.cpu_count() or 1
        self.max_ranks = cores if max_ranks is None else max_ranks
        if isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int) or self.max_ranks < 1:
            raise ConfigError(f"max_ranks must be a positive int, got {max_ranks!r}")
        if heartbeat_threshold <= heartbeat_period:
            raise ConfigError(f"heartbeat_threshold ({heartbeat_threshold}) must exceed "
                              f"heartbeat_period ({heartbeat_period})")
        provider = LocalProvider(launcher=SimpleLauncher(), init_blocks=1, min_blocks=1,
                                 max_blocks=1, nodes_per_block=1, worker_init=worker_init)
        super().__init__(label=label, provider=provider, address="127.0.0.1",
                         **_parsl_commands(),
                         max_workers_per_block=self.max_ranks, mpi_launcher="mpiexec",
                         heartbeat_period=heartbeat_period,
                         heartbeat_threshold=heartbeat_threshold, poll_period=10,
                         # A lost worker pool must not poison the executor: start a new block.
                         block_error_handler=False)
        self.interchange_launch_cmd = [sys.executable, "-m",
                                       "parsl.executors.high_throughput.interchange"]
        from hetflow.executors.base import machine_gpus

        self.gpus = machine_gpus() if gpus is None else gpus
        self.python = python
        self.keep_task_dirs = keep_task_dirs
        self._user_worker_init = worker_init
        self._lock = threading.Lock()
        self._hetflow_counter = 0
        self._taskdirs: Dict[Future, str] = {}
        self._slots = SlotScheduler(self.max_ranks)
        self._submit_lock = threading.RLock()
        self._stopping = False

    check_resources = HetflowExecutor.check_resources
    payload = staticmethod(HetflowExecutor.payload)
    deliver = staticmethod(HetflowExecutor.deliver)
    client_sys_path = staticmethod(HetflowExecutor.client_sys_path)
    fail_unfinished = HetflowExecutor.fail_unfinished

    def parsl_config_options(self) -> dict:
        """Config settings ``hetflow.runtime`` uses with this executor (fast block checks)."""
        return {"strategy_period": 0.2}

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        """Write the node file, point the worker pool at it, then start HTEX."""
        self.hetflow_dir = os.path.join(self.run_dir, f"{self.label}-hetflow")
        self.task_root = os.path.join(self.hetflow_dir, "tasks")
        os.makedirs(self.task_root, exist_ok=True)
        self.nodefile = os.path.join(self.hetflow_dir, "nodefile")
        with open(self.nodefile, "w") as fh:
            fh.write("localhost\n" * self.max_ranks)
        bindir = os.path.dirname(os.path.abspath(self.python or sys.executable))
        # The worker pool's multiprocessing Manager makes a 'pymp-*' dir in TMPDIR that
        # nobody removes when the pool is killed at shutdown: give the pool a TMPDIR of
        # its own, removed in shutdown (the ranks get the client's back).
        self.worker_tmp = _short_private_dir(self.hetflow_dir)
        self.provider.worker_init = "\n".join(filter(None, [
            f"export PBS_NODEFILE={self.nodefile}",
            f'export {RANK_TMPDIR}="${{TMPDIR-}}" TMPDIR={self.worker_tmp}',
            # The launcher ("mpiexec") and hetflow must resolve in the worker.
            f'export PATH="{bindir}:$PATH"',
            self._user_worker_init]))
        return super().start()

    def shutdown(self, timeout: float = 10.0):
        """Stop running tasks' process trees, then the interchange and worker pool."""
        self._stopping = True
        with self._lock:
            self._slots.queue.clear()
            pending = dict(self._taskdirs)
        for taskdir in pending.values():
            self._ask_to_stop(taskdir)
        # HTEX kills the worker pool; launchers run in their own sessions, so end them too.
        for taskdir in pending.values():
            self._kill_launcher(taskdir)
        try:
            super().shutdown(timeout=timeout)
        finally:
            import shutil

            shutil.rmtree(getattr(self, "worker_tmp", ""), ignore_errors=True)
            for taskdir in pending.values():
                self._kill_launcher(taskdir)
            self.fail_unfinished((future.parsl_executor_task_id, future) for future in pending)

    # ------------------------------------------------------------------ tasks
    def submit(self, func, resource_specification, *args, **kwargs) -> Future:
        """Run ``func`` as an MPI task of the size its hetflow resource spec asks for."""
        if self._stopping:
            raise ExecutorBroken(f"executor {self.label!r} is shut down")
        resources = Resources.from_spec(resource_specification)
        self.check_resources(resources)
        with self._lock:
            task_id = self._hetflow_counter
            self._hetflow_counter += 1
        future: Future = Future()
        future.parsl_executor_task_id = task_id
        future.hetflow_times = TaskTimes(executor=self.label, ranks=resources.ranks,
                                         submitted=time.time())
        taskdir = os.path.join(self.task_root, f"task-{task_id:06d}")
        payload = self.payload(task_id, func, args, kwargs, resources)
        with self._lock:
            self._taskdirs[future] = taskdir
            self._slots.push((task_id, resources, taskdir, future, payload), resources.cores)
        self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Hand HTEX the tasks whose rank slots are free now, in FIFO-with-backfill order.

        Parsl's MPI task scheduler has its own backlog, but with 2026.10 it recurses
        without end (RecursionError in the manager, then a hang) when a freed node
        cannot fit the smallest waiting task. Gating here means a task only reaches
        the manager when its node-file entries are free, so that backlog stays empty.
        """
        with self._submit_lock:
            with self._lock:
                ready = self._slots.pop_ready()
            for (task_id, resources, taskdir, future, payload), slots in ready:
                if future.done():  # cancelled while it waited
                    with self._lock:
                        self._slots.release(slots)
                    continue
                try:
                    inner = super().submit(run_mpi_task, parsl_resource_spec(resources), payload,
                                           asdict(resources), self.client_sys_path(), taskdir,
                                           self.python)
                except BaseException as exc:  # noqa: BLE001 - e.g. the executor is in a bad state
                    with self._lock:
                        self._slots.release(slots)
                        self._taskdirs.pop(future, None)
                    self.deliver(future, error=exc)
                    continue
                inner.add_done_callback(functools.partial(
                    self._finish, task_id, resources, taskdir, future, slots))
        # A delivery above freed slots: let waiting tasks through.
        with self._lock:
            more = bool(self._slots.queue) and self._slots.free and not self._stopping
        if more and ready:
            self._dispatch()

    def _finish(self, task_id: int, resources: Resources, taskdir: str, future: Future,
                slots, inner: Future) -> None:
        value, error, stamps = None, None, {}
        try:
            report = inner.result()
        except BaseException as exc:  # noqa: BLE001 - the worker (or its pool) was lost
            self._kill_launcher(taskdir, block_lost=type(exc).__name__ == "ManagerLost")
            error = TaskLost(
                f"task {task_id} ({self.label}): the Parsl worker running it was lost "
                f"({type(exc).__name__}: {exc})", task_id=task_id)
            error.__cause__ = exc
            report = None
        if report is not None:
            stamps = timestamps(report["outcomes"], report["launched"])
            status = report["status"]
            if status == "cancelled" or os.path.exists(os.path.join(taskdir, CANCEL_MARKER)):
                error = TaskCancelled(f"task {task_id} ({self.label}) was cancelled")
            elif status == "walltime":
                error = WalltimeExceeded(
                    f"task {task_id} ({self.label}) exceeded its walltime of "
                    f"{resources.walltime} s and was stopped", walltime=resources.walltime,
                    task_id=task_id)
            elif status == "launch_error":
                error = LaunchError(f"task {task_id} ({self.label}): {report.get('error')}",
                                    command=report["command"], logs=report["logs"])
            else:
                try:
                    value = collect(report["outcomes"], resources, task_id=task_id,
                                    returncode=report["returncode"],
                                    stderr_tail=report["stderr_tail"], executor=self.label,
                                    deaths=report["deaths"])
                except BaseException as exc:  # noqa: BLE001 - the task's typed error
                    error = exc
        with self._lock:
            self._taskdirs.pop(future, None)
            self._slots.release(slots)
        if error is None and not self.keep_task_dirs:
            import shutil

            shutil.rmtree(taskdir, ignore_errors=True)
        self.deliver(future, value, error, stamps)
        if not self._stopping:
            self._dispatch()

    def cancel(self, future: Future) -> bool:
        """Stop a queued or running task; its future fails with TaskCancelled.

        HTEX cannot cancel a running task, so the client leaves a marker in the task
        dir; the worker-side launcher sees it within ~50 ms and kills the job's tree.
        A task that has not reached a worker yet is failed here at once and skipped
        by the worker when it arrives.
        """
        with self._lock:
            taskdir = self._taskdirs.get(future)
        if taskdir is None or future.done():
            return False
        with self._lock:
            queued = any(entry[0][3] is future for entry in self._slots.queue)
            if queued:
                for entry in list(self._slots.queue):
                    if entry[0][3] is future:
                        self._slots.queue.remove(entry)
                self._taskdirs.pop(future, None)
        self._ask_to_stop(taskdir)
        if queued or not os.path.exists(os.path.join(taskdir, LAUNCHER_FILE)):
            self.deliver(future, error=TaskCancelled(
                f"task {future.parsl_executor_task_id} ({self.label}) was cancelled before "
                "it started"))
        return True

    @staticmethod
    def _ask_to_stop(taskdir: str) -> None:
        os.makedirs(taskdir, exist_ok=True)
        open(os.path.join(taskdir, CANCEL_MARKER), "w").close()

    @staticmethod
    def _kill_launcher(taskdir: str, block_lost: bool = False) -> None:
        """Kill a task's launcher tree when its worker can no longer do so (local only).

        With ``block_lost`` (Parsl reported the manager lost) also the rest of that
        worker pool: its workers outlive the manager, blocked on pipes nobody reads.
        A start-time check guards against killing a recycled pid; a process-group
        id is never reused while any member lives.
        """
        try:
            with open(os.path.join(taskdir, LAUNCHER_FILE)) as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            return
        if info.get("host") != socket.gethostname():
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

    def monitor_resources(self) -> bool:
        # Parsl's resource monitor watches one process tree; MPI ranks are many.
        return False
