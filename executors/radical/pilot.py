"""The pilot's life: RP's environment, session and pilot, its start (with the stall
policy: a start that stalls inside RP is abandoned and started once more), the RAPTOR
master, the start-up probe, and the close that leaves nothing behind.
"""
from __future__ import annotations

import glob
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

from hetflow._private import tighten
from hetflow._progress import waiting
from hetflow.errors import LaunchError
from hetflow.executors._forensics import kill_tree
from hetflow.executors.payload import TaskPayload
from hetflow.executors.radical.rank import noop
from hetflow.executors.radical.hygiene import (client_children, end_leftovers, import_rp,
                                           release_client_handles, restore_environment,
                                           rp_zmq_objects, session_processes, set_environment,
                                           started_during)
from hetflow.executors.launch import with_malloc_thp
from hetflow.executors.radical import configs, priority
from hetflow.executors.radical.configs import LOCAL_RESOURCE, SLURM_RESOURCE, Descriptions
from hetflow.executors.taskdir import TaskDir, private_dir
from hetflow.spec import Resources

logger = logging.getLogger(__name__)

FINAL = ("DONE", "FAILED", "CANCELED")
#: States of a task the agent holds but has not placed yet.
_UNPLACED = ("AGENT_STAGING_INPUT_PENDING", "AGENT_STAGING_INPUT", "AGENT_SCHEDULING_PENDING",
             "AGENT_SCHEDULING")
#: A RAPTOR master the agent has not placed this long after it was submitted: the agent's
#: scheduler is stuck, and the pilot is started once more.
SCHEDULER_STUCK_S = 60.0
#: An agent up this long (its ``agent_0.prof`` is there: the agent opens it after starting
#: its components, ~2 s before it reports itself active) without reporting ``PMGR_ACTIVE``
#: has stalled in its start-up, and the pilot is started once more.
AGENT_STALL_S = 60.0
#: Seconds to wait for RP to cancel the pilot at close (it takes ~6 s; an agent that never
#: came up never answers, and its processes are then killed).
CANCEL_WAIT_S = 60


class StartStalled(LaunchError):
    """A pilot start that stalled inside RP: a new pilot is started (once per kind)."""


class SchedulerStuck(StartStalled):
    """The pilot's agent never placed the RAPTOR master."""


class AgentStalled(StartStalled):
    """The pilot's agent came up but never reported itself active."""


def probe_payload(ranks: int) -> bytes:
    """The start-up probe's payload: a no-op on ``ranks`` ranks, whose function every rank
    finds in a module it imports anyway (see :func:`~hetflow.executors.radical.rank.noop`)."""
    return TaskPayload(task_id=-1, func=noop, args=(), kwargs={},
                       resources=Resources(ranks=ranks)).dumps()


def text(output) -> str:
    """RP's stdout/stderr of a task: one string, or one per rank."""
    if isinstance(output, list):
        return "\n".join(s or "" for s in output)
    return output or ""


