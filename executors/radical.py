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
it stops the worker, fails that task, starts a new worker and queues the other
tasks that were running on it again (they run again).

The kernel (:mod:`hetflow.executors.kernel`) owns the queue, walltimes, cancel
and delivery; this module is what differs for RP. Keeping RP from leaking
processes, descriptors and environment is :mod:`hetflow.executors._rp_hygiene`.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import resources as importlib_resources
from typing import Dict, List, Optional

import psutil

from hetflow._progress import waiting
from hetflow._private import tighten
from hetflow.errors import ConfigError, ExecutorBroken, LaunchError
from hetflow.executors import allocation as batch
from hetflow.executors._radical_rank import noop
from hetflow.executors._rank import TaskPayload
from hetflow.executors._rp_hygiene import (client_children, end_leftovers, import_rp,
                                           release_client_handles, started_during,
                                           restore_environment, rp_zmq_objects,
                                           session_processes, set_environment)
from hetflow.executors.kernel import Executor, Task
from hetflow.executors._forensics import kill_processes
from hetflow.executors.launch import ended, hydra_deaths, kill_tree, tail, with_malloc_thp
from hetflow.executors.taskdir import Deaths, TaskDir, private_dir
from hetflow.executors.watch import PEER_GRACE_S, POLL_S
from hetflow.spec import Resources

__all__ = ["LOCAL_RESOURCE", "MODES", "RadicalExecutor", "SLURM_RESOURCE",
           "local_resource_config", "session_processes", "slurm_resource_config"]

logger = logging.getLogger(__name__)

#: Resource label of hetflow's own config for this machine (resource_hetflow.json).
LOCAL_RESOURCE = "hetflow.local"
#: Resource label of hetflow's config for a pilot that is a Slurm job (``slurm=``).
SLURM_RESOURCE = "hetflow.slurm"
MODES = ("auto", "raptor", "exec")
#: Passed on to the RAPTOR master when set: drops its first N queue announcements, the
#: fault executors/_raptor_master.py survives (the tests' shared pilot runs with it).
MASTER_KNOB = "HETFLOW_RAPTOR_DROP_ANNOUNCEMENTS"
_FINAL = ("DONE", "FAILED", "CANCELED")
#: States of a task the agent holds but has not placed yet.
_UNPLACED = ("AGENT_STAGING_INPUT_PENDING", "AGENT_STAGING_INPUT", "AGENT_SCHEDULING_PENDING",
             "AGENT_SCHEDULING")
#: A RAPTOR master the pilot's agent has not placed this long after it was submitted: the
#: agent's scheduler is stuck, and the pilot is started once more (see ``_start_runtime``).
SCHEDULER_STUCK_S = 60.0
#: When set, a runtime's first RAPTOR master asks for a named environment nobody
#: registers, so the agent's scheduler holds it as a stuck one would (the tests' shared
#: pilot starts with it, and survives it).
STUCK_KNOB = "HETFLOW_RADICAL_HOLD_FIRST_MASTER"
#: A pilot's agent that has been up this long (its ``agent_0.prof`` is there; the agent
#: opens it after starting its bridges and components, ~2 s before it reports itself
#: active) without reporting ``PMGR_ACTIVE`` has stalled in its start-up, and the pilot is
#: started once more (see ``_start_runtime``).
AGENT_STALL_S = 60.0
#: When set, a runtime's first pilot's agent blocks in its start-up (it is asked to prepare
#: an environment whose set-up sleeps), as a stalled agent does (the tests' shared pilot
#: starts with it, and survives it).
STALL_KNOB = "HETFLOW_RADICAL_STALL_FIRST_AGENT"
#: Seconds to wait for RP to cancel the pilot at close (it takes ~6 s; an agent that never
#: came up never answers, and hetflow then kills the pilot's processes itself).
CANCEL_WAIT_S = 60
_WORKER_LOST = "the RAPTOR MPI worker running this task was lost"
#: A replacement RAPTOR worker that has not come up (its rank 0 reports it, see
#: ``executors/_raptor_worker.py``) within this many seconds (default: the runtime's
#: ``startup_timeout``), or whose RP task ended before, is killed and started once more;
#: after this many such starts in a row the RAPTOR path is broken and its tasks fail.
WORKER_STARTS = 3
_WORKER_CHECK_S = 0.25   # how often the watchdog looks at a worker that is not up yet
#: How long a vanished worker rank's exit status is waited for: RP's launch script writes it
#: from a bash process once its ``wait`` returns, which on a loaded node took more than
#: ``watch.EVIDENCE_GRACE_S`` (2 s; the killed-rank test inside a 2-node allocation beside two
#: busy loops, 2 runs of 6), and more than 10 s (1 run of 3 there with the runtime's
#: processes at nice -5). Only a rank that vanished without it waits this long.
_WORKER_EVIDENCE_S = 30.0
#: Set to N, the runtime's first N replacement RAPTOR workers never come up (their ranks
#: sleep before they start), as one whose launch hung does (tests/test_radical.py).
WORKER_HANG_KNOB = "HETFLOW_RAPTOR_WORKER_HANG"
#: Set to N, the runtime's first N replacement RAPTOR workers never come up either, their ranks
#: asleep right after ``MPI_Init`` (MPICH's segments in /dev/shm, still named: a worker's ranks
#: unlink them once it is up) (tests/test_radical.py).
WORKER_HANG_INIT_KNOB = "HETFLOW_RAPTOR_WORKER_HANG_AFTER_INIT"
#: What such a worker's ranks find in their environment (executors/_raptor_worker.py).
HANG_AFTER_INIT_ENV = "HETFLOW_RAPTOR_HANG_AFTER_INIT"
#: Set to N, the runtime's first N replacement RAPTOR workers print an ``srun`` error where
#: their launch's stderr goes, then hang, as one does whose Hydra could not start its proxies
#: (tests/test_radical.py).
WORKER_SRUN_FAILS_KNOB = "HETFLOW_RAPTOR_WORKER_SRUN_FAILS"
#: What ``srun`` prints when it cannot start: inside a Slurm allocation Hydra starts its
#: proxies with it, and after such a failure Hydra waits on forever (seen under load:
#: "srun: error: Unable to confirm allocation for job N: Socket timed out on send/recv
#: operation", slurmctld too slow to answer).
SRUN_ERROR = "srun: error: "


