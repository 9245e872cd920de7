"""The radical runtime's executor: the kernel's hooks, on a pilot and its RAPTOR worker.

Each task takes one of two paths (``mode="auto"``): a RAPTOR function task on the
runtime's one MPI worker (the default: no launch per task), or, for a task with a
``walltime`` or GPUs, an RP MPI executable task (a fresh ``mpiexec``), which can be stopped
alone and whose fresh ranks bind their GPUs before anything initialises CUDA (a RAPTOR
worker rank keeps the device CUDA first saw, whatever a later task is given).

RP cannot time out or cancel a running function task, and a rank that dies or raises while
its peers wait in a collective takes the whole worker with it. So every RAPTOR task is
watched from here (pid files and outcomes in its task dir): on a crash, a stuck failure, a
cancel or a walltime the worker is killed, that task fails, a new worker starts and the
tasks that were running on it are queued again (:meth:`RadicalExecutor._recycle`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from hetflow._guardian import alive
from hetflow.errors import ConfigError, ExecutorBroken, LaunchError
from hetflow.executors._forensics import kill_launch_of
from hetflow.executors.kernel import Executor, Task
from hetflow.executors.launch import hydra_deaths
from hetflow.executors.providers import Provider, ThisMachine, runtime_place
from hetflow.executors.radical.hygiene import session_processes
from hetflow.executors.radical import configs, priority
from hetflow.executors.radical.configs import LOCAL_RESOURCE, SLURM_RESOURCE, Descriptions
from hetflow.executors.radical.pilot import FINAL, Pilot, text
from hetflow.executors.radical.worker import RaptorWorker, worker_lost
from hetflow.executors.taskdir import Deaths, TaskDir, private_dir
from hetflow.executors.watch import PEER_GRACE_S, POLL_S

logger = logging.getLogger(__name__)

MODES = ("auto", "raptor", "exec")
_WORKER_LOST = "the RAPTOR MPI worker running this task was lost"
_WORKER_CHECK_S = 0.25   # how often the watchdog looks at a worker that is not up yet


@dataclass
class _InPilot:
    """The radical runtime's handle on a running task (``Task.handle``)."""

    path: str                               # "raptor" or "exec"
    taskdir: TaskDir
    uid: str = ""                           # its RP task's uid (named by Pilot.next_uid)
    failed_seen: Optional[float] = None     # when a rank's failure was first seen (RAPTOR)


def task_verdict(*, worker_lost: bool, rank_failed: bool, failed_seen: Optional[float],
                 now: float) -> tuple:
    """Whether a running RAPTOR task must be recycled (the worker will never report it): a
    rank of its worker died, or one failed and its peers have waited in a collective longer
    than ``PEER_GRACE_S``; and when a failure was first seen. Pure: unit-tested."""
    if worker_lost:
        return True, failed_seen
    if rank_failed:
        seen = now if failed_seen is None else failed_seen
        return now - seen > PEER_GRACE_S, seen
    return False, failed_seen


