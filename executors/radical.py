"""RADICAL-Pilot: one pilot per runtime session, MPI tasks run inside it.

Two task paths, chosen per task (``mode="auto"``):

- **RAPTOR** (the Radical-Cylon way, the default): a RAPTOR master and one
  ``rp.raptor.MPIWorker`` of ``max_ranks`` ranks live for the whole session;
  each task is an MPI *function* task (``ranks=N``) whose per-rank function is
  hetflow's shared :func:`run_on_rank` on the sub-communicator the worker builds.
  No process is launched per task.
- **Executable**: an RP MPI executable task running
  ``python -m hetflow.executors._rank TASKDIR`` (a fresh ``mpiexec -n N``), used
  for tasks with a ``walltime``: it can be stopped alone, without touching the
  tasks that share the RAPTOR worker.

RP cannot time out or cancel a running function task, and a rank that dies or
raises while its peers wait in a collective takes the whole MPI worker with it.
hetflow therefore watches every RAPTOR task from the client (pid files and
outcomes in the task dir): on a crash, a stuck failure, a cancel or a walltime
it stops the worker, fails that task with the typed error, starts a new worker
and resubmits the other tasks that were running on it (they run again).
"""
from __future__ import annotations

import io
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib import resources as importlib_resources
from typing import Dict, List, Optional

import psutil

from hetflow.errors import (ConfigError, ExecutorBroken, LaunchError, TaskCancelled,
                            WalltimeExceeded)
from hetflow.executors._rank import (read_deaths, read_launcher_deaths, read_outcomes,
                                     read_rank_pids, task_deaths)
from hetflow.executors.base import HetflowExecutor, SlotScheduler, collect
from hetflow.executors.launch import MPILaunch, ended, kill_tree, tail
from hetflow.spec import Resources

logger = logging.getLogger(__name__)

#: Resource label of hetflow's own config for this machine (resource_hetflow.json).
LOCAL_RESOURCE = "hetflow.local"
MODES = ("auto", "raptor", "exec")
_FINAL = ("DONE", "FAILED", "CANCELED")
#: Seconds a RAPTOR task may sit with a failed rank before its peers count as stuck.
_FAILURE_GRACE_S = 1.0

_RP_ENV = ("RADICAL_CONFIG_USER_DIR", "RADICAL_PILOT_BASE", "RADICAL_BASE", "RADICAL_REPORT",
           "RADICAL_DEFAULT_IFACE", "RADICAL_LOG_LVL", "PATH")


@dataclass
class _Task:
    """Client-side record of one hetflow task inside the pilot."""

    task_id: int
    future: Future
    resources: Resources
    taskdir: str
    payload: bytes
    path: str                       # "raptor" or "exec"
    slots: list = field(default_factory=list)
    rp_task: object = None
    launched: float = float("nan")
    deadline: Optional[float] = None
    error: Optional[BaseException] = None   # decided by the client (cancel, walltime)
    failed_seen: Optional[float] = None