class Pilot:
    """One RP session with one pilot (and its RAPTOR master) for a runtime's life.

    ``provider`` says where the pilot runs (see :mod:`hetflow.executors.providers`);
    ``restarts`` is the runtime's record of abandoned starts and replaced workers.
    """

    def __init__(self, *, provider, resource: str, config_dir: Optional[str], options: dict,
                 startup_timeout: float, max_ranks: int, descriptions: Descriptions,
                 restarts: List[str], yield_cpu: bool = True):
        self.provider = provider
        #: Where the pilot runs, in no runtime's terms (translated by .configs).
        self.place = provider.placement(max_ranks)
        self.resource = resource
        self.config_dir = config_dir
        self.options = options
        self.startup_timeout = startup_timeout
        self.max_ranks = max_ranks
        self.descriptions = descriptions
        self.restarts = restarts
        #: RP's own processes run at the lowest CPU priority (see .priority).
        self.yield_cpu = yield_cpu
        #: Seconds each start-up / close phase took (session, pilot, raptor, close).
        self.timings: Dict[str, float] = {}
        self.rank_env: Dict[str, str] = {}      # environment RP tasks (the ranks) get
        self.saved_env: Dict[str, Optional[str]] = {}
        self.uid_counter = itertools.count()
        self.session = self.pmgr = self.tmgr = self.raptor = None
        self.slurm_job_id: Optional[str] = None
        self.base = self.sandbox = self.task_root = self.status_dir = ""   # set by open()
        self._stalls: List[type] = []            # the StartStalled kinds restarted
        self._rp_before: set = set()
        self._rp_children: list = []              # the client's children RP started
        self._task_sandboxes: Dict[str, str] = {}

    # ------------------------------------------------------------------ start
    def open(self, base: str, on_state: Callable, worker=None) -> None:
        """Start the session, the pilot and (given a ``worker``) RAPTOR, in dirs under
        ``base``. Each stall inside RP's start-up (docs/runtimes/radical.md: the agent's
        scheduler never takes a task, or the agent never reports itself active) is met
        once by a new pilot, whose processes are new; the same stall twice is the error."""
        self.base = base
        self.task_root = private_dir(os.path.join(base, "tasks"))
        self.status_dir = private_dir(os.path.join(base, "rank-status"))
        self.sandbox = os.path.join(base, "sandbox")   # the pilot's (RP makes it)
        self.set_environment()
        self._rp_before = rp_zmq_objects()
        try:
            while True:
                try:
                    self._start(on_state, worker)
                    return
                except StartStalled as exc:
                    if type(exc) in self._stalls:
                        raise
                    self._stalls.append(type(exc))
                    why = str(exc).splitlines()[0]
                    logger.warning("%s; starting a new pilot (once)", why)
                    self.restarts.append(why)
                    self.close(worker, stalled=isinstance(exc, AgentStalled))
                    self.set_environment()
                    self._rp_before = rp_zmq_objects()
        except BaseException:
            self.close(worker)
            raise

    def set_environment(self) -> None:
        """RP reads its dirs and interface from the environment: point them at ``base``."""
        config_root = os.path.join(self.base, "config")
        configs_dir = os.path.join(config_root, ".radical", "pilot", "configs")
        os.makedirs(configs_dir, exist_ok=True)
        if self.config_dir:
            for name in os.listdir(self.config_dir):
                if name.startswith("resource_") and name.endswith(".json"):
                    shutil.copy(os.path.join(self.config_dir, name), configs_dir)
        tmp = os.path.join(self.base, "tmp")
        if self.resource in (LOCAL_RESOURCE, SLURM_RESOURCE):
            config = configs.resource_config(self.place, self.cores(), tmp)
            with open(os.path.join(configs_dir, "resource_hetflow.json"), "w") as fh:
                json.dump(config, fh, indent=1)
        env = {"RADICAL_CONFIG_USER_DIR": config_root,
               "RADICAL_PILOT_BASE": os.path.join(self.base, "sessions"),
               "RADICAL_BASE": os.path.join(self.base, "radical"),
               "RADICAL_REPORT": "FALSE",
               # The local pilot's agent runs here; a Slurm job's on a node that must
               # reach the client (loopback on the test cluster, whose nodes are this host).
               "RADICAL_DEFAULT_IFACE": "lo" if self.resource == LOCAL_RESOURCE
               else os.environ.get("RADICAL_DEFAULT_IFACE",
                                   "lo" if self.resource == SLURM_RESOURCE else ""),
               "RADICAL_LOG_LVL": os.environ.get("RADICAL_LOG_LVL", "WARNING"),
               # RP leaves temp files behind (the pilot launcher's 'rp.agent_cfg.*', the
               # agent's '<TMPDIR>/rp.session.*'): its processes get a TMPDIR inside the
               # sandbox, removed with it; the ranks get the client's back (rank_env).
               "TMPDIR": tmp,
               # RP starts its bridges by command name: the venv's bin must be on PATH
               # (after hetflow's starters of them at the lowest priority, see .priority).
               "PATH": os.pathsep.join(
                   ([priority.write_shims(os.path.join(self.base, "bin"))]
                    if self.yield_cpu else [])
                   + [os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               **self.place.env}
        os.makedirs(tmp, exist_ok=True)
        # The client's own temp dir is fixed before TMPDIR changes (tempfile caches it).
        self.rank_env = {"TMPDIR": tempfile.gettempdir()}
        tunables = with_malloc_thp(dict(os.environ)).get("GLIBC_TUNABLES")
        if tunables:          # (the user's, with malloc's huge pages unless they chose)
            self.rank_env["GLIBC_TUNABLES"] = tunables
        self.saved_env = set_environment(env)
        os.makedirs(env["RADICAL_PILOT_BASE"], exist_ok=True)

    def cores(self) -> int:
        """Cores the pilot claims per node: worker + master + room for executable tasks.

        The kernel's scheduler keeps real use within ``max_ranks``; the pilot only needs
        enough (fake) cores that RP never blocks a task hetflow admitted. On several nodes
        that is per node: the worker places its ranks node by node (``ranks_per_node``),
        the rest is room."""
        per_node = self.place.slots_per_node
        if per_node is None:
            return 2 * self.max_ranks + 1
        return 1 + per_node + self.max_ranks

    def _start(self, on_state: Callable, worker) -> None:
        before = client_children()
        try:
            self._start_session_and_pilot(on_state, worker)
        finally:
            # RP's own processes among the client's children, ended at close (and only they)
            self._rp_children += started_during(before)

    def _start_session_and_pilot(self, on_state: Callable, worker) -> None:
        rp = import_rp()

        t0 = time.time()
        with waiting("the RADICAL-Pilot session"):
            self.session = rp.Session()
        self.timings["session_s"] = time.time() - t0
        self.pmgr = rp.PilotManager(session=self.session)
        self.tmgr = rp.TaskManager(session=self.session)
        self.tmgr.register_callback(on_state)
        # exit_on_error=False: RP's default answers a failed pilot by cancelling the
        # client's main thread (SIGTERM); hetflow fails the tasks with typed errors instead.
        description = {"resource": self.resource, "runtime": 24 * 60,
                       "sandbox": self.sandbox, "exit_on_error": False}
        if self.resource in (LOCAL_RESOURCE, SLURM_RESOURCE):
            description.update(configs.pilot_fields(self.place, self.cores()))
        description.update(self.options)
        t0 = time.time()
        pilot = self.pmgr.submit_pilots([rp.PilotDescription(
            self.descriptions.pilot(description))])[0]
        self.tmgr.add_pilots(pilot)
        with waiting("the pilot"):
            self._wait_active(pilot, t0)
        if pilot.state != rp.PMGR_ACTIVE:
            raise LaunchError(f"RADICAL-Pilot pilot on {self.resource!r} is {pilot.state} after "
                              f"{time.time() - t0:.0f} s (startup_timeout={self.startup_timeout})",
                              logs=[self.sandbox])
        self.slurm_job_id = (self.provider.job_in(self.sandbox)
                             if self.place.job is not None else None)
        # RP's bootstrap chmods its scripts 0755 (all else it makes is owner-only: it runs
        # with the runtime's umask 077, see hetflow._private): hetflow keeps them private.
        tighten(self.sandbox)
        if self.yield_cpu and self.resource == LOCAL_RESOURCE:
            priority.lower_agent(session_processes(self.sandbox))
        self.timings["pilot_s"] = time.time() - t0
        if worker is not None:
            t0 = time.time()
            self.raptor = pilot.submit_raptors(rp.TaskDescription(self.descriptions.master(
                {"mode": rp.RAPTOR_MASTER, **configs.master_description(self.yield_cpu)})))[0]
            worker.start()
            self._probe(worker)
            self.timings["raptor_s"] = time.time() - t0

    def _wait_active(self, pilot, t0: float) -> None:
        """Wait until ``pilot`` is active or has ended, ``startup_timeout`` at most; raise
        ``AgentStalled`` when its agent came up and has not reported itself active
        ``AGENT_STALL_S`` later (its start-up makes a blocking RPC to itself over a ZeroMQ
        pub-sub channel, which drops messages sent before the subscription propagated)."""
        rp = import_rp()

        ends = (rp.PMGR_ACTIVE, rp.FAILED, rp.CANCELED)
        deadline = t0 + self.startup_timeout
        profile = os.path.join(self.sandbox, "*", self.session.uid, pilot.uid, "agent_0.prof")
        agent_up = None
        while pilot.state not in ends:
            now = time.time()
            if now >= deadline:
                return
            if agent_up is None:
                agent_up = now if glob.glob(profile) else None
            elif now - agent_up > AGENT_STALL_S:
                raise AgentStalled(
                    f"RADICAL-Pilot's agent did not report the pilot active within "
                    f"{AGENT_STALL_S:.0f} s of its start (state {pilot.state})",
                    logs=[self.sandbox])
            pilot.wait(list(ends), timeout=max(0.2, min(1.0, deadline - now)))

    def _probe(self, worker) -> None:
        """Run one no-op task on the whole worker: it is up, and its mpiexec is known."""
        rp = import_rp()

        taskdir = TaskDir(private_dir(os.path.join(self.task_root, f"probe-{time.time_ns()}")))
        rp_task = self.raptor.submit_tasks([self.function_description(
            probe_payload(self.max_ranks), taskdir, self.max_ranks)])[0]
        t0 = time.time()
        deadline = t0 + self.startup_timeout
        while rp_task.state not in FINAL and time.time() < deadline:
            rp_task.wait(list(FINAL), timeout=1)
            if self.raptor.state in FINAL:    # the master died: nothing will run it
                raise LaunchError(f"RAPTOR master is {self.raptor.state} before it ran a "
                                  f"task: {text(self.raptor.stderr)[-2000:]}",
                                  logs=[self.sandbox])
            failed = worker.launch_failure(worker.uid)
            if failed is not None:   # the probe runs on the next worker, as tasks do later
                worker.replace(worker.uid, failed)
                if worker.broken is not None:
                    raise LaunchError(str(worker.broken), logs=[self.sandbox])
            if self.raptor.state in _UNPLACED and time.time() - t0 > SCHEDULER_STUCK_S:
                raise SchedulerStuck(
                    f"RADICAL-Pilot's agent did not place the RAPTOR master within "
                    f"{SCHEDULER_STUCK_S:.0f} s (state {self.raptor.state})",
                    logs=[self.sandbox])
        if rp_task.state != rp.DONE:
            raise LaunchError(f"RAPTOR MPI worker of {self.max_ranks} ranks did not run a task "
                              f"(state {rp_task.state}): {rp_task.stderr}",
                              logs=[self.sandbox])
        worker.came_up(taskdir.pids())
        taskdir.remove()

    # ------------------------------------------------------------------ tasks
    def next_uid(self) -> str:
        """A uid for the next RP task, so RP does not draw one itself: RP's own
        (``ru.generate_id``) closes its counter file's descriptor twice, and the second
        close can hit a descriptor another thread has just opened."""
        return f"hetflow.{next(self.uid_counter):06d}"

    def function_description(self, payload: bytes, taskdir: TaskDir, ranks: int,
                             attempt: bool = False, devices=None, gpus_per_rank: int = 0,
                             cores_per_rank: int = 1):
        """A RAPTOR function task; ``attempt``: its ranks run only while the task dir
        names this RP task's uid (see ``raptor_rank``); ``devices``: the GPU ids its ranks
        bind (``Executor.rank_resources``); ``cores_per_rank``: the threads each rank runs."""
        from hetflow.executors.radical.rank import raptor_rank
        rp = import_rp()

        uid = self.next_uid()
        # The worker puts the task's communicator where the first argument is None.
        return rp.TaskDescription({
            "uid": uid, "mode": rp.TASK_FUNCTION, "ranks": ranks,
            "function": rp.PythonTask(raptor_rank, [None, payload, taskdir.path,
                                                   client_sys_path(),
                                                   uid if attempt else None],
                                        {"devices": devices,
                                         "gpus_per_rank": gpus_per_rank,
                                         "cores_per_rank": cores_per_rank})})

    def executable_description(self, taskdir: TaskDir, resources: Resources):
        """An RP MPI executable task running the shared rank runner on ``taskdir``."""
        rp = import_rp()

        return rp.TaskDescription({
            "uid": self.next_uid(), "mode": rp.TASK_EXECUTABLE, "ranks": resources.ranks,
            "cores_per_rank": resources.cores_per_rank,
            "executable": sys.executable,
            "arguments": ["-m", "hetflow.executors._rank", taskdir.path],
            "environment": dict(self.rank_env)})

    def task_sandbox(self, uid: str) -> Optional[str]:
        """RP task ``uid``'s sandbox in this session (its launch's files, its ranks' working
        dir); None until RP has made it."""
        path = self._task_sandboxes.get(uid)
        if path is None and self.session is not None:
            found = [d for d in glob.glob(os.path.join(self.sandbox, "*", self.session.uid,
                                                       "*", uid)) if os.path.isdir(d)]
            if not found:
                return None          # not launched yet
            path = self._task_sandboxes[uid] = found[0]
        return path

    # ------------------------------------------------------------------ close
    def close(self, worker=None, stalled: bool = False) -> None:
        """End the worker, the pilot and the session; ``stalled``: the agent stalled in its
        start-up (a local one is ended at once: it may not be listening for the cancel)."""
        if not self.base:
            return          # never opened: nothing of RP's exists (and "" names no dir)
        t0 = time.time()
        if stalled and self.resource == LOCAL_RESOURCE:
            for proc in session_processes(self.sandbox):
                kill_tree(proc.pid, wait=False)
        if worker is not None:
            worker.kill_for_close()
        if self.session is not None:
            pilot_ended = False
            try:
                if self.resource == LOCAL_RESOURCE:
                    # The agent runs on this machine: it is seen to end (~1 s after the
                    # cancel), where RP's pilot manager notices its pilot's end ~6 s later.
                    self.pmgr.cancel_pilots(_timeout=0.1)   # sent; 0 would wait forever
                    pilot_ended = _agent_ended_within(self.sandbox, CANCEL_WAIT_S)
                elif self.slurm_job_id is not None:
                    # A pilot that is a batch job has ended when its job has (its agent
                    # exits on the cancel): the batch system is asked, where RP's pilot
                    # manager learns it from PSI/J's queue poll, every 30 s (the close
                    # waited 14.9 s for it here).
                    self.pmgr.cancel_pilots(_timeout=0.1)
                    pilot_ended = _job_ended_within(self.provider.job_active,
                                                    self.slurm_job_id, CANCEL_WAIT_S)
                else:
                    # Bounded: a pilot whose agent never came up cannot report CANCELED,
                    # and RP's wait has no end by default; what is left is killed below.
                    self.pmgr.cancel_pilots(_timeout=CANCEL_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort: the pilot may be gone already
                pass
            try:
                # A pilot that has ended needs no cancel from the close (RP's would wait
                # for its pilot manager to notice, up to 10 s).
                self.session.close(download=False, terminate=not pilot_ended)
            except Exception:  # noqa: BLE001 - best effort: hetflow kills what is left
                pass
            self.session = None
            release_client_handles(self.base, self._rp_before)
        end_leftovers(self.base, self._rp_children)
        self._rp_children = []
        configs.remove_psij_files(self.place, self.sandbox, self.slurm_job_id,
                                  self.provider.job_active)
        restore_environment(self.saved_env)
        self.timings["close_s"] = time.time() - t0


def client_sys_path() -> list:
    """The client's import path, handed to ranks so its modules' functions unpickle."""
    return [p for p in sys.path if p]


def _agent_ended_within(sandbox: str, timeout: float) -> bool:
    """Whether the local pilot's agent in ``sandbox`` and all it started (their working
    dirs are in it) end within ``timeout``. Its bootstrapper's shell is not waited for:
    once the agent is gone it only sleeps in a poll loop (~6 s), and is ended with the
    session's leftovers."""
    deadline = time.monotonic() + timeout
    while not all(_bootstrapper(proc) for proc in session_processes(sandbox)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _job_ended_within(job_active: Callable[[str], bool], job_id: str, timeout: float) -> bool:
    """Whether batch job ``job_id`` leaves the batch system's queue within ``timeout``."""
    deadline = time.monotonic() + timeout
    while job_active(job_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _bootstrapper(proc) -> bool:
    """Whether ``proc`` is RP's pilot bootstrapper (``bootstrap_0.sh``, its subshells and
    the ``sleep`` of its poll loop), or has ended."""
    import psutil

    try:
        if proc.name() == "sleep":
            proc = proc.parent()
        return proc is None or any("bootstrap_0.sh" in part for part in proc.cmdline())
    except psutil.Error:
        return True
