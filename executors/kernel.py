"""The executor protocol: what a hetflow runtime is, in one file.

A runtime is a Parsl executor (so it works in ``hetflow.runtime(name)`` and in a
user's own ``parsl.Config``) built on :class:`Executor`. The kernel owns each
task's life: validation, the FIFO-with-backfill queue (:mod:`~hetflow.executors.dispatch`),
cancelling queued tasks, walltimes, delivery with timestamps, and shutdown. A runtime only starts and
stops work, through these hooks:

``_start(task)``            required. Run ``task`` on ``task.slots`` (rank slots the
                            queue gave it) and ``task.devices`` (GPU ids: give the
                            ranks :meth:`Executor.rank_resources`, which the shared
                            rank binding applies); called on the kernel's dispatch
                            thread (``dispatch_on_release``: the one calling ``release``;
                            ``dispatch_on_submit``: the one calling ``submit``), so hand
                            long work to a thread or an event loop. When the
                            task ends, call :meth:`Executor.complete` with the ranks'
                            outcomes (or :meth:`Executor.finish` with a value or error).
``_stop(task, error)``      required. Stop the running task's processes now. ``error``
                            (walltime, cancel, shutdown) is the task's verdict and
                            wins over what the runtime later reports; None means a
                            rank failed and its peers hung: the ranks' reports decide.
``_start_runtime()``        optional. Bring up what lives as long as the executor
                            (a pilot, an MPI world); ``self.run_root`` is its dir.
``_stop_runtime()``         optional. Tear it down; running tasks were stopped first.
``_admit(task, args, kwargs)``  optional. Runtime-specific checks at submit time.
``_head_blocked(task)``     optional. The queue's first task could not start on the
                            slots there are (a runtime that can reshape them may act).
``_stack_files(task)``      optional (``own_stacks`` runtimes). ``{task rank: (pid, stack
                            file)}`` of the running task's ranks on this node.
``_make_scheduler(max_bypass)``, ``_slots_needed(resources)``, ``_gpus_needed(resources)``
                            optional. The runtime's own placement (a
                            :class:`SlotScheduler`), slot and device counts.

What a runtime may call on the kernel (nothing else: the kernel's ``_`` names are its
own, and may change):

``complete(task, outcomes, **evidence)``  deliver the task from its ranks' outcomes.
``finish(task, value, error, release=)``  deliver a value or an error; free its slots.
``launched(task, at=None)`` the task's processes started (``reports_launch`` runtimes).
``release(slots)``          free slots a ``release=False`` delivery kept.
``requeue(*tasks, release=)``  queue running tasks again, first.
``dequeue(task)``           take a queued task out of the queue (True if it was there).
``rank_resources(task)``    the task's resources as its ranks read them, with its devices.
``placement(wake=)``        a context holding the queue's lock, giving the runtime's
                            scheduler to read or reshape (add, remove, hold slots).
``live_tasks()``            the tasks not yet delivered, queued or running.
``fail_all(error_for)``     fail every task, queued or running, with ``error_for(task)``.
``call_later(s, fn)``       run ``fn`` on the kernel's timer thread in ``s`` seconds.
``stopping``                True once shutdown began.

GPUs are scheduled like slots: ``gpus=`` (a count, or the device ids of a node) gives
the queue its devices; a task needing ``ranks x gpus_per_rank`` waits until that many
are free, and each of its ranks sees its own block in ``CUDA_VISIBLE_DEVICES``; a task
needing none sees none (``""``) and runs beside it.

A new runtime also registers its class in the ``hetflow.executors`` entry-point
group. Every rank runs the shared runner (``_rank.run_on_rank``), so values and
errors are identical across runtimes by construction.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from concurrent.futures import Future
from typing import Any, ContextManager, Dict, List, Optional, Protocol, runtime_checkable

from parsl.executors.base import ParslExecutor

from hetflow import errors, tables
from hetflow.apps import ARGUMENTS_KWARG
from hetflow.errors import ConfigError, ExecutorBroken, NotSupported, ResourcesUnavailable
from hetflow.executors import monitoring, rankio, stacks
from hetflow.executors.payload import RankFiles, TaskPayload, collect
from hetflow.executors.allocation import default_slots
from hetflow.executors.dispatch import Task, TaskFuture, TaskQueue
from hetflow.executors.resource_spec import InvalidResourceSpec, read_resources  # noqa: F401
from hetflow.executors.scheduler import SlotScheduler
from hetflow.executors.watch import Watch
from hetflow.spec import Resources, gpu_ids
from hetflow.tasks import TaskState, TaskTimes


@runtime_checkable
class Runtime(Protocol):
    """Everything core (``hetflow.apps``, ``hetflow.tasks``, ``hetflow.runtime``) relies on."""

    label: str
    max_ranks: int
    #: Features this runtime cannot provide, feature -> reason ("walltime", "cancel_running",
    #: "resident_data"); asking for one raises NotSupported naming it.
    unsupported: Dict[str, str]

    def check_resources(self, resources: Resources) -> None:
        """Raise ResourcesUnavailable for a task this runtime can never run."""

    def cancel(self, future: Future) -> bool:
        """Stop a queued or running task (its future fails with TaskCancelled)."""

    def parsl_config_options(self) -> dict:
        """Settings ``hetflow.runtime`` puts in the Parsl Config around this executor."""


class Executor(ParslExecutor):
    """The kernel every hetflow runtime builds on (see the module docstring for the hooks)."""

    unsupported: Dict[str, str] = {}
    #: True for a runtime whose tasks may wait after ``_start`` (a remote worker starting):
    #: it calls :meth:`_launched` when the task's processes start, and the walltime counts
    #: from there. Otherwise the task counts as launched when ``_start`` is called.
    reports_launch: bool = False
    #: True: what fits on slots freed by :meth:`release` starts on the caller's thread, not
    #: the dispatch thread (the pool's broker, whose ``_start`` only posts to itself).
    dispatch_on_release: bool = False
    #: True: a task submitted when it fits starts on the submitting thread (Parsl's task
    #: launcher), not the dispatch thread: one thread hand-off less per task, for a runtime
    #: whose ``_start`` only posts (the pool's broker).
    dispatch_on_submit: bool = False
    #: True: the runtime's ranks keep a stack file each for life (``_rankio.keep_stacks``,
    #: named by :meth:`_stack_files`) and it records when each rank returned itself: a task
    #: capturing no output and taking no samples gets no files dir (no file made per task).
    own_stacks: bool = False
    #: Where the ranks' output goes: ``"console"`` (the client's stdout, each line prefixed
    #: ``[task N rank R]``), ``"files"`` (``<runtime dir>/output/task-NNNNNN.log``), a text
    #: stream, or ``"off"`` (not captured). ``hetflow.runtime(output=...)`` sets it.
    output: Any = "console"
    #: Seconds after a task's first rank returned before a warning names the ranks still
    #: running (see :mod:`hetflow.executors.rankio`).
    hang_warning_s: float = rankio.HANG_WARNING_S
    #: A progress display (``hetflow._progress.Campaign``) told of every task, or None.
    progress: Any = None
    #: Seconds between two resource samples of every rank (None: only when Parsl's resource
    #: monitoring asks; see :mod:`hetflow.executors.monitoring`).
    sample_s: Optional[float] = None
    _follower: Optional[rankio.Follower] = None     # set by start()
    node_root: Optional[str] = None                 # this node's 0700 dir of the run (start())

    def __init__(self, label: str, *, max_ranks: Optional[int] = None,
                 gpus=None, max_bypass: int = 16, **parsl_options):
        super().__init__(**parsl_options)
        self.label = label
        # Inside a batch allocation the default is its CPUs, not this node's cores.
        self.max_ranks = default_slots() if max_ranks is None else max_ranks
        if isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int) \
                or self.max_ranks < 1:
            raise ConfigError(f"max_ranks must be a positive int, got {max_ranks!r}")
        #: The GPU ids tasks share (``gpus=``: a count, a list of ids, or None: this
        #: machine's), and how many.
        self.gpu_ids = gpu_ids(gpus)
        self.gpus = len(self.gpu_ids)
        self._scheduler = self._make_scheduler(max_bypass)
        #: The queue and its dispatch thread (:mod:`hetflow.executors.dispatch`); its lock
        #: guards the task table too.
        self._queue = TaskQueue(f"{label}-dispatch", self._scheduler, self._launch,
                                self._head_blocked)
        self._lock = self._queue.lock
        self._live: Dict[Future, Task] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._watch = Watch(f"{label}-watch")
        self._client = (os.getpid(), os.uname().nodename)   # where the ranks' files dir is
        self.remote_monitoring_radio = monitoring.radio()
        self._monitor = monitoring.Monitor(self)

    # ------------------------------------------------------------------ hooks
    def _start(self, task: Task) -> None:
        raise NotImplementedError

    def _stop(self, task: Task, error: Optional[BaseException]) -> None:
        raise NotImplementedError

    def _start_runtime(self) -> None:
        pass

    def _stop_runtime(self) -> None:
        pass

    def _admit(self, task: Task, args: tuple, kwargs: dict) -> None:
        pass

    def _head_blocked(self, task: Task) -> None:
        pass

    def _stack_files(self, task: Task) -> Optional[dict]:
        return None

    def _make_scheduler(self, max_bypass: int) -> SlotScheduler:
        return SlotScheduler(self.max_ranks, max_bypass=max_bypass, devices=self.gpu_ids)

    def _slots_needed(self, resources: Resources) -> int:
        return resources.cores

    def _gpus_needed(self, resources: Resources) -> int:
        return resources.ranks * resources.gpus_per_rank

    # ------------------------------------------------------------------ Parsl's executor API
    def start(self) -> None:
        self.run_root = os.path.abspath(os.path.join(self.run_dir, self.label))
        self._tables_dir = os.path.join(self.run_root, tables.TABLES_DIR)
        from hetflow.executors.taskdir import private_dir
        private_dir(self.run_root)
        rankio.check_output(self.output)
        self.node_root = rankio.node_root(self.run_root, self.label)
        self._follower = rankio.Follower(self.label, self.node_root, self.run_root, self.output,
                                         lambda: self.hang_warning_s, lambda: self.progress)
        try:
            self._start_runtime()
        except BaseException:
            rankio.remove_node_root(self.node_root, self.run_root)
            raise
        self._queue.start()

    def submit(self, func, resource_specification, *args, **kwargs) -> Future:
        if self._stopping:
            raise ExecutorBroken(f"executor {self.label!r} is shut down")
        resources = read_resources(resource_specification)
        self.check_resources(resources)
        future: Future = TaskFuture()
        task_id = next(self._ids)
        future.parsl_executor_task_id = task_id
        func, kwargs, parsl_ids, parsl_interval = monitoring.unwrap(func, kwargs)
        sample_s = self._monitor.interval(parsl_interval)
        # The arguments were pickled once at the call (hetflow.apps), unless a Future among
        # them was resolved since, or a table among them is carried another way now: then
        # they are pickled here.
        arguments = kwargs.pop(ARGUMENTS_KWARG, None)
        prepared_args, prepared_kwargs = tables.prepare(self, resources, args, kwargs)
        if prepared_args is not args or prepared_kwargs is not kwargs:
            args, kwargs, arguments = prepared_args, prepared_kwargs, None
        files = None      # no files dir: nothing to capture, sample, or ask stacks of there
        if not self.own_stacks or self.output != "off" or sample_s is not None:
            directories = self._follower.directories(task_id)
            files = RankFiles(*directories, self.output != "off", *self._client, sample_s)
        payload = TaskPayload(task_id, func, args, kwargs, resources, self._tables_dir, files,
                              arguments).dumps()
        task = Task(task_id, resources, payload, future,
                    TaskTimes(executor=self.label, ranks=resources.ranks, submitted=time.time()))
        task.files_dir = files is not None
        future.hetflow_task = task
        if sample_s is not None:
            task.samples = self._monitor.watch(task, files[:2], sample_s, parsl_ids)
        self._admit(task, args, kwargs)
        now = self.dispatch_on_submit
        with self._lock:
            self._live[future] = task
            self._queue.push(task, self._slots_needed(resources), self._gpus_needed(resources),
                             now=now)
        if self.progress is not None:
            self.progress.submitted(task_id)
        if now:
            self._queue.dispatch()
        return future

    def check_resources(self, resources: Resources) -> None:
        if resources.walltime is not None and "walltime" in self.unsupported:
            raise NotSupported(f"walltime: {self.unsupported['walltime']}")
        if self._slots_needed(resources) > self.max_ranks:
            raise ResourcesUnavailable(
                f"task needs {resources.ranks} rank(s) x {resources.cores_per_rank} core(s) = "
                f"{resources.cores} slot(s), but executor {self.label!r} has max_ranks="
                f"{self.max_ranks}")
        if resources.ranks * resources.gpus_per_rank > self.gpus:
            raise ResourcesUnavailable(
                f"task needs {resources.ranks * resources.gpus_per_rank} GPU(s), but executor "
                f"{self.label!r} has {self.gpus} ({self.gpu_ids})")

    def cancel(self, future: Future) -> bool:
        """Cancel a queued or running task: its future fails with TaskCancelled."""
        with self._lock:
            task = self._live.get(future)
            if task is None or task.done:
                return False
            queued = self._queue.remove(task)
        if queued:
            self.finish(task, error=errors.cancelled(task.id, self.label, running=False))
        elif "cancel_running" in self.unsupported:
            raise NotSupported(f"cancel a running task: {self.unsupported['cancel_running']}")
        else:
            self._halt(task, errors.cancelled(task.id, self.label, running=True))
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            queued = self._queue.close()
            waiting = set(queued)
            running = [t for t in self._live.values() if t not in waiting]
        if self._follower is not None:
            self._follower.close()
        self._monitor.close()
        for task in queued:
            self.finish(task, error=errors.shut_down(task.id, self.label))
        for task in running:
            self._halt(task, errors.shut_down(task.id, self.label))
        try:
            self._stop_runtime()
        finally:
            for task in list(self._live.values()):
                self.finish(task, error=errors.shut_down(task.id, self.label))
            self._watch.close()
            if self.node_root is not None:
                rankio.remove_node_root(self.node_root, self.run_root)
            self._queue.join(timeout=10)

    def parsl_config_options(self) -> dict:
        return {}

    def monitor_resources(self) -> bool:
        return False   # Parsl's monitor watches one process tree; MPI ranks are many

    # ------------------------------------------------------------------ for runtimes
    def complete(self, task: Task, outcomes: dict, **evidence) -> None:
        """Finish ``task`` from its ranks' outcomes (``evidence``: see ``payload.collect``)."""
        value, error = None, None
        if task.samples is not None:
            task.samples.carry(outcomes)
        try:
            value = collect(outcomes, task.id, task.resources, self.label, **evidence)
        except BaseException as exc:  # noqa: BLE001 - the task's typed error
            error = exc
        self.finish(task, value, error, root=outcomes.get(0))

    def finish(self, task: Task, value=None, error: Optional[BaseException] = None, *,
                root=None, release: bool = True) -> None:
        """Deliver the task's result once (the kernel's verdict wins); free its slots.

        ``root`` is rank 0's outcome (its start and finish stamps); ``release=False``
        for a runtime that frees slots itself as each rank comes back (the pool).
        """
        with self._lock:
            if self._live.pop(task.future, None) is None:
                return
            if (release and task.slots) or task.devices:
                self._queue.release(task.slots if release else (), task.devices)
            task.devices = ()
        if task.deadline is not None:
            task.deadline.cancel()
        error = task.error or error
        self._monitor.finish(task)     # its last samples, before its files dir goes
        if task.files is not None:     # every line the ranks wrote is out before the result
            self._follower.remove(task.files)
            task.files.close(success=error is None)
            if isinstance(error, errors.TaskLost) and not getattr(error, "output_tail", ""):
                error.output_tail = task.files.text()[-2000:]   # what the ranks said last
        if root is not None:
            task.times.started, task.times.finished = root.started, root.finished
        task.times.delivered = time.time()
        task.state = TaskState.of_outcome(error)
        task.payload = b""
        if self.progress is not None:
            self.progress.finished(task.id, task.state)
        if error is not None:
            task.future.set_exception(error)
        else:
            task.future.set_result(value)

    def rank_resources(self, task: Task) -> dict:
        """The task's resources as its ranks read them (``meta.json``): the
        :class:`~hetflow.spec.Resources` fields, plus ``devices``, the GPU ids its ranks
        bind on their node (``_rank.bind_rank_environment``): none for a task needing none
        when the runtime has GPUs; None (the launcher's binding stays) when it has none."""
        return {**task.resources.as_dict(),
                "devices": list(task.devices) if self.gpus else None}

    def release(self, slots) -> None:
        """Free slots outside :meth:`finish` (``release=False`` runtimes)."""
        self._queue.release(slots, now=self.dispatch_on_release)

    def requeue(self, *tasks: Task, release: bool = False) -> None:
        """Queue running tasks again, first (they lost their ranks through no fault of their
        own); ``release``: free their slots in the same step, so they go to them first."""
        self._queue.requeue(tasks, release, lambda task: (
            self._slots_needed(task.resources), self._gpus_needed(task.resources)))

    def dequeue(self, task: Task) -> bool:
        """Take ``task`` out of the queue; whether it was queued."""
        return self._queue.remove(task)

    def placement(self, wake: bool = False) -> ContextManager[SlotScheduler]:
        """The runtime's scheduler (from ``_make_scheduler``) under the queue's lock, to read
        or reshape (add, remove, hold slots); ``wake``: the dispatcher looks at the queue
        again afterwards."""
        return self._queue.placement(wake)

    def live_tasks(self) -> List[Task]:
        """Every task not yet delivered, queued or running."""
        with self._lock:
            return list(self._live.values())

    def fail_all(self, error_for, *, release: bool = True) -> None:
        """Fail every task, queued or running, with ``error_for(task)`` (the runtime is
        broken); each future gets an exception of its own."""
        with self._lock:
            self._queue.drain()
            tasks = list(self._live.values())
        for task in tasks:
            self.finish(task, error=error_for(task), release=release)

    def call_later(self, seconds: float, action):
        """Run ``action`` on the kernel's timer thread in ``seconds``; the handle's
        ``cancel()`` stops it."""
        return self._watch.after(seconds, action)

    @property
    def stopping(self) -> bool:
        """Whether shutdown has begun."""
        return self._stopping

    def launched(self, task: Task, at: Optional[float] = None) -> None:
        """The task's processes started (``at``, a ``time.time()``; default now): stamp
        ``launched`` and arm its walltime from then."""
        task.times.launched = time.time() if at is None else at
        if task.resources.walltime is not None and not task.done:
            left = task.resources.walltime - (time.time() - task.times.launched)
            task.deadline = self._watch.after(max(0.0, left), lambda: self._halt(
                task, errors.walltime_exceeded(task.id, self.label, task.resources.walltime)))

    def _halt(self, task: Task, error: Optional[BaseException]) -> None:
        """Decide ``task``'s verdict (if given and none yet) and have the runtime stop it.

        A running task's verdict carries which ranks had returned and the Python stacks of
        those still running, taken just before they are stopped."""
        if error is not None and task.error is None:
            if task.files is not None and not task.done:
                stacks.explain(task.files, error, self._stack_files(task))
            task.error = error
        if not task.done:
            self._stop(task, error)

    # ------------------------------------------------------------------ dispatch
    def _launch(self, task: Task) -> None:
        """Start a task the queue placed (on the dispatch thread, outside the lock)."""
        if not self.reports_launch:
            self.launched(task)
        if self.progress is not None:
            self.progress.started(task.id)
        try:
            self._follower.follow(task, make=task.files_dir)
            self._start(task)
        except BaseException as exc:  # noqa: BLE001 - the future must learn of it
            self.finish(task, error=exc)

    @staticmethod
    def client_sys_path() -> list:
        """The client's import path, handed to ranks so its modules' functions unpickle."""
        return [p for p in sys.path if p]