class RadicalExecutor(HetflowExecutor):
    """A Parsl executor running hetflow MPI apps inside one RADICAL-Pilot pilot.

    resource / config_dir: the RP resource label and a folder of ``resource_*.json``
    files (e.g. a Slurm site); default: hetflow's config for this machine.
    pilot: extra ``PilotDescription`` fields (``runtime``, ``queue``, ``project``, ...).
    sandbox_dir: where sessions, sandboxes and logs go (default: inside the runtime's
    run dir); removed at shutdown unless ``keep_sandbox``.
    mode: "auto" (RAPTOR; walltime tasks as executable tasks), "raptor" or "exec".
    """

    def __init__(self, label: str = "radical", *, max_ranks: Optional[int] = None,
                 resource: Optional[str] = None, config_dir: Optional[str] = None,
                 pilot: Optional[dict] = None, sandbox_dir: Optional[str] = None,
                 keep_sandbox: bool = False, mode: str = "auto",
                 startup_timeout: float = 300.0, gpus: Optional[int] = None):
        super().__init__(label=label, max_ranks=max_ranks, gpus=gpus)
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if (resource is None) != (config_dir is None) and resource not in (None, LOCAL_RESOURCE):
            raise ConfigError("an HPC resource needs both resource= (its label, e.g. "
                              "'mysite.slurm') and config_dir= (folder with resource_mysite.json)")
        if config_dir is not None and not os.path.isdir(config_dir):
            raise ConfigError(f"config_dir {config_dir!r} is not a directory")
        if not startup_timeout > 0:
            raise ConfigError(f"startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        self.resource = resource or LOCAL_RESOURCE
        self.config_dir = config_dir
        self.pilot_options = dict(pilot or {})
        self.sandbox_dir = sandbox_dir
        self.keep_sandbox = keep_sandbox
        self.mode = mode
        self.startup_timeout = startup_timeout
        #: Seconds each start-up / close phase took (session, pilot, raptor, close).
        self.timings: Dict[str, float] = {}
        self._cond = threading.Condition()
        self._scheduler = SlotScheduler(self.max_ranks)
        self._queued: Dict[Future, _Task] = {}
        self._running: Dict[str, _Task] = {}      # RP uid -> task
        self._uid_counter = itertools.count()
        self._stopping = False
        self._session = None
        self._saved_env: Dict[str, Optional[str]] = {}
        self._threads: List[threading.Thread] = []
        self._worker_root: Optional[int] = None   # pid of the RAPTOR worker's mpiexec
        self.rank_env: Dict[str, str] = {}          # environment RP tasks (the ranks) get

    # ------------------------------------------------------------------ start / stop
    def start(self) -> None:
        self.base = os.path.abspath(self.sandbox_dir or os.path.join(self.run_dir, "radical"))
        self.task_root = os.path.join(self.base, "tasks")
        os.makedirs(self.task_root, exist_ok=True)
        self.status_dir = os.path.join(self.base, "rank-status")
        os.makedirs(self.status_dir, exist_ok=True)
        self._set_environment()
        self._rp_before = _rp_zmq_objects()
        try:
            self._start_pilot()
        except BaseException:
            self._close_session()
            raise
        for target in (self._dispatch, self._watch):
            thread = threading.Thread(target=target, name=f"{self.label}-{target.__name__}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _set_environment(self) -> None:
        """RP reads its dirs and interface from the environment: point them at the run dir."""
        config_root = os.path.join(self.base, "config")
        configs = os.path.join(config_root, ".radical", "pilot", "configs")
        os.makedirs(configs, exist_ok=True)
        if self.config_dir:
            for name in os.listdir(self.config_dir):
                if name.startswith("resource_") and name.endswith(".json"):
                    shutil.copy(os.path.join(self.config_dir, name), configs)
        if self.resource == LOCAL_RESOURCE:
            with open(os.path.join(configs, "resource_hetflow.json"), "w") as fh:
                json.dump(local_resource_config(self.pilot_cores()), fh, indent=1)
        env = {"RADICAL_CONFIG_USER_DIR": config_root,
               "RADICAL_PILOT_BASE": os.path.join(self.base, "sessions"),
               "RADICAL_BASE": os.path.join(self.base, "radical"),
               "RADICAL_REPORT": "FALSE",
               "RADICAL_DEFAULT_IFACE": "lo" if self.resource == LOCAL_RESOURCE
               else os.environ.get("RADICAL_DEFAULT_IFACE", ""),
               "RADICAL_LOG_LVL": os.environ.get("RADICAL_LOG_LVL", "WARNING"),
               # RP leaves temp files behind (the pilot launcher's 'rp.agent_cfg.*', the
               # agent's '<TMPDIR>/rp.session.*'): its processes get a TMPDIR inside the
               # sandbox, removed with it; the ranks get the client's back (rank_env).
               "TMPDIR": os.path.join(self.base, "tmp"),
               # RP starts its bridges by command name: the venv's bin must be on PATH.
               "PATH": os.pathsep.join([os.path.dirname(sys.executable),
                                        os.environ.get("PATH", "")])}
        os.makedirs(env["TMPDIR"], exist_ok=True)
        # The client's own temp dir is fixed before TMPDIR changes (tempfile caches it).
        self.rank_env = {"TMPDIR": tempfile.gettempdir()}
        for key, value in env.items():
            self._saved_env[key] = os.environ.get(key)
            if value:
                os.environ[key] = value
        os.makedirs(env["RADICAL_PILOT_BASE"], exist_ok=True)

    def pilot_cores(self) -> int:
        """Cores the local pilot claims: worker + master + room for executable tasks.

        The client-side scheduler keeps real use within ``max_ranks``; the pilot
        only needs enough (fake) cores that RP never blocks a task hetflow admitted.
        """
        return 2 * self.max_ranks + 1

    def _start_pilot(self) -> None:
        rp = import_rp()

        t0 = time.time()
        self._session = rp.Session()
        self.timings["session_s"] = time.time() - t0
        self._pmgr = rp.PilotManager(session=self._session)
        self._tmgr = rp.TaskManager(session=self._session)
        self._tmgr.register_callback(self._state_cb)
        description = {"resource": self.resource, "runtime": 24 * 60,
                       "sandbox": os.path.join(self.base, "sandbox")}
        if self.resource == LOCAL_RESOURCE:
            description["cores"] = self.pilot_cores()
        description.update(self.pilot_options)
        t0 = time.time()
        pilot = self._pmgr.submit_pilots([rp.PilotDescription(description)])[0]
        self._tmgr.add_pilots(pilot)
        pilot.wait([rp.PMGR_ACTIVE, rp.FAILED, rp.CANCELED], timeout=self.startup_timeout)
        if pilot.state != rp.PMGR_ACTIVE:
            raise LaunchError(f"RADICAL-Pilot pilot on {self.resource!r} is {pilot.state} after "
                              f"{time.time() - t0:.0f} s (startup_timeout={self.startup_timeout})",
                              logs=[os.path.join(self.base, "sandbox")])
        self._pilot = pilot
        self.timings["pilot_s"] = time.time() - t0
        if self.mode != "exec":
            t0 = time.time()
            self._raptor = pilot.submit_raptors(rp.TaskDescription({"mode": rp.RAPTOR_MASTER}))[0]
            self._start_worker()
            self._probe()
            self.timings["raptor_s"] = time.time() - t0

    def _start_worker(self) -> None:
        rp = import_rp()

        self._raptor.submit_workers(rp.TaskDescription(
            {"mode": rp.RAPTOR_WORKER, "ranks": self.max_ranks, "raptor_class": "MPIWorker",
             "environment": dict(self.rank_env),
             # A rank killed from outside leaves no evidence of its own; RP's launch script
             # has its status ($RP_RET, after `wait` on $RP_RANK_PID, the rank's pid).
             "post_exec": [f"echo $RP_RET > {self.status_dir}/exit-$RP_RANK_PID"]}))

    def _probe(self) -> None:
        """Run one no-op task on the whole worker: it is up, and its mpiexec is known."""
        rp = import_rp()

        taskdir = os.path.join(self.task_root, f"probe-{time.time_ns()}")
        os.makedirs(taskdir)
        payload = self.payload(-1, _noop, (), {}, Resources(ranks=self.max_ranks))
        td = self._function_description(payload, taskdir, self.max_ranks)
        task = self._raptor.submit_tasks([td])[0]
        task.wait([rp.DONE, rp.FAILED, rp.CANCELED], timeout=self.startup_timeout)
        if task.state != rp.DONE:
            raise LaunchError(f"RAPTOR MPI worker of {self.max_ranks} ranks did not run a task "
                              f"(state {task.state}): {task.stderr}",
                              logs=[os.path.join(self.base, "sandbox")])
        self._worker_root = _launcher_of(read_rank_pids(taskdir))
        shutil.rmtree(taskdir, ignore_errors=True)

    def shutdown(self) -> None:
        with self._cond:
            queued = self.drain_queue(self._scheduler, self._cond)
            running = list(self._running.values())
            self._running.clear()
        self.fail_unfinished((task.task_id, task.future) for task in queued + running)
        for thread in self._threads:
            thread.join(timeout=10)
        self._close_session()
        if not self.keep_sandbox:
            shutil.rmtree(self.base, ignore_errors=True)
        super().shutdown()

    def _close_session(self) -> None:
        t0 = time.time()
        me = psutil.Process()
        if self._worker_root is not None:
            kill_tree(self._worker_root)   # don't wait for RP to wind the worker down
        if self._session is not None:
            try:
                self._pmgr.cancel_pilots()
            except Exception:
                pass
            try:
                self._session.close(download=False)
            except Exception:
                pass
            self._session = None
            release_client_handles(self.base, getattr(self, "_rp_before", set()))
        # Whatever RP left running (bridges, agent, launchers) is ended here.
        for proc in me.children(recursive=True) + session_processes(self.base):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    kill_tree(proc.pid)
            except psutil.NoSuchProcess:
                pass
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()
        self.timings["close_s"] = time.time() - t0

    # ------------------------------------------------------------------ submit
    def submit(self, func, resource_specification, *args, **kwargs) -> Future:
        if self._stopping:
            raise ExecutorBroken(f"executor {self.label!r} is shut down")
        task_id, resources, future = self.new_task(resource_specification)
        taskdir = os.path.join(self.task_root, f"task-{task_id:06d}")
        payload = self.payload(task_id, func, args, kwargs, resources)
        path = "exec" if self.mode == "exec" or (self.mode == "auto" and resources.walltime) \
            else "raptor"
        if path == "exec":
            # The launch-per-task layout the shared rank runner reads (task.pkl, meta.json).
            MPILaunch(taskdir, payload, resources, self.client_sys_path(), [], {})
        else:
            os.makedirs(taskdir, exist_ok=True)
        task = _Task(task_id=task_id, future=future, resources=resources, taskdir=taskdir,
                     payload=payload, path=path)
        with self._cond:
            self._queued[future] = task
            self._scheduler.push(task, resources.cores)
            self._cond.notify()
        return future

    def _next_uid(self) -> str:
        """A uid for the next RP task, so RP does not draw one itself.

        RP names a task without a uid through ``ru.generate_id('task.%(item_counter)06d')``,
        which bumps a counter file and closes that descriptor twice (radical.utils 1.103,
        ``ids._read_file_counter``). The second close can hit a descriptor another
        thread has just opened: one load-test run lost a submission to EBADF that way.
        """
        return f"hetflow.{next(self._uid_counter):06d}"

    def _function_description(self, payload: bytes, taskdir: str, ranks: int):
        from hetflow.executors._radical_rank import raptor_rank
        rp = import_rp()

        # The worker puts the task's communicator where the first argument is None.
        return rp.TaskDescription({
            "uid": self._next_uid(), "mode": rp.TASK_FUNCTION, "ranks": ranks,
            "function": rp.PythonTask(raptor_rank, [None, payload, taskdir,
                                                   self.client_sys_path()], {})})

    def _executable_description(self, task: _Task):
        rp = import_rp()

        return rp.TaskDescription({
            "uid": self._next_uid(), "mode": rp.TASK_EXECUTABLE, "ranks": task.resources.ranks,
            "cores_per_rank": task.resources.cores_per_rank,
            "executable": sys.executable,
            "arguments": ["-m", "hetflow.executors._rank", task.taskdir],
            "environment": dict(self.rank_env)})

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                ready = self.next_ready(self._scheduler, self._cond)
                if ready is None:
                    return
                for task, slots in ready:
                    self._queued.pop(task.future, None)
                    task.slots = slots
            self._submit_to_rp([task for task, _ in ready])

    def _submit_to_rp(self, tasks: List[_Task]) -> None:
        functions = [t for t in tasks if t.path == "raptor"]
        executables = [t for t in tasks if t.path == "exec"]
        try:
            submitted = []
            if functions:
                tds = [self._function_description(t.payload, t.taskdir, t.resources.ranks)
                       for t in functions]
                submitted += list(zip(functions, self._raptor.submit_tasks(tds)))
            if executables:
                tds = [self._executable_description(t) for t in executables]
                submitted += list(zip(executables, self._tmgr.submit_tasks(tds)))
        except BaseException as exc:  # noqa: BLE001 - the futures must learn about it
            for task in tasks:
                self._finish(task, error=LaunchError(f"could not submit task {task.task_id} "
                                                     f"to RADICAL-Pilot: {exc}"))
            return
        now = time.time()
        with self._cond:
            for task, rp_task in submitted:
                task.rp_task = rp_task
                task.launched = now
                if task.resources.walltime:
                    task.deadline = now + task.resources.walltime
                self._running[rp_task.uid] = task
            finished = [(t, r) for t, r in submitted if r.state in _FINAL]
        for task, rp_task in finished:   # a callback may have fired before the record existed
            self._state_cb(rp_task, rp_task.state)

    # ------------------------------------------------------------------ completion
    def _state_cb(self, rp_task, state) -> None:
        if state not in _FINAL:
            return
        with self._cond:
            task = self._running.pop(rp_task.uid, None)
        if task is None:    # an abandoned copy (worker recycled) or a probe
            return
        if task.error is not None:
            self._finish(task, error=task.error)
            return
        try:
            stderr = rp_task.stderr
            if isinstance(stderr, list):
                stderr = "\n".join(s or "" for s in stderr)
            exit_code = rp_task.exit_code
            if isinstance(exit_code, list):
                exit_code = max((c for c in exit_code if c is not None), default=None)
            value = collect(read_outcomes(task.taskdir), task.resources, task_id=task.task_id,
                            returncode=exit_code if state != "DONE" or exit_code else None,
                            stderr_tail=(stderr or "")[-4000:], executor=self.label,
                            deaths=task_deaths(task.taskdir))
        except BaseException as exc:  # noqa: BLE001
            self._finish(task, error=exc)
            return
        self._finish(task, value=value)

    def _finish(self, task: _Task, value=None, error: Optional[BaseException] = None) -> None:
        with self._cond:
            self._scheduler.release(task.slots)
            task.slots = []
            self._cond.notify()
        stamps = {"launched": task.launched}
        try:
            root = read_outcomes(task.taskdir).get(0)
        except OSError:
            root = None
        if root is not None:
            stamps.update(started=root.started, finished=root.finished,
                          launched=min(task.launched, root.started))
        if error is None and not self.keep_sandbox:
            shutil.rmtree(task.taskdir, ignore_errors=True)
        self.deliver(task.future, value, error, stamps)

    # ------------------------------------------------------------------ watchdog
    def _watch(self) -> None:
        """Enforce walltimes and notice RAPTOR tasks the worker will never report."""
        while not self._stopping:
            time.sleep(0.02)  # a SIGKILLed rank must be seen before Hydra stops its peers
            now = time.time()
            with self._cond:
                running = list(self._running.items())
            for uid, task in running:
                if task.error is not None:
                    continue
                try:
                    if task.deadline is not None and now > task.deadline:
                        self._stop(task, WalltimeExceeded(
                            f"task {task.task_id} ({self.label}) exceeded its walltime of "
                            f"{task.resources.walltime} s and was stopped",
                            walltime=task.resources.walltime, task_id=task.task_id))
                    elif task.path == "raptor":
                        self._check_raptor(task, now)
                except Exception:  # noqa: BLE001 - the watchdog serves every task; it must live
                    logger.exception("watchdog could not check task %s (%s); checking again",
                                     task.task_id, uid)

    def _check_raptor(self, task: _Task, now: float) -> None:
        pids = read_rank_pids(task.taskdir)
        dead = [rank for rank, pid in pids.items() if ended(pid)]
        failed = any(not o.ok for o in _safe_outcomes(task.taskdir).values())
        if failed and task.failed_seen is None:
            task.failed_seen = now
        stuck = failed and now - task.failed_seen > _FAILURE_GRACE_S
        if dead or stuck:
            value, error = None, None
            deaths = read_deaths(task.taskdir)
            if dead and not deaths:
                deaths = self._launcher_deaths(task, dead)
            try:
                value = collect(_safe_outcomes(task.taskdir), task.resources,
                                task_id=task.task_id, executor=self.label,
                                deaths=deaths,
                                stderr_tail="the RAPTOR MPI worker running this task was lost")
            except BaseException as exc:  # noqa: BLE001 - this is the task's verdict
                error = exc
            self._recycle(task, error, value)

    def _launcher_deaths(self, task: _Task, dead: List[int], wait_s: float = 3.0) -> dict:
        """Name how ranks that vanished without evidence (SIGKILL) died.

        The worker's Hydra prints "PID n ... EXIT CODE: c ... (signal s)" to the worker's
        stdout in the pilot sandbox once it has cleaned up; the task's ``pid-<rank>``
        files map that pid back to a rank. Without that report the vanished ranks are
        still the ones named, with what is known.
        """
        deadline = time.time() + wait_s
        sandbox = os.path.join(self.base, "sandbox")
        pids = read_rank_pids(task.taskdir)
        while True:
            found = rank_exit_statuses(self.status_dir, {r: pids[r] for r in dead if r in pids})
            if found:
                return found
            for root, _, files in os.walk(sandbox):
                for name in files:
                    if not name.endswith(".out"):
                        continue
                    found = read_launcher_deaths(task.taskdir, tail(os.path.join(root, name),
                                                                    20000))
                    if found:
                        return found
            if time.time() > deadline:
                return {rank: ("vanished (killed from outside; no exit status was visible)", "")
                        for rank in dead}
            time.sleep(0.2)

    def _stop(self, task: _Task, error: BaseException) -> None:
        """Stop one running task with ``error`` (walltime or cancel)."""
        if task.path == "exec":
            task.error = error
            try:
                self._tmgr.cancel_tasks(task.rp_task.uid)
            except Exception:
                pass
            # RP reports CANCELED a moment later; don't let the caller wait on it.
            with self._cond:
                self._running.pop(task.rp_task.uid, None)
            kill_tree_of(task.taskdir)
            self._finish(task, error=error)
        else:
            self._recycle(task, error)

    def _recycle(self, task: _Task, error: Optional[BaseException], value=None) -> None:
        """Stop the RAPTOR worker, fail ``task``, restart the worker, rerun its neighbours."""
        with self._cond:
            if self._running.pop(task.rp_task.uid, None) is None:
                return
            neighbours = [t for uid, t in self._running.items() if t.path == "raptor"]
            for t in neighbours:
                self._running.pop(t.rp_task.uid, None)
        root = _launcher_of(read_rank_pids(task.taskdir)) or self._worker_root
        if root is not None:
            kill_tree(root)
        self._finish(task, value=value, error=error)
        try:
            self._start_worker()
        except BaseException as exc:  # noqa: BLE001
            for t in neighbours:
                self._finish(t, error=ExecutorBroken(f"RAPTOR worker could not restart: {exc}"))
            return
        for t in neighbours:
            for name in os.listdir(t.taskdir):
                os.remove(os.path.join(t.taskdir, name))
        self._worker_root = None
        if neighbours:
            self._submit_to_rp(neighbours)

    def cancel(self, future: Future) -> bool:
        """Cancel a queued or running task: its future fails with TaskCancelled."""
        with self._cond:
            task = self._queued.pop(future, None)
            if task is not None:
                self._scheduler.remove(task)
        if task is not None:
            self.deliver(future, error=TaskCancelled(
                f"task {task.task_id} ({self.label}) was cancelled before it started"))
            return True
        with self._cond:
            running = [t for t in self._running.values() if t.future is future]
        if not running:
            return False
        self._stop(running[0], TaskCancelled(
            f"task {running[0].task_id} ({self.label}) was cancelled while running"))
        return True


# ---------------------------------------------------------------------- helpers
def import_rp():
    """``radical.pilot``, without its warning that ``logging`` was imported first.

    radical.utils patches ``logging`` for fork safety and warns when it comes too
    late; hetflow never forks with logging locks held, and the warning would fail
    any program (or test suite) that turns warnings into errors.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import radical.pilot as rp
    return rp


def session_processes(base: str) -> List[psutil.Process]:
    """Live processes started for the RP session whose files live under ``base``.

    RP daemonises its bridges and agent (their parent is init), so they are not
    the client's children: they are recognised by working directory or by the
    ``RADICAL_PILOT_BASE`` in their environment.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cwd", "status"]):
        try:
            if proc.info["pid"] == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cwd = proc.info["cwd"] or ""
            if cwd == base or cwd.startswith(base + os.sep) or \
                    (proc.environ().get("RADICAL_PILOT_BASE") or "").startswith(base):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _rp_zmq_objects() -> set:
    """Ids of the live radical.utils.zmq objects (publishers, queues, registry clients)."""
    import gc

    return {id(obj) for obj in gc.get_objects() if _is_rp_zmq(obj)}


def _is_rp_zmq(obj) -> bool:
    module = type(obj).__dict__.get("__module__") if not isinstance(obj, type) else None
    return isinstance(module, str) and module.startswith("radical.utils.zmq")


def release_client_handles(base: str, before: set) -> None:
    """Close what RP's client keeps open after ``session.close()`` (~80 descriptors).

    RP 1.103 leaves, per session: its ZMQ publishers, subscribers, queues and
    registry clients with their sockets and private contexts ("rely on GC for
    destruction", but the objects stay referenced); log handlers and profilers
    writing into the session dir; and one descriptor per ``ru.write_json`` call,
    which discards the fd ``tempfile.mkstemp`` returns. Only what this session made
    is closed: zmq objects that did not exist before it started, files under ``base``.
    """
    import gc

    import zmq

    shared = zmq.Context._instance            # RP's subscribers share it; it stays
    for obj in gc.get_objects():
        if id(obj) in before or not _is_rp_zmq(obj):
            continue
        values = []
        for value in getattr(obj, "__dict__", {}).values():
            values.extend(value if isinstance(value, (list, tuple)) else [value])
        for value in values:
            if isinstance(value, zmq.Socket) and not value.closed:
                value.close(linger=0)
        for value in values:
            if isinstance(value, zmq.Context) and value is not shared and not value.closed:
                value.destroy(linger=0)
    prefix = base + os.sep
    loggers = [logging.getLogger()] + [each for each in
                                       logging.Logger.manager.loggerDict.values()
                                       if isinstance(each, logging.Logger)]
    for each in loggers:
        for handler in list(each.handlers):
            if getattr(handler, "baseFilename", "").startswith(prefix):
                each.removeHandler(handler)
                handler.close()
    try:
        from radical.utils import profile
        for entry in list(profile._profilers):
            profiler, fname = entry
            if str(fname).startswith(prefix):
                profiler.close()
                profile._profilers.remove(entry)
    except (ImportError, AttributeError, ValueError):
        pass
    # Contexts RP dropped without destroying sit in reference cycles: collect them now.
    gc.collect()
    # Descriptors into the session dir that no Python file object owns: write_json's.
    owned = {obj.fileno() for obj in gc.get_objects()
             if isinstance(obj, io.FileIO) and not obj.closed}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix) and fd not in owned:
            try:
                os.close(fd)
            except OSError:
                pass


def _noop():
    return None


def rank_exit_statuses(status_dir: str, pids: Dict[int, int]) -> dict:
    """``{rank: (description, "")}`` for worker ranks whose exit status RP's launch
    script recorded (see ``RadicalExecutor._start_worker``): ``128 + s`` is bash's
    status of a process killed by signal ``s``."""
    deaths = {}
    for rank, pid in pids.items():
        try:
            with open(os.path.join(status_dir, f"exit-{pid}")) as fh:
                code = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        deaths[rank] = (f"was killed by signal {code - 128}" if code > 128
                        else f"exited with code {code}", "")
    return dict(sorted(deaths.items()))


def _safe_outcomes(taskdir: str) -> dict:
    try:
        return read_outcomes(taskdir)
    except (OSError, EOFError):
        return {}


def _launcher_of(pids: Dict[int, int]) -> Optional[int]:
    """The pid of the ``mpiexec`` that started these ranks (the RAPTOR worker's)."""
    for pid in pids.values():
        try:
            for parent in psutil.Process(pid).parents():
                if parent.name().startswith("mpiexec"):
                    return parent.pid
        except psutil.NoSuchProcess:
            continue
    return None


def kill_tree_of(taskdir: str) -> None:
    """SIGKILL the ranks of an executable task (their command line ends in ``taskdir``)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (proc.info["cmdline"] or [""])[-1] == taskdir:
                root = _launcher_of({0: proc.pid}) or proc.pid
                kill_tree(root)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def local_resource_config(cores: int) -> dict:
    """hetflow's ``local`` resource: this machine, ``cores`` slots, the venv's MPI."""
    text = importlib_resources.files("hetflow.executors").joinpath(
        "resource_configs/resource_hetflow.json").read_text()
    config = json.loads(text)
    config["local"]["cores_per_node"] = cores
    config["local"]["virtenv"] = sys.prefix
    # RP probes its launcher in the pilot's original environment (before the venv is
    # activated): put the venv's bin first so it finds, and launches with, the venv's MPI.
    bindir = os.path.dirname(sys.executable)
    for method in ("MPIEXEC", "FORK"):
        config["local"]["launch_methods"][method] = {
            "pre_exec_cached": [f"export PATH={bindir}:$PATH"]}
    return config