class RadicalExecutor(Executor):
    """A Parsl executor running hetflow MPI apps inside one RADICAL-Pilot pilot.

    A task's ``walltime`` counts from its function's start on its first rank (its pid
    file), not from its submission to RP: RP's dispatch and a fresh ``mpiexec`` take
    seconds on a loaded node (see docs/api.md).

    resource / config_dir: the RP resource label and a folder of ``resource_*.json``
    files (e.g. a Slurm site); default: hetflow's config for where ``provider`` says.
    pilot: extra ``PilotDescription`` fields (``runtime``, ``queue``, ``project``, ...).
    sandbox_dir: where sessions, sandboxes and logs go (default: inside the runtime's
    run dir); removed at shutdown unless ``keep_sandbox``.
    mode: "auto" (RAPTOR; walltime and GPU tasks as executable tasks), "raptor" or "exec".
    With ``mode="raptor"`` a GPU task's RAPTOR ranks are bound per task like any other
    (``CUDA_VISIBLE_DEVICES``, set before the task runs), which holds only while no task
    has initialised CUDA in those worker ranks.
    provider: where the pilot runs (:mod:`hetflow.executors.providers`); by default this
    machine, or inside a Slurm allocation its nodes. ``slurm={"nodes": 2, "ntasks": 4,
    "partition": ..., "time": "30"}`` (minutes) is short for ``provider=SlurmJob(...)``:
    the pilot is a Slurm job, ``max_ranks`` defaults to ``ntasks``, else the nodes' CPUs,
    and ``startup_timeout`` includes the job's queue wait.
    descriptions: a :class:`~hetflow.executors.radical.configs.Descriptions` that may
    change the RP descriptions of the pilot, master and workers.
    yield_cpu: RP's own processes (bridges, components, agent, RAPTOR master, the worker's
    queue threads) run at the lowest CPU priority, so that the ranks never wait for them
    (:mod:`~hetflow.executors.radical.priority`); False leaves them as RP starts them.
    """

    #: The kernel is told when a task's first rank started (:meth:`_await_launch`).
    reports_launch = True

    def __init__(self, label: str = "radical", *, max_ranks: Optional[int] = None,
                 resource: Optional[str] = None, config_dir: Optional[str] = None,
                 pilot: Optional[dict] = None, sandbox_dir: Optional[str] = None,
                 keep_sandbox: bool = False, mode: str = "auto",
                 startup_timeout: float = 300.0, gpus=None,
                 slurm: Optional[dict] = None, provider: Optional[Provider] = None,
                 descriptions: Optional[Descriptions] = None, yield_cpu: bool = True):
        if (slurm is not None or provider is not None) and (resource is not None
                                                             or config_dir is not None):
            raise ConfigError("give slurm=/provider= (hetflow's resource configs) or "
                              "resource=/config_dir=, not both")
        # A site's own resource config says where its pilot runs: the provider is not asked.
        if resource not in (None, LOCAL_RESOURCE, SLURM_RESOURCE):
            provider = ThisMachine()
        place = runtime_place(slurm, provider, max_ranks, gpus)
        provider = place.provider
        configs.check(provider.placement(None))
        super().__init__(label, max_ranks=place.max_ranks, gpus=place.gpus)
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if (resource is None) != (config_dir is None) and resource not in (
                None, LOCAL_RESOURCE, SLURM_RESOURCE):
            raise ConfigError("an HPC resource needs both resource= (its label, e.g. "
                              "'mysite.slurm') and config_dir= (folder with resource_mysite.json)")
        if config_dir is not None and not os.path.isdir(config_dir):
            raise ConfigError(f"config_dir {config_dir!r} is not a directory")
        if not startup_timeout > 0:
            raise ConfigError(f"startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        #: Where the pilot runs (see hetflow.executors.providers).
        self.runs_on = provider
        self.resource = resource or configs.resource_label(provider.placement(None))
        self.sandbox_dir = sandbox_dir
        self.keep_sandbox = keep_sandbox
        self.mode = mode
        self.startup_timeout = startup_timeout
        descriptions = descriptions or Descriptions()
        #: Why each abandoned pilot start was abandoned and each worker replaced.
        self.restarts: List[str] = []
        self.pilot = Pilot(provider=provider, resource=self.resource, config_dir=config_dir,
                           options=dict(pilot or {}), startup_timeout=startup_timeout,
                           max_ranks=self.max_ranks, descriptions=descriptions,
                           restarts=self.restarts, yield_cpu=yield_cpu)
        self.worker = RaptorWorker(
            self.pilot, ranks=self.max_ranks, start_s=startup_timeout,
            ranks_per_node=self.pilot.place.slots_per_node,
            descriptions=descriptions, restarts=self.restarts, on_broken=self._worker_broken,
            stopping=lambda: self.stopping)
        self._running: Dict[str, Task] = {}         # RP uid -> task, under _running_lock
        self._in_rp: set = set()      # uids of RP tasks RP may still run (and end), same lock
        self._running_lock = threading.RLock()
        self._watchdog: Optional[threading.Thread] = None
        self._yielder: Optional[priority.Yielder] = None

    # ------------------------------------------------------------------ what users read
    @property
    def timings(self) -> Dict[str, float]:
        """Seconds each start-up / close phase took (session, pilot, raptor, close)."""
        return self.pilot.timings

    @property
    def slurm_job_id(self) -> Optional[str]:
        """The pilot's Slurm job id (with ``slurm=``, once the pilot is active)."""
        return self.pilot.slurm_job_id

    @property
    def worker_start_s(self) -> float:
        """Seconds a replacement RAPTOR worker may take to come up (default:
        ``startup_timeout``) before it is killed and started again."""
        return self.worker.start_s

    @worker_start_s.setter
    def worker_start_s(self, seconds: float) -> None:
        self.worker.start_s = seconds

    @property
    def base(self) -> str:
        """The dir holding the runtime's RP files (``sandbox_dir``, else in the run dir)."""
        return self.pilot.base

    @property
    def sandbox(self) -> str:
        """The pilot's sandbox (inside :attr:`base`)."""
        return self.pilot.sandbox

    # ------------------------------------------------------------------ kernel hooks
    def _start_runtime(self) -> None:
        base = os.path.abspath(self.sandbox_dir or self.run_root)
        raptor = self.mode != "exec"
        self.pilot.open(base, self._state_cb, self.worker if raptor else None)
        if self.pilot.yield_cpu:
            self._yielder = priority.Yielder(state=self._ranks_state,
                                             processes=lambda: session_processes(base))
            self._yielder.start()
        if raptor:
            self._watchdog = threading.Thread(target=self._watch_raptor, daemon=True,
                                              name=f"{self.label}-raptor-watch")
            self._watchdog.start()

    def _ranks_state(self) -> tuple:
        """``(busy, still)`` in one pass over the running tasks' dirs (``priority.Yielder``):
        busy, some task's ranks have started (pid files) and not all of them have written
        their outcome: only then may RP's daemons yield (its completion needs them); still,
        every task RP holds has all its ranks computing (started, alive, no outcome yet): RP
        has nothing to do until one ends, and its daemons may be stopped; or it holds none (not
        even a copy it will run for nothing, see ``_retire``) and the pilot is up, its RAPTOR
        worker too (not starting, not being recycled): RP is idle."""
        with self._running_lock:
            tasks = list(self._running.values())
            idle = not tasks and not self._in_rp
        if idle:
            return False, not self.stopping and (self.mode == "exec" or self.worker.up)
        busy, still = False, bool(tasks)
        for task in tasks:
            taskdir = task.handle.taskdir
            pids = taskdir.pids()
            ended = sum(taskdir.has_outcome(rank) for rank in pids)
            busy = busy or ended < len(pids)
            still = still and task.error is None and not ended \
                and len(pids) >= task.resources.ranks and all(map(alive, pids.values()))
        return busy, still

    def _handing(self):
        """RP's daemons run while RP is handed anything (see ``priority.Yielder.handing``)."""
        return self._yielder.handing() if self._yielder is not None else contextlib.nullcontext()

    def _stop_runtime(self) -> None:
        if self._yielder is not None:
            self._yielder.stop()
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
        self.pilot.close(self.worker if self.mode != "exec" else None)
        if not self.keep_sandbox and self.pilot.base:
            shutil.rmtree(self.pilot.base, ignore_errors=True)

    def _start(self, task: Task) -> None:
        """Submit ``task`` to RP (first run, or again after its worker was recycled)."""
        if task.handle is None:
            path = "exec" if self.mode == "exec" or (self.mode == "auto"
                                                     and (task.resources.walltime or
                                                          task.resources.gpus_per_rank)) \
                else "raptor"
            task.handle = _InPilot(path, TaskDir(os.path.join(self.pilot.task_root,
                                                              f"task-{task.id:06d}")))
        handle: _InPilot = task.handle
        if handle.path == "exec":
            handle.taskdir.create(task.payload, self.rank_resources(task),
                                  self.client_sys_path())
            description = self.pilot.executable_description(handle.taskdir, task.resources)
            submit = self.pilot.tmgr.submit_tasks
        else:
            if self.worker.broken is not None:
                raise self.worker.broken
            handle.taskdir.clear()          # a task run again must not see its last run's files
            private_dir(handle.taskdir.path)
            description = self.pilot.function_description(
                task.payload, handle.taskdir, task.resources.ranks, attempt=True,
                devices=self.rank_resources(task)["devices"],
                gpus_per_rank=task.resources.gpus_per_rank,
                cores_per_rank=task.resources.cores_per_rank)
            handle.taskdir.set_attempt(description["uid"])
            submit = self.pilot.raptor.submit_tasks
        # Known before RP is: its state callback may come before submit_tasks returns.
        handle.uid, handle.failed_seen = description["uid"], None
        with self._running_lock:
            self._running[handle.uid] = task
            self._in_rp.add(handle.uid)
        with self._handing():
            try:
                submit([description])
            except Exception as exc:
                with self._running_lock:
                    self._running.pop(handle.uid, None)
                    self._in_rp.discard(handle.uid)
                raise LaunchError(f"could not submit task {task.id} to RADICAL-Pilot: {exc}") from exc
            if task.error is not None:          # stopped while it was being submitted
                self._stop(task, task.error)
            elif task.times.launched != task.times.launched:     # NaN: not yet (not a re-run)
                self._await_launch(task)

    def _await_launch(self, task: Task) -> None:
        """Tell the kernel when the task's first rank started its function (the mtime of
        its pid file), so that its walltime counts from there."""
        if task.done or task.error is not None or task.times.launched == task.times.launched:
            return                   # (launched is NaN until stamped)
        taskdir = task.handle.taskdir
        started = []
        for rank in taskdir.pids():
            try:
                started.append(os.path.getmtime(taskdir.file(f"pid-{rank}")))
            except OSError:
                continue
        if started:
            self.launched(task, at=min(started))
        else:
            self.call_later(POLL_S, lambda: self._await_launch(task))

    def _stop(self, task: Task, error: Optional[BaseException]) -> None:
        """A RAPTOR task takes its worker down (see :meth:`_recycle`); an executable
        task is cancelled in RP and its ranks killed."""
        handle: Optional[_InPilot] = task.handle
        if handle is None:
            return           # not submitted yet: _start sees task.error and stops it
        with self._handing():
            if handle.path == "raptor" and not self.stopping:
                self._recycle(task)
                return
            with self._running_lock:
                if self._running.pop(handle.uid, None) is None:
                    return
            deaths = self._deaths(task) if task.error is None else None
            if handle.path == "exec":
                # Ranks RP's agent starts after the kill below (its cancel does not stop a
                # launch under way) find this and do not run.
                handle.taskdir.ask_to_stop()
                try:
                    self.pilot.tmgr.cancel_tasks(handle.uid)
                except Exception:  # noqa: BLE001 - best effort: its ranks are killed below
                    pass
                kill_launch_of(handle.taskdir.path)
            # (RAPTOR at shutdown: the worker goes with the session.)
            self.complete(task, handle.taskdir.outcomes(), deaths=deaths)

    # ------------------------------------------------------------------ completion
    def _state_cb(self, rp_task, state) -> None:
        """RP's report that one of its tasks ended (on RP's callback thread)."""
        if state not in FINAL:
            return
        with self._running_lock:
            self._in_rp.discard(rp_task.uid)
            task = self._running.get(rp_task.uid)
        if task is None:    # an abandoned copy (worker recycled, task stopped) or the probe
            return
        if task.handle.path == "raptor" and worker_lost(task.handle.taskdir):
            return   # RP saw the worker die first: the watchdog recycles it (not on RP's thread)
        with self._running_lock:
            if self._running.pop(rp_task.uid, None) is None:
                return
        if task.error is not None:
            self.finish(task)
            return
        try:
            exit_code = rp_task.exit_code
            if isinstance(exit_code, list):
                exit_code = max((c for c in exit_code if c is not None), default=None)
            evidence = dict(returncode=exit_code if state != "DONE" or exit_code else None,
                            stderr_tail=text(rp_task.stderr)[-4000:],
                            deaths=self._deaths(task, text(rp_task.stdout)))
        except BaseException as exc:  # noqa: BLE001 - the future must learn of it
            self.finish(task, error=exc)
            return
        self.complete(task, task.handle.taskdir.outcomes(), **evidence)
        if task.future.exception() is None and not self.keep_sandbox:
            task.handle.taskdir.remove()

    def _deaths(self, task: Task, launcher_output: str = "") -> Deaths:
        """How the task's ranks died, the cause first (``TaskDir.deaths``), with what RP
        saw plugged in: Hydra's report of an executable task, a RAPTOR worker's exits."""
        taskdir = task.handle.taskdir
        if task.handle.path == "exec":
            return taskdir.deaths(lambda: hydra_deaths(taskdir, launcher_output))
        return taskdir.deaths(lambda: self.worker.deaths(taskdir))

    # ------------------------------------------------------------------ watching RAPTOR tasks
    def _watch_raptor(self) -> None:
        """Recycle the worker under RAPTOR tasks it will never report (see
        :func:`task_verdict`), and let the worker check itself while it starts."""
        checked = 0.0
        while not self.stopping:
            time.sleep(POLL_S)  # a SIGKILLed rank must be seen before Hydra stops its peers
            if time.monotonic() - checked > _WORKER_CHECK_S:
                checked = time.monotonic()
                try:
                    self.worker.check()
                except Exception:  # the watchdog must live (logged)
                    logger.exception("watchdog could not check the RAPTOR worker")
            with self._running_lock:
                running = [(uid, t) for uid, t in self._running.items()
                           if t.handle.path == "raptor" and t.error is None]
            for uid, task in running:
                with self._running_lock:
                    if self._running.get(uid) is not task:
                        # Reported, or recycled (and maybe re-queued under a new uid) in this
                        # very pass: its task dir still names the dead worker's ranks.
                        continue
                try:
                    handle: _InPilot = task.handle
                    recycle, handle.failed_seen = task_verdict(
                        worker_lost=worker_lost(handle.taskdir),
                        rank_failed=any(not o.ok for o in handle.taskdir.outcomes().values()),
                        failed_seen=handle.failed_seen, now=time.monotonic())
                    if recycle:
                        self._recycle(task, uid)
                except Exception:  # the watchdog serves every task; it must live (logged)
                    logger.exception("watchdog could not check task %s; checking again", task.id)

    def _recycle(self, task: Task, uid: Optional[str] = None) -> None:
        """Kill the RAPTOR worker, fail ``task``, start a new worker, rerun its neighbours.

        ``uid``: the RP task the caller saw fail (default: the task's current one); if the
        task has moved on from it (re-queued), there is nothing to do. The verdict is the
        kernel's (cancel, walltime) or else the ranks' reports, read before the worker is
        killed (killing it ends every rank).
        """
        with self._handing():
            with self._running_lock:
                if self._running.pop(uid or task.handle.uid, None) is None:
                    return       # reported, or recycled by another thread, meanwhile
                neighbours = [t for t in self._running.values() if t.handle.path == "raptor"]
                for t in neighbours:
                    self._running.pop(t.handle.uid, None)
            # Copies still queued in the RAPTOR master must not run: not this task's (it ends
            # here), not its neighbours' (they run again under new uids).
            for t in [task] + neighbours:
                _retire(t.handle)
                if t.handle.taskdir.pids():     # it ran on the worker killed below: RP's
                    with self._running_lock:    # copy never ends (a queued one runs for nothing)
                        self._in_rp.discard(t.handle.uid)
            deaths = self._deaths(task) if task.error is None else None
            restart = not self.stopping     # (at shutdown the kernel fails the neighbours)
            error = self.worker.recycle([t.handle.taskdir.pids() for t in [task] + neighbours],
                                        restart)
            if restart:
                if error is not None:
                    for t in neighbours:
                        self.finish(t, error=ExecutorBroken(f"RAPTOR worker could not restart: "
                                                            f"{error}"))
                else:     # atomically: the freed slots go to the neighbours first
                    self.requeue(*neighbours, release=True)
            self.complete(task, task.handle.taskdir.outcomes(), deaths=deaths,
                          stderr_tail=_WORKER_LOST)

    def _worker_broken(self, error: ExecutorBroken) -> None:
        """The worker never came up: its RAPTOR tasks fail (later ones at ``_start``)."""
        with self._running_lock:
            victims = [t for t in self._running.values() if t.handle.path == "raptor"]
            for t in victims:
                self._running.pop(t.handle.uid, None)
        for t in victims:
            _retire(t.handle)
            self.finish(t, error=error)


def _retire(handle: _InPilot) -> None:
    """No copy of this RAPTOR task's current RP task may run from now on (see
    ``raptor_rank``); its task dir may be gone already."""
    if handle.path == "raptor":
        try:
            handle.taskdir.set_attempt("")
        except OSError:
            pass