class _StartStalled(LaunchError):
    """A pilot start that stalled inside RP, where a new pilot starts (``_start_runtime``)."""


class _SchedulerStuck(_StartStalled):
    """The pilot's agent never placed the RAPTOR master."""


class _AgentStalled(_StartStalled):
    """The pilot's agent came up but never reported itself active."""


@dataclass
class _InPilot:
    """The radical runtime's handle on a running task (``Task.handle``)."""

    path: str                               # "raptor" or "exec"
    taskdir: TaskDir
    uid: str = ""                           # its RP task's uid (we name them: _next_uid)
    failed_seen: Optional[float] = None     # when a rank's failure was first seen (RAPTOR)


class RadicalExecutor(Executor):
    """A Parsl executor running hetflow MPI apps inside one RADICAL-Pilot pilot.

    resource / config_dir: the RP resource label and a folder of ``resource_*.json``
    files (e.g. a Slurm site); default: hetflow's config for this machine.
    pilot: extra ``PilotDescription`` fields (``runtime``, ``queue``, ``project``, ...).
    sandbox_dir: where sessions, sandboxes and logs go (default: inside the runtime's
    run dir); removed at shutdown unless ``keep_sandbox``.
    mode: "auto" (RAPTOR; walltime tasks as executable tasks), "raptor" or "exec".
    slurm: the pilot is a Slurm job, submitted from here as a user on a login node
    would (``{"nodes": 2, "ntasks": 4, "partition": ..., "time": "30"}``, minutes; see
    :func:`slurm_resource_config`); ``max_ranks`` defaults to ``ntasks``, else the
    nodes' CPUs. ``startup_timeout`` then includes the job's queue wait.

    Inside a Slurm allocation (``salloc``/``sbatch``) the default pilot spans the
    allocation's nodes (see :func:`local_resource_config`).
    """

    def __init__(self, label: str = "radical", *, max_ranks: Optional[int] = None,
                 resource: Optional[str] = None, config_dir: Optional[str] = None,
                 pilot: Optional[dict] = None, sandbox_dir: Optional[str] = None,
                 keep_sandbox: bool = False, mode: str = "auto",
                 startup_timeout: float = 300.0, gpus: Optional[int] = None,
                 slurm: Optional[dict] = None):
        self.slurm = None
        #: The pilot's Slurm job id (with ``slurm=``, once the pilot is active).
        self.slurm_job_id: Optional[str] = None
        if slurm is not None:     # a pilot started by the batch system
            if resource is not None or config_dir is not None:
                raise ConfigError("give slurm= (hetflow's Slurm resource config) or "
                                  "resource=/config_dir=, not both")
            self.slurm = batch.check_request(slurm)
            if self.slurm.get("args"):
                raise ConfigError("radical's pilot job takes nodes, ntasks, partition and "
                                  "time (RP writes the job script: no extra sbatch args)")
            if max_ranks is None:
                max_ranks = batch.request_slots(self.slurm)
            resource = SLURM_RESOURCE
        super().__init__(label, max_ranks=max_ranks, gpus=gpus)
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
        self.resource = resource or LOCAL_RESOURCE
        self.config_dir = config_dir
        #: The Slurm allocation hetflow runs in (None outside one): the local pilot
        #: then spans its nodes (see local_resource_config).
        self.allocation = batch.current() if self.resource == LOCAL_RESOURCE else None
        self.pilot_options = dict(pilot or {})
        self.sandbox_dir = sandbox_dir
        self.keep_sandbox = keep_sandbox
        self.mode = mode
        self.startup_timeout = startup_timeout
        #: Seconds each start-up / close phase took (session, pilot, raptor, close).
        self.timings: Dict[str, float] = {}
        #: Why each abandoned pilot start was abandoned (see ``_start_runtime``).
        self.restarts: List[str] = []
        self._stalls: List[type] = []               # the _StartStalled kinds restarted
        self.rank_env: Dict[str, str] = {}          # environment RP tasks (the ranks) get
        self._running: Dict[str, Task] = {}         # RP uid -> task, under _running_lock
        self._running_lock = threading.RLock()
        self._uid_counter = itertools.count()
        self._session = None
        self._saved_env: Dict[str, Optional[str]] = {}
        self._rp_before: set = set()
        self._watchdog: Optional[threading.Thread] = None
        self._worker_root: Optional[int] = None    # pid of the RAPTOR worker's mpiexec
        self._worker_uid = ""                       # its RP uid (names its hostfile)
        self._worker_task = None                    # its RP task
        self._worker_ready = ""                     # the file its rank 0 writes once up
        self._worker_since = 0.0                    # when it was submitted (monotonic)
        self._worker_up = False
        self._worker_starts = 0                     # failed starts in a row
        self._worker_hangs = 0                      # WORKER_HANG_KNOB: hangs made so far
        self._srun_fails = 0                        # WORKER_SRUN_FAILS_KNOB: the same
        self._init_hangs = 0                        # WORKER_HANG_INIT_KNOB: the same
        self._task_sandboxes: Dict[str, str] = {}   # RP task uid -> its task sandbox
        self._worker_lock = threading.RLock()       # one worker kill-and-start at a time
        self._raptor_broken: Optional[ExecutorBroken] = None
        #: Seconds a replacement RAPTOR worker may take to come up (see WORKER_STARTS).
        self.worker_start_s = startup_timeout
        self._rp_children: List[psutil.Process] = []    # the client's children RP started

    # ------------------------------------------------------------------ the pilot's life
    def _start_runtime(self) -> None:
        self.base = os.path.abspath(self.sandbox_dir or self.run_root)
        self.task_root = private_dir(os.path.join(self.base, "tasks"))
        self.status_dir = private_dir(os.path.join(self.base, "rank-status"))
        self.sandbox = os.path.join(self.base, "sandbox")   # the pilot's (RP makes it)
        self._set_environment()
        self._rp_before = rp_zmq_objects()
        try:
            while True:
                try:
                    self._start_pilot()
                    break
                except _StartStalled as exc:
                    # Two stalls inside RP's start-up, each now and then (docs/runtimes/
                    # radical.md): its agent's scheduler, a process forked from a threaded
                    # component, never takes a task; or the agent, up with all its
                    # components, never reports itself active. A new pilot has new
                    # processes: start once more for each (the same stall twice is the
                    # error).
                    if type(exc) in self._stalls:
                        raise
                    self._stalls.append(type(exc))
                    why = str(exc).splitlines()[0]
                    logger.warning("%s; starting a new pilot (once)", why)
                    self.restarts.append(why)
                    self._close_session(stalled=isinstance(exc, _AgentStalled))
                    self._set_environment()
                    self._rp_before = rp_zmq_objects()
        except BaseException:
            self._close_session()
            raise
        if self.mode != "exec":
            self._watchdog = threading.Thread(target=self._watch_raptor, daemon=True,
                                              name=f"{self.label}-raptor-watch")
            self._watchdog.start()

    def _set_environment(self) -> None:
        """RP reads its dirs and interface from the environment: point them at the run dir."""
        config_root = os.path.join(self.base, "config")
        configs = os.path.join(config_root, ".radical", "pilot", "configs")
        os.makedirs(configs, exist_ok=True)
        if self.config_dir:
            for name in os.listdir(self.config_dir):
                if name.startswith("resource_") and name.endswith(".json"):
                    shutil.copy(os.path.join(self.config_dir, name), configs)
        if self.resource in (LOCAL_RESOURCE, SLURM_RESOURCE):
            config = local_resource_config(self.pilot_cores(), self.allocation)
            if self.slurm is not None:
                config.update(slurm_resource_config(
                    self._slurm_cpus_per_node(), self.pilot_cores(), self.slurm,
                    os.path.join(self.base, "tmp")))
            with open(os.path.join(configs, "resource_hetflow.json"), "w") as fh:
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
               "TMPDIR": os.path.join(self.base, "tmp"),
               # RP starts its bridges by command name: the venv's bin must be on PATH.
               "PATH": os.pathsep.join([os.path.dirname(sys.executable),
                                        os.environ.get("PATH", "")])}
        if self.allocation is not None:
            # Hydra starts its proxies as Slurm steps, and a step takes its nodes' CPUs:
            # the worker's step would hold them and every later one (an executable task,
            # a replacement worker) wait for them. hetflow places within max_ranks itself.
            env["SLURM_OVERLAP"] = "1"
        os.makedirs(env["TMPDIR"], exist_ok=True)
        # The client's own temp dir is fixed before TMPDIR changes (tempfile caches it).
        self.rank_env = {"TMPDIR": tempfile.gettempdir()}
        tunables = with_malloc_thp(dict(os.environ)).get("GLIBC_TUNABLES")
        if tunables:          # (the user's, with malloc's huge pages unless they chose)
            self.rank_env["GLIBC_TUNABLES"] = tunables
        self._saved_env = set_environment(env)
        os.makedirs(env["RADICAL_PILOT_BASE"], exist_ok=True)

    def pilot_cores(self) -> int:
        """Cores the local pilot claims per node: worker + master + room for executable
        tasks.

        The kernel's scheduler keeps real use within ``max_ranks``; the pilot only
        needs enough (fake) cores that RP never blocks a task hetflow admitted. Inside
        an allocation that is per node: the worker places its ranks node by node
        (``ranks_per_node``, the allocation's CPUs per node), the rest is room.
        """
        if self.allocation is not None:
            return 1 + max(self.allocation.cpus) + self.max_ranks
        if self.slurm is not None:
            return 1 + self._slurm_cpus_per_node() + self.max_ranks
        return 2 * self.max_ranks + 1

    def _slurm_cpus_per_node(self) -> int:
        """Rank slots per node of the pilot job (its worker's ``ranks_per_node``)."""
        nodes = int(self.slurm.get("nodes") or 1)
        return -(-self.max_ranks // nodes)

    def _start_pilot(self) -> None:
        before = client_children()
        try:
            self._start_session_and_pilot()
        finally:
            # RP's own processes among the client's children, ended at close (and only they)
            self._rp_children += started_during(before)

    def _start_session_and_pilot(self) -> None:
        rp = import_rp()

        t0 = time.time()
        with waiting("the RADICAL-Pilot session"):
            self._session = rp.Session()
        self.timings["session_s"] = time.time() - t0
        self._pmgr = rp.PilotManager(session=self._session)
        self._tmgr = rp.TaskManager(session=self._session)
        self._tmgr.register_callback(self._state_cb)
        # exit_on_error=False: RP's default answers a failed pilot by cancelling the
        # client's main thread (SIGTERM); hetflow fails the tasks with typed errors instead.
        description = {"resource": self.resource, "runtime": 24 * 60,
                       "sandbox": self.sandbox, "exit_on_error": False}
        if self.allocation is not None:     # every node of the allocation, fully
            description["nodes"] = len(self.allocation.nodes)
            description["cores"] = len(self.allocation.nodes) * self.pilot_cores()
        elif self.slurm is not None:        # the job: its nodes, its time limit
            nodes = int(self.slurm.get("nodes") or 1)
            description.update(nodes=nodes, cores=nodes * self._slurm_cpus_per_node(),
                               runtime=_minutes(self.slurm.get("time", 60)))
            if self.slurm.get("partition"):
                description["queue"] = self.slurm["partition"]
        elif self.resource == LOCAL_RESOURCE:
            description["cores"] = self.pilot_cores()
        description.update(self.pilot_options)
        if os.environ.get(STALL_KNOB) and _AgentStalled not in self._stalls:
            description["prepare_env"] = {"hetflow-stall": {"type": "shell",
                                                            "pre_exec": ["sleep 3600"]}}
        t0 = time.time()
        pilot = self._pmgr.submit_pilots([rp.PilotDescription(description)])[0]
        self._tmgr.add_pilots(pilot)
        with waiting("the pilot"):
            self._wait_active(pilot, t0)
        if pilot.state != rp.PMGR_ACTIVE:
            raise LaunchError(f"RADICAL-Pilot pilot on {self.resource!r} is {pilot.state} after "
                              f"{time.time() - t0:.0f} s (startup_timeout={self.startup_timeout})",
                              logs=[self.sandbox])
        self._pilot = pilot
        if self.slurm is not None:
            self.slurm_job_id = _job_running_in(description["sandbox"])
        # RP's bootstrap chmods its scripts 0755 (all else it makes is owner-only: it runs
        # with the runtime's umask 077, see hetflow._private): hetflow keeps them private.
        tighten(description["sandbox"])
        self.timings["pilot_s"] = time.time() - t0
        if self.mode != "exec":
            t0 = time.time()
            self._raptor = pilot.submit_raptors(self._master_description())[0]
            self._start_worker()
            self._probe()
            self.timings["raptor_s"] = time.time() - t0

    def _wait_active(self, pilot, t0: float) -> None:
        """Wait until ``pilot`` is active or has ended, ``startup_timeout`` at most; raise
        ``_AgentStalled`` when its agent came up and has not reported itself active
        ``AGENT_STALL_S`` later. (Seen in two CI runs of the suite: the agent's profile
        showed all its components started, then nothing; its start-up makes a blocking
        RPC to itself over a ZeroMQ pub-sub channel, which drops messages sent before the
        subscription has propagated.)"""
        rp = import_rp()

        ends = (rp.PMGR_ACTIVE, rp.FAILED, rp.CANCELED)
        deadline = t0 + self.startup_timeout
        profile = os.path.join(self.sandbox, "*", self._session.uid, pilot.uid, "agent_0.prof")
        agent_up = None
        while pilot.state not in ends:
            now = time.time()
            if now >= deadline:
                return
            if agent_up is None:
                agent_up = now if glob.glob(profile) else None
            elif now - agent_up > AGENT_STALL_S:
                raise _AgentStalled(
                    f"RADICAL-Pilot's agent did not report the pilot active within "
                    f"{AGENT_STALL_S:.0f} s of its start (state {pilot.state})",
                    logs=[self.sandbox])
            pilot.wait(list(ends), timeout=max(0.2, min(1.0, deadline - now)))

    def _master_description(self):
        """RP's RAPTOR master, with hetflow's fix for a lost queue announcement
        (``executors/_raptor_master.py``). RP loads it by path in the pilot, where
        hetflow's install is (the pilot runs this venv: hetflow's RP resources set
        ``virtenv`` to it; a site's resource must see this install's path too)."""
        rp = import_rp()

        environment = {key: os.environ[key] for key in (MASTER_KNOB,) if os.environ.get(key)}
        description = {
            "mode": rp.RAPTOR_MASTER, "raptor_class": "Master",
            "raptor_file": os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "_raptor_master.py"),
            "environment": environment}
        if os.environ.get(STUCK_KNOB) and _SchedulerStuck not in self._stalls:
            description["named_env"] = "hetflow-never-registered"
        return rp.TaskDescription(description)

    def _start_worker(self, replacement: bool = False) -> None:
        """Submit a RAPTOR MPI worker of ``max_ranks`` ranks; its rank 0 writes
        ``self._worker_ready`` once every rank is up and it has registered with the master
        (the watchdog gives a replacement ``worker_start_s`` for that)."""
        rp = import_rp()

        self._worker_ready = os.path.join(self.status_dir, f"ready-{time.time_ns()}")
        environment = {**self.rank_env, "HETFLOW_RAPTOR_READY": self._worker_ready}
        hang = []
        if replacement and self._worker_hangs < int(os.environ.get(WORKER_HANG_KNOB) or 0):
            self._worker_hangs += 1
            hang = ["sleep 86400"]      # before the rank's Python starts (RP's pre_exec)
        elif replacement and self._srun_fails < int(os.environ.get(WORKER_SRUN_FAILS_KNOB) or 0):
            self._srun_fails += 1
            hang = [f"echo '{SRUN_ERROR}Unable to confirm allocation for job 0: (the test "
                    f"knob {WORKER_SRUN_FAILS_KNOB})' >&2", "sleep 86400"]
        elif replacement and self._init_hangs < int(os.environ.get(WORKER_HANG_INIT_KNOB) or 0):
            self._init_hangs += 1
            environment[HANG_AFTER_INIT_ENV] = "1"          # read by _raptor_worker
        placement = {}
        if self.allocation is not None or self.slurm is not None:
            # Node-packed like the allocation: a task's ranks (the worker's lowest ranks
            # first) share a node when they fit on one.
            placement["ranks_per_node"] = (max(self.allocation.cpus) if self.allocation
                                           else self._slurm_cpus_per_node())
        self._worker_task = self._raptor.submit_workers(rp.TaskDescription(
            {"mode": rp.RAPTOR_WORKER, "ranks": self.max_ranks, "raptor_class": "MPIWorker",
             # hetflow's (RP's, which unlinks its MPICH segments' names once up)
             "raptor_file": os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "_raptor_worker.py"),
             **placement,
             "environment": environment, "pre_exec": hang,
             # A rank killed from outside leaves no evidence of its own; RP's launch script
             # has its status ($RP_RET, after `wait` on $RP_RANK_PID, the rank's pid).
             "post_exec": [f"echo $RP_RET > {self.status_dir}/exit-$RP_RANK_PID"]}))[0]
        self._worker_uid = self._worker_task.uid
        self._worker_since, self._worker_up = time.monotonic(), False

    def _probe(self) -> None:
        """Run one no-op task on the whole worker: it is up, and its mpiexec is known."""
        rp = import_rp()

        taskdir = TaskDir(private_dir(os.path.join(self.task_root, f"probe-{time.time_ns()}")))
        rp_task = self._raptor.submit_tasks([self._function_description(
            probe_payload(self.max_ranks), taskdir, self.max_ranks)])[0]
        t0 = time.time()
        deadline = t0 + self.startup_timeout
        while rp_task.state not in _FINAL and time.time() < deadline:
            rp_task.wait(list(_FINAL), timeout=1)
            if self._raptor.state in _FINAL:    # the master died: nothing will run it
                raise LaunchError(f"RAPTOR master is {self._raptor.state} before it ran a "
                                  f"task: {_text(self._raptor.stderr)[-2000:]}", logs=[self.sandbox])
            failed = self._launch_failure(self._worker_uid)
            if failed is not None:   # the probe runs on the next worker, as tasks do later
                self._replace_worker(self._worker_uid, failed)
                if self._raptor_broken is not None:
                    raise LaunchError(str(self._raptor_broken), logs=[self.sandbox])
            if self._raptor.state in _UNPLACED and time.time() - t0 > SCHEDULER_STUCK_S:
                raise _SchedulerStuck(
                    f"RADICAL-Pilot's agent did not place the RAPTOR master within "
                    f"{SCHEDULER_STUCK_S:.0f} s (state {self._raptor.state})",
                    logs=[self.sandbox])
        if rp_task.state != rp.DONE:
            raise LaunchError(f"RAPTOR MPI worker of {self.max_ranks} ranks did not run a task "
                              f"(state {rp_task.state}): {rp_task.stderr}",
                              logs=[self.sandbox])
        self._worker_root = self._worker_launcher(taskdir.pids())
        self._worker_up = True
        taskdir.remove()

    def _worker_launcher(self, pids: Dict[int, int]) -> Optional[int]:
        """The pid of the RAPTOR worker's ``mpiexec``: an ancestor of its ranks, or (inside
        Slurm, where Hydra starts the ranks under ``srun``/``slurmstepd``, not under itself)
        the ``mpiexec`` given the worker's hostfile (RP names it after the worker's uid)."""
        found = _launcher_of(pids)
        if found is None and self._worker_uid:
            # RP names the hostfile after the worker's uid, the same in every session
            # ("raptor.0000.0000"): only this runtime's sandbox holds this runtime's.
            found = _launcher_named(self.sandbox + os.sep,
                                    f"/{self._worker_uid}.hf")
        return found

    def _stop_runtime(self) -> None:
        if self._watchdog is not None:
            self._watchdog.join(timeout=10)
        self._close_session()
        if not self.keep_sandbox and getattr(self, "base", None):
            shutil.rmtree(self.base, ignore_errors=True)

    def _close_session(self, stalled: bool = False) -> None:
        """End the pilot and the session; ``stalled``: the agent stalled in its start-up
        (a local one is ended at once: it may not be listening for the cancel)."""
        t0 = time.time()
        if stalled and self.resource == LOCAL_RESOURCE:
            for proc in session_processes(self.sandbox):
                kill_tree(proc.pid, wait=False)
        root = self._worker_root or (self._worker_launcher({}) if self._session else None)
        if self._session is not None and self._worker_uid and not self._worker_up:
            self._kill_worker_ranks(self._worker_uid)   # not in root's tree inside Slurm
        if root is not None:
            # don't wait for RP to wind the worker down, nor for its agent to reap it
            kill_tree(root, wait=False)
        if self._session is not None:
            pilot_ended = False
            try:
                if self.resource == LOCAL_RESOURCE:
                    # The agent runs on this machine: it is seen to end (~1 s after the
                    # cancel), where RP's pilot manager notices its pilot's end ~6 s later.
                    self._pmgr.cancel_pilots(_timeout=0.1)   # sent; 0 would wait forever
                    pilot_ended = _agent_ended_within(self.sandbox, CANCEL_WAIT_S)
                else:
                    # Bounded: a pilot whose agent never came up cannot report CANCELED,
                    # and RP's wait has no end by default; what is left is killed below.
                    self._pmgr.cancel_pilots(_timeout=CANCEL_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort: the pilot may be gone already
                pass
            try:
                # A pilot that has ended needs no cancel from the close (RP's would wait
                # for its pilot manager to notice, up to 10 s).
                self._session.close(download=False, terminate=not pilot_ended)
            except Exception:  # noqa: BLE001 - best effort: hetflow kills what is left
                pass
            self._session = None
            release_client_handles(self.base, self._rp_before)
        end_leftovers(self.base, self._rp_children)
        self._rp_children = []
        if self.slurm is not None:
            _remove_psij_files(self.sandbox, self.slurm_job_id)
        restore_environment(self._saved_env)
        self.timings["close_s"] = time.time() - t0

    # ------------------------------------------------------------------ starting tasks
    def _start(self, task: Task) -> None:
        """Submit ``task`` to RP (first run, or again after its worker was recycled)."""
        if task.handle is None:
            path = "exec" if self.mode == "exec" or (self.mode == "auto"
                                                     and task.resources.walltime) else "raptor"
            task.handle = _InPilot(path, TaskDir(os.path.join(self.task_root,
                                                              f"task-{task.id:06d}")))
        handle: _InPilot = task.handle
        if handle.path == "exec":
            handle.taskdir.create(task.payload, dataclasses.asdict(task.resources),
                                  self.client_sys_path())
            description, submit = self._executable_description(task), self._tmgr.submit_tasks
        else:
            if self._raptor_broken is not None:
                raise self._raptor_broken
            handle.taskdir.clear()          # a task run again must not see its last run's files
            private_dir(handle.taskdir.path)
            description = self._function_description(task.payload, handle.taskdir,
                                                     task.resources.ranks, attempt=True)
            handle.taskdir.set_attempt(description["uid"])
            submit = self._raptor.submit_tasks
        # Known before RP is: its state callback may come before submit_tasks returns.
        handle.uid, handle.failed_seen = description["uid"], None
        with self._running_lock:
            self._running[handle.uid] = task
        try:
            submit([description])
        except Exception as exc:
            with self._running_lock:
                self._running.pop(handle.uid, None)
            raise LaunchError(f"could not submit task {task.id} to RADICAL-Pilot: {exc}") from exc
        if task.error is not None:          # stopped while it was being submitted
            self._stop(task, task.error)

    def _next_uid(self) -> str:
        """A uid for the next RP task, so RP does not draw one itself.

        RP names a task without a uid through ``ru.generate_id('task.%(item_counter)06d')``,
        which bumps a counter file and closes that descriptor twice (radical.utils 1.103,
        ``ids._read_file_counter``). The second close can hit a descriptor another
        thread has just opened: one load-test run lost a submission to EBADF that way.
        """
        return f"hetflow.{next(self._uid_counter):06d}"

    def _function_description(self, payload: bytes, taskdir: TaskDir, ranks: int,
                              attempt: bool = False):
        """``attempt``: the ranks run only while the task dir names this RP task's uid
        (see ``raptor_rank``)."""
        from hetflow.executors._radical_rank import raptor_rank
        rp = import_rp()

        uid = self._next_uid()
        # The worker puts the task's communicator where the first argument is None.
        return rp.TaskDescription({
            "uid": uid, "mode": rp.TASK_FUNCTION, "ranks": ranks,
            "function": rp.PythonTask(raptor_rank, [None, payload, taskdir.path,
                                                   self.client_sys_path(),
                                                   uid if attempt else None], {})})

    def _executable_description(self, task: Task):
        rp = import_rp()

        return rp.TaskDescription({
            "uid": self._next_uid(), "mode": rp.TASK_EXECUTABLE, "ranks": task.resources.ranks,
            "cores_per_rank": task.resources.cores_per_rank,
            "executable": sys.executable,
            "arguments": ["-m", "hetflow.executors._rank", task.handle.taskdir.path],
            "environment": dict(self.rank_env)})

    # ------------------------------------------------------------------ completion
    def _state_cb(self, rp_task, state) -> None:
        """RP's report that one of its tasks ended (on RP's callback thread)."""
        if state not in _FINAL:
            return
        with self._running_lock:
            task = self._running.get(rp_task.uid)
        if task is None:    # an abandoned copy (worker recycled, task stopped) or the probe
            return
        if task.handle.path == "raptor" and _worker_lost(task.handle.taskdir):
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
                            stderr_tail=_text(rp_task.stderr)[-4000:],
                            deaths=self._deaths(task, _text(rp_task.stdout)))
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
        return taskdir.deaths(lambda: self._worker_deaths(taskdir))

    def _worker_deaths(self, taskdir: TaskDir) -> Deaths:
        """Name how RAPTOR worker ranks that vanished without evidence (SIGKILL) died.

        RP's launch script records each worker rank's exit status (``$RP_RET``, see
        :meth:`_start_worker`); failing that, the worker's Hydra prints "PID n ...
        EXIT CODE: c ... (signal s)" to its stdout in the pilot sandbox. Both may take
        a moment: they are awaited up to ``_WORKER_EVIDENCE_S``, then the vanished
        ranks are named with what is known.
        """
        dead = {rank: pid for rank, pid in taskdir.pids().items() if ended(pid)}
        if not dead:
            return {}
        sandbox = self.sandbox
        deadline = time.monotonic() + _WORKER_EVIDENCE_S
        while True:
            found = rank_exit_statuses(self.status_dir, dead)
            for root, _, files in os.walk(sandbox):
                for name in files:
                    if not found and name.endswith(".out"):
                        found = hydra_deaths(taskdir, tail(os.path.join(root, name), 20000))
            if found:
                return found
            if time.monotonic() > deadline:
                return {rank: ("vanished (killed from outside; no exit status was visible)", "")
                        for rank in dead}
            time.sleep(0.2)

    # ------------------------------------------------------------------ watching and stopping
    def _watch_raptor(self) -> None:
        """Notice RAPTOR tasks the worker will never report: a rank died, or one failed
        and its peers have waited longer than ``PEER_GRACE_S`` (stuck in a collective)."""
        checked = 0.0
        while not self.stopping:
            time.sleep(POLL_S)  # a SIGKILLed rank must be seen before Hydra stops its peers
            if time.monotonic() - checked > _WORKER_CHECK_S:
                checked = time.monotonic()
                try:
                    self._check_worker()
                except Exception:  # the watchdog must live (logged)
                    logger.exception("watchdog could not check the RAPTOR worker")
            with self._running_lock:
                running = [(uid, t) for uid, t in self._running.items()
                           if t.handle.path == "raptor" and t.error is None]
            for uid, task in running:
                with self._running_lock:
                    if self._running.get(uid) is not task:
                        # Reported, or recycled with an earlier task's worker in this very
                        # pass and maybe re-queued under a new uid already: its task dir
                        # still names the dead worker's ranks, and must not make it (and
                        # the new worker) a victim too.
                        continue
                try:
                    if self._lost_or_stuck(task.handle):
                        self._recycle(task, uid)
                except Exception:  # the watchdog serves every task; it must live (logged)
                    logger.exception("watchdog could not check task %s; checking again", task.id)

    def _check_worker(self) -> None:
        """Replace a RAPTOR worker that does not come up: its RP task ended first, its
        launch's ``srun`` failed (Hydra then waits on forever), or it has taken
        ``worker_start_s``. Tasks submitted meanwhile wait in the master's queue and run on
        the next worker."""
        if self._worker_up or self.stopping or self._raptor_broken is not None:
            return
        uid, task = self._worker_uid, self._worker_task
        if os.path.exists(self._worker_ready):
            self._worker_up, self._worker_starts = True, 0
            return
        state = getattr(task, "state", None)
        failed = self._launch_failure(uid)
        if state in _FINAL:
            why = f"RAPTOR worker {uid} ended ({state}) before it came up"
        elif failed is not None:
            why = failed
        elif time.monotonic() - self._worker_since > self.worker_start_s:
            why = f"RAPTOR worker {uid} did not come up within {self.worker_start_s:.0f} s"
        else:
            return
        self._replace_worker(uid, why)

    def _task_sandbox(self, uid: str) -> Optional[str]:
        """RP task ``uid``'s sandbox in this runtime's session (its launch's files, its ranks'
        working dir); None until RP has made it."""
        path = self._task_sandboxes.get(uid)
        if path is None and self._session is not None:
            found = [d for d in glob.glob(os.path.join(self.sandbox, "*", self._session.uid, "*",
                                                       uid)) if os.path.isdir(d)]
            if not found:
                return None          # not launched yet
            path = self._task_sandboxes[uid] = found[0]
        return path

    def _launch_failure(self, uid: str) -> Optional[str]:
        """Why worker ``uid`` (not up) will never come up, from the first ``srun`` error in
        its launch's stderr; None if there is none."""
        sandbox = self._task_sandbox(uid)
        if sandbox is None:
            return None
        try:
            with open(os.path.join(sandbox, f"{uid}.err"), "rb") as fh:
                text = fh.read(1 << 16).decode(errors="replace")
        except OSError:
            return None
        line = next((line.strip() for line in text.splitlines() if SRUN_ERROR in line), None)
        return None if line is None else f"RAPTOR worker {uid}'s launch failed: {line}"

    def _replace_worker(self, uid: str, why: str) -> None:
        """Kill worker ``uid`` (unless a recycle replaced it meanwhile) and start another;
        after ``WORKER_STARTS`` failed starts in a row, fail the RAPTOR tasks instead."""
        with self._worker_lock:
            if uid != self._worker_uid or self._worker_up or self.stopping:
                return
            logger.warning("%s; starting a new one", why)
            self.restarts.append(why)
            # Its launcher's tree first: RP's cancel kills the launch's process group, where
            # Hydra's srun (inside Slurm) is not, and a launcher gone before this looked for
            # it left that srun and its proxy running (seen under load). Its ranks before the
            # tree: inside Slurm they are not in it (see _kill_worker_ranks).
            root = self._worker_launcher({})
            self._kill_worker_ranks(uid)
            if root is not None:
                kill_tree(root)
            try:
                self._tmgr.cancel_tasks(uid)     # a launch RP has not made yet never happens
            except Exception:  # noqa: BLE001 - best effort: its processes are killed above
                pass
            self._worker_starts += 1
            if self._worker_starts < WORKER_STARTS:
                self._start_worker(replacement=True)
                return
            self._raptor_broken = ExecutorBroken(
                f"the RAPTOR worker did not come up {WORKER_STARTS} times in a row "
                f"(last: {why})")
            with self._running_lock:
                victims = [t for t in self._running.values() if t.handle.path == "raptor"]
                for t in victims:
                    self._running.pop(t.handle.uid, None)
        for t in victims:
            _retire(t.handle)
            self.finish(t, error=self._raptor_broken)

    def _kill_worker_ranks(self, uid: str) -> int:
        """SIGKILL the processes working in worker ``uid``'s task sandbox (its ranks and their
        launch's scripts) and remove the MPI segments they had mapped whose names were still
        there; how many were killed.

        A worker killed before it came up has MPICH's segments still named in /dev/shm (its
        ranks unlink them once up, :mod:`hetflow.executors._raptor_worker`). The kill of its
        launcher's tree reads its ranks' mappings first, but inside Slurm Hydra starts the
        ranks with ``srun``, under ``slurmstepd``: outside that tree, and their segments were
        left behind (seen under load). Their working dir, the task sandbox in this runtime's
        own session, finds them on this node."""
        sandbox = self._task_sandbox(uid)
        if sandbox is None:
            return 0
        procs = session_processes(sandbox)
        kill_processes(procs, wait=False)
        return len(procs)

    @staticmethod
    def _lost_or_stuck(handle: _InPilot) -> bool:
        if _worker_lost(handle.taskdir):
            return True
        if any(not o.ok for o in handle.taskdir.outcomes().values()):
            now = time.monotonic()
            if handle.failed_seen is None:
                handle.failed_seen = now
            return now - handle.failed_seen > PEER_GRACE_S
        return False

    def _stop(self, task: Task, error: Optional[BaseException]) -> None:
        """A RAPTOR task takes its worker down (see :meth:`_recycle`); an executable
        task is cancelled in RP and its ranks killed."""
        handle: Optional[_InPilot] = task.handle
        if handle is None:
            return           # not submitted yet: _start sees task.error and stops it
        if handle.path == "raptor" and not self.stopping:
            self._recycle(task)
            return
        with self._running_lock:
            if self._running.pop(handle.uid, None) is None:
                return
        deaths = self._deaths(task) if task.error is None else None
        if handle.path == "exec":
            # Ranks RP's agent starts after the kill below (it may still be launching them;
            # its cancel does not stop a launch under way) find this and do not run.
            handle.taskdir.ask_to_stop()
            try:
                self._tmgr.cancel_tasks(handle.uid)
            except Exception:  # noqa: BLE001 - best effort: the worker is being killed anyway
                pass
            kill_tree_of(handle.taskdir.path)
        # (RAPTOR at shutdown: the worker goes with the session.)
        self.complete(task, handle.taskdir.outcomes(), deaths=deaths)

    def _recycle(self, task: Task, uid: Optional[str] = None) -> None:
        """Stop the RAPTOR worker, fail ``task``, restart the worker, rerun its neighbours.

        ``uid``: the RP task the caller saw fail (default: the task's current one); if the
        task has moved on from it (re-queued), there is nothing to do. The verdict is the
        kernel's (cancel, walltime) or else the ranks' reports, read before the worker is
        killed (killing it ends every rank).
        """
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
        deaths = self._deaths(task) if task.error is None else None
        with self._worker_lock:
            root = next(filter(None, (_launcher_of(t.handle.taskdir.pids())
                                      for t in [task] + neighbours)), self._worker_root) \
                or self._worker_launcher({})
            if root is not None:
                kill_tree(root)
            self._worker_root = None
            restart = not self.stopping     # (at shutdown the kernel fails the neighbours)
            error = None
            if restart:
                try:
                    self._start_worker(replacement=True)
                except Exception as exc:  # noqa: BLE001 - the neighbours must learn of it
                    error = exc
        if restart:
            if error is not None:
                for t in neighbours:
                    self.finish(t, error=ExecutorBroken(f"RAPTOR worker could not restart: "
                                                         f"{error}"))
            else:
                # atomically: the freed slots go to the neighbours first
                self.requeue(*neighbours, release=True)
        self.complete(task, task.handle.taskdir.outcomes(), deaths=deaths,
                       stderr_tail=_WORKER_LOST)


# ---------------------------------------------------------------------- helpers
def probe_payload(ranks: int) -> bytes:
    """The start-up probe's payload: a no-op on ``ranks`` ranks, whose function every rank
    finds in a module it imports anyway (see :func:`~hetflow.executors._radical_rank.noop`)."""
    return TaskPayload(task_id=-1, func=noop, args=(), kwargs={},
                       resources=Resources(ranks=ranks)).dumps()


def _text(output) -> str:
    """RP's stdout/stderr of a task: one string, or one per rank."""
    if isinstance(output, list):
        return "\n".join(s or "" for s in output)
    return output or ""


def _retire(handle: _InPilot) -> None:
    """No copy of this RAPTOR task's current RP task may run from now on (see
    ``raptor_rank``); its task dir may be gone already."""
    if handle.path == "raptor":
        try:
            handle.taskdir.set_attempt("")
        except OSError:
            pass


def _worker_lost(taskdir: TaskDir) -> bool:
    """Whether a rank of the RAPTOR worker running this task has ended (they never do
    while the worker lives)."""
    return any(ended(pid) for pid in taskdir.pids().values())


def rank_exit_statuses(status_dir: str, pids: Dict[int, int]) -> Deaths:
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


def _launcher_of(pids: Dict[int, int]) -> Optional[int]:
    """The pid of the ``mpiexec`` that started these ranks (the RAPTOR worker's)."""
    for pid in pids.values():
        try:
            for parent in psutil.Process(pid).parents():
                if parent.name().startswith("mpiexec"):
                    return parent.pid
        except psutil.Error:
            continue
    return None


def _launcher_named(prefix: str, suffix: str) -> Optional[int]:
    """The pid of an ``mpiexec`` given a file under ``prefix`` whose path ends in ``suffix``."""
    for proc in psutil.process_iter():
        try:
            if proc.name().startswith("mpiexec") and any(
                    a.startswith(prefix) and a.endswith(suffix) for a in proc.cmdline()):
                return proc.pid
        except (psutil.Error, OSError):    # it ended meanwhile
            continue
    return None


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


def _bootstrapper(proc: psutil.Process) -> bool:
    """Whether ``proc`` is RP's pilot bootstrapper (``bootstrap_0.sh``, its subshells and
    the ``sleep`` of its poll loop), or has ended."""
    try:
        if proc.name() == "sleep":
            proc = proc.parent()
        return proc is None or any("bootstrap_0.sh" in part for part in proc.cmdline())
    except psutil.Error:
        return True


def kill_tree_of(taskdir: str) -> None:
    """SIGKILL the ranks of an executable task (their command line ends in ``taskdir``)."""
    for proc in psutil.process_iter():
        try:
            if (proc.cmdline() or [""])[-1] == taskdir:
                kill_tree(_launcher_of({0: proc.pid}) or proc.pid)
        except (psutil.Error, OSError):    # it ended meanwhile
            pass


def _minutes(limit) -> int:
    """A Slurm time limit (see ``allocation.time_limit_s``) in whole minutes, rounded up."""
    return max(1, -(-batch.time_limit_s(limit, "radical") // 60))


def slurm_resource_config(cpus: int, cores: int, request: dict, tmpdir: str) -> dict:
    """hetflow's ``slurm`` resource: the pilot is a Slurm job (RP submits it with
    ``sbatch`` through PSI/J) asking for ``cpus`` per node, its agent runs in the job,
    its nodes are the job's (RP's ``SLURM`` resource manager), and Hydra starts the
    ranks on them with ``srun`` steps that overlap (as inside an allocation).

    The agent sees ``cores`` (fake) per node, as the local pilot does (see
    ``RadicalExecutor.pilot_cores``: master + worker + room for executable tasks;
    the kernel keeps real use within ``max_ranks``): before it starts, the job's
    bootstrap raises the core count in the agent's config (``agent_0.cfg``, which RP
    staged into the job's sandbox). The job's environment is not the client's
    (``--export=NONE``): what the agent needs is set up by its bootstrap.
    """
    config = local_resource_config(cpus)["local"]
    bindir = os.path.dirname(sys.executable)
    config.update(
        description="hetflow: a pilot that is a Slurm job (written per run by "
                    "hetflow.executors.radical)",
        default_schema="batch",
        schemas={"batch": {"job_manager_endpoint": "slurm://localhost/",
                           "filesystem_endpoint": "file://localhost/"}},
        resource_manager="SLURM", fake_resources=False,
        default_queue=request.get("partition") or "",
        # RP's temp files go to the sandbox (as the local pilot's: see _set_environment);
        # Hydra's proxies are Slurm steps that must not wait for each other's CPUs.
        pre_bootstrap_0=[f"export TMPDIR={tmpdir}", "export SLURM_OVERLAP=1",
                         f"export PATH={bindir}:$PATH",
                         # (RP's bootstrap evals these: no quotes, no spaces in words)
                         f"{sys.executable} -m {__name__} agent-cores {int(cores)}"])
    return {"slurm": config}


def local_resource_config(cores: int, allocation: Optional[batch.Allocation] = None) -> dict:
    """hetflow's ``local`` resource: this machine, ``cores`` slots, the venv's MPI.

    Inside a Slurm ``allocation`` the pilot's nodes are the allocation's (RP's
    ``SLURM`` resource manager reads them from ``$SLURM_NODELIST``), ``cores`` per
    node: Hydra is then given the nodes' names, and starts its proxies on them with
    ``srun``. (Given ``localhost`` inside an allocation it asks Slurm for a step on a
    node the job does not have, and hangs.) The pilot's agent still runs here, where
    the client is, as a job script's processes do.
    """
    text = importlib_resources.files("hetflow.executors").joinpath(
        "resource_configs/resource_hetflow.json").read_text()
    config = json.loads(text)
    config["local"]["cores_per_node"] = cores
    if allocation is not None:
        config["local"]["resource_manager"] = "SLURM"
    config["local"]["virtenv"] = sys.prefix
    # RP probes its launcher in the pilot's original environment (before the venv is
    # activated): put the venv's bin first so it finds, and launches with, the venv's MPI.
    bindir = os.path.dirname(sys.executable)
    for method in ("MPIEXEC", "FORK"):
        config["local"]["launch_methods"][method] = {
            "pre_exec_cached": [f"export PATH={bindir}:$PATH"]}
    return config


def _job_running_in(sandbox: str) -> Optional[str]:
    """The id of the Slurm job whose working directory is under ``sandbox`` (RP's pilot
    job runs in its pilot sandbox; PSI/J names the job itself)."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        job, _, workdir = line.partition(" ")
        if workdir.startswith(sandbox + os.sep):
            return job
    return None


def _remove_psij_files(sandbox: str, job_id: Optional[str]) -> None:
    """Remove what PSI/J left in its work dir for the pilot job: the job script (it
    names the sandbox) and its output file (named by the job id)."""
    work = os.path.expanduser(os.path.join("~", ".psij", "work", "slurm"))
    deadline = time.monotonic() + 30     # the job writes its output file as it ends
    while job_id is not None and time.monotonic() < deadline:
        try:
            listed = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"],
                                    capture_output=True, text=True, timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            break
        if job_id not in listed:
            break
        time.sleep(0.2)
    try:
        names = os.listdir(work)
    except OSError:
        return
    for name in names:
        path = os.path.join(work, name)
        try:
            if job_id is not None and name.startswith(f"{job_id}."):
                os.unlink(path)
            elif name.endswith(".job"):
                with open(path, errors="replace") as fh:
                    if sandbox in fh.read():
                        os.unlink(path)
        except OSError:
            continue


def _raise_agent_cores(cores: int, path: str = "agent_0.cfg") -> None:
    """Give the pilot job's agent ``cores`` per node (see :func:`slurm_resource_config`)."""
    with open(path) as fh:
        config = json.load(fh)
    config["cores_per_node"] = cores
    config["cores"] = config["nodes"] * cores
    with open(path, "w") as fh:
        json.dump(config, fh)


if __name__ == "__main__":      # run by the pilot job's bootstrap, in the pilot's sandbox
    if len(sys.argv) != 3 or sys.argv[1] != "agent-cores":
        sys.exit("usage: python -m hetflow.executors.radical agent-cores N")
    _raise_agent_cores(int(sys.argv[2]))
