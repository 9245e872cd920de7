"""The RAPTOR MPI worker: one of ``max_ranks`` ranks runs every RAPTOR task of the runtime.

Its life is a small state machine::

    STARTING --(rank 0 wrote its ready file)--> UP
    STARTING --(its RP task ended | its launch's srun failed | start_s passed)--> replaced
    replaced WORKER_STARTS times in a row --> BROKEN (its tasks fail with ExecutorBroken)
    UP --(a task's rank died or hung: the executor recycles it)--> killed, STARTING again

What to do with a worker that is not up is decided by :func:`judge_start`, a pure function
(unit-tested without RP); :class:`RaptorWorker` only looks and acts.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional

from hetflow.errors import ExecutorBroken
from hetflow.executors._forensics import (ended, kill_processes, kill_tree, launcher_named,
                                          launcher_of)
from hetflow.executors.radical.hygiene import import_rp, session_processes
from hetflow.executors.launch import hydra_deaths, tail
from hetflow.executors.radical import configs
from hetflow.executors.radical.configs import RAPTOR_DIR, Descriptions
from hetflow.executors.taskdir import Deaths, TaskDir

logger = logging.getLogger(__name__)

#: A worker that has not come up is killed and started again; after this many such starts
#: in a row the RAPTOR path is broken and its tasks fail.
WORKER_STARTS = 3
#: How long a vanished worker rank's exit status is waited for: RP's launch script writes
#: it from a bash process once its ``wait`` returns, which on a loaded node can take more
#: than ``watch.EVIDENCE_GRACE_S``.
EVIDENCE_S = 30.0
#: What ``srun`` prints when it cannot start: inside a Slurm allocation Hydra starts its
#: proxies with it, and after such a failure Hydra waits on forever.
SRUN_ERROR = "srun: error: "
_FINAL = ("DONE", "FAILED", "CANCELED")


@dataclasses.dataclass(frozen=True)
class StartVerdict:
    """What to do with a worker that is starting: ``up`` (it came up), or ``why`` it never
    will and whether to ``give_up`` (else start another); neither: wait."""

    up: bool = False
    why: str = ""
    give_up: bool = False


def judge_start(*, uid: str, ready: bool, rp_state: Optional[str],
                launch_error: Optional[str], waited_s: float, limit_s: float,
                failed_starts: int) -> StartVerdict:
    """Decide about worker ``uid``, not yet known to be up, from what was seen of it.
    ``failed_starts``: starts that failed in a row before this one."""
    if ready:
        return StartVerdict(up=True)
    if rp_state in _FINAL:
        why = f"RAPTOR worker {uid} ended ({rp_state}) before it came up"
    elif launch_error is not None:
        why = f"RAPTOR worker {uid}'s launch failed: {launch_error}"
    elif waited_s > limit_s:
        why = f"RAPTOR worker {uid} did not come up within {limit_s:.0f} s"
    else:
        return StartVerdict()
    return StartVerdict(why=why, give_up=failed_starts + 1 >= WORKER_STARTS)


class RaptorWorker:
    """The runtime's RAPTOR worker: start, watch its start, replace, kill, explain deaths.

    ``on_broken(error)`` is called once the worker failed to come up ``WORKER_STARTS``
    times in a row (the executor fails its RAPTOR tasks).
    """

    def __init__(self, pilot, *, ranks: int, ranks_per_node: Optional[int], start_s: float,
                 descriptions: Descriptions, restarts: List[str],
                 on_broken: Callable[[ExecutorBroken], None], stopping: Callable[[], bool]):
        self.pilot = pilot
        self.ranks = ranks
        self.ranks_per_node = ranks_per_node
        #: Seconds a replacement may take to come up (default: the runtime's startup_timeout).
        self.start_s = start_s
        self.descriptions = descriptions
        self.restarts = restarts
        self.on_broken = on_broken
        self.stopping = stopping
        self.uid = ""                  # its RP uid (RP names its hostfile after it)
        self.up = False
        self.broken: Optional[ExecutorBroken] = None
        self.root: Optional[int] = None    # pid of its mpiexec
        self.lock = threading.RLock()      # one kill-and-start at a time
        self._task = None                  # its RP task
        self._ready = ""                   # the file its rank 0 writes once up
        self._since = 0.0                  # when it was submitted (monotonic)
        self._failed_starts = 0

    def start(self, replacement: bool = False) -> None:
        """Submit a worker of ``ranks`` ranks; its rank 0 writes the ready file once every
        rank is up and it has registered with the master."""
        rp = import_rp()

        self._ready = os.path.join(self.pilot.status_dir, f"ready-{time.time_ns()}")
        description = {
            "mode": rp.RAPTOR_WORKER, "ranks": self.ranks, "raptor_class": "MPIWorker",
            # hetflow's (RP's, which unlinks its MPICH segments' names once up)
            "raptor_file": os.path.join(RAPTOR_DIR, "raptor_worker.py"),
            "environment": {**self.pilot.rank_env, "HETFLOW_RAPTOR_READY": self._ready,
                            **configs.yield_cpu_env(self.pilot.yield_cpu)},
            "pre_exec": [],
            # A rank killed from outside leaves no evidence of its own; RP's launch script
            # has its status ($RP_RET, after `wait` on $RP_RANK_PID, the rank's pid).
            "post_exec": [f"echo $RP_RET > {self.pilot.status_dir}/exit-$RP_RANK_PID"]}
        if self.ranks_per_node is not None:
            # Node-packed: a task's ranks (the worker's lowest first) share a node if they fit.
            description["ranks_per_node"] = self.ranks_per_node
        description = self.descriptions.worker(description, replacement)
        self._task = self.pilot.raptor.submit_workers(rp.TaskDescription(description))[0]
        self.uid = self._task.uid
        self._since, self.up = time.monotonic(), False

    def came_up(self, pids: Dict[int, int]) -> None:
        """The probe ran on it: it is up, and its ranks are ``pids``."""
        self.root = self.launcher(pids)
        self.up = True

    def check(self) -> None:
        """The watchdog's look at a worker that is starting (see :func:`judge_start`);
        tasks submitted meanwhile wait in the master's queue for the next worker."""
        if self.up or self.broken is not None or self.stopping():
            return
        uid = self.uid
        verdict = judge_start(uid=uid, ready=os.path.exists(self._ready),
                              rp_state=getattr(self._task, "state", None),
                              launch_error=self._srun_error(uid),
                              waited_s=time.monotonic() - self._since, limit_s=self.start_s,
                              failed_starts=self._failed_starts)
        if verdict.up:
            self.up, self._failed_starts = True, 0
        elif verdict.why:
            self.replace(uid, verdict.why)

    def launch_failure(self, uid: str) -> Optional[str]:
        """Why worker ``uid`` will never come up, from its launch's stderr; None if not."""
        error = self._srun_error(uid)
        return None if error is None else f"RAPTOR worker {uid}'s launch failed: {error}"

    def _srun_error(self, uid: str) -> Optional[str]:
        sandbox = self.pilot.task_sandbox(uid)
        if sandbox is None:
            return None
        try:
            with open(os.path.join(sandbox, f"{uid}.err"), "rb") as fh:
                text = fh.read(1 << 16).decode(errors="replace")
        except OSError:
            return None
        return next((line.strip() for line in text.splitlines() if SRUN_ERROR in line), None)

    def replace(self, uid: str, why: str) -> None:
        """Kill worker ``uid`` (unless it was replaced meanwhile) and start another; after
        ``WORKER_STARTS`` failed starts in a row, the worker is broken instead."""
        with self.lock:
            if uid != self.uid or self.up or self.stopping():
                return
            logger.warning("%s; starting a new one", why)
            self.restarts.append(why)
            # Its launcher's tree first: RP's cancel kills the launch's process group, where
            # Hydra's srun (inside Slurm) is not. Its ranks before the tree: inside Slurm
            # they are not in it (see kill_ranks).
            root = self.launcher({})
            self.kill_ranks(uid)
            if root is not None:
                kill_tree(root)
            try:
                self.pilot.tmgr.cancel_tasks(uid)   # a launch RP has not made never happens
            except Exception:  # noqa: BLE001 - best effort: its processes are killed above
                pass
            self._failed_starts += 1
            if self._failed_starts < WORKER_STARTS:
                self.start(replacement=True)
                return
            self.broken = ExecutorBroken(f"the RAPTOR worker did not come up {WORKER_STARTS} "
                                         f"times in a row (last: {why})")
        self.on_broken(self.broken)

    def recycle(self, pids_seen: List[Dict[int, int]], restart: bool) -> Optional[Exception]:
        """Kill the worker that ran tasks whose ranks were ``pids_seen`` and (``restart``)
        start a new one; the error that start raised, if any."""
        with self.lock:
            root = next(filter(None, map(launcher_of, pids_seen)), self.root) \
                or self.launcher({})
            if root is not None:
                kill_tree(root)
            self.root = None
            if restart:
                try:
                    self.start(replacement=True)
                except Exception as exc:  # noqa: BLE001 - the neighbours must learn of it
                    return exc
        return None

    def kill_for_close(self) -> None:
        """End the worker at the session's close, without waiting for RP to wind it down."""
        root = self.root or (self.launcher({}) if self.pilot.session else None)
        if self.pilot.session is not None and self.uid and not self.up:
            self.kill_ranks(self.uid)         # not in root's tree inside Slurm
        if root is not None:
            kill_tree(root, wait=False)

    def launcher(self, pids: Dict[int, int]) -> Optional[int]:
        """The pid of the worker's ``mpiexec``: an ancestor of its ranks, or (inside Slurm,
        where Hydra starts the ranks under ``slurmstepd``) the ``mpiexec`` given the worker's
        hostfile, which RP names after the worker's uid (the same in every session: only
        this runtime's sandbox holds this runtime's)."""
        found = launcher_of(pids)
        if found is None and self.uid:
            found = launcher_named(self.pilot.sandbox + os.sep, f"/{self.uid}.hf")
        return found

    def kill_ranks(self, uid: str) -> int:
        """SIGKILL the processes working in worker ``uid``'s task sandbox (its ranks and their
        launch's scripts) and remove the MPI segments they still had named; how many.

        A worker killed before it came up still has MPICH's segments named (its ranks unlink
        them once up); inside Slurm its ranks are not in its launcher's tree, whose kill
        reads the mappings, but their working dir finds them."""
        sandbox = self.pilot.task_sandbox(uid)
        if sandbox is None:
            return 0
        procs = session_processes(sandbox)
        kill_processes(procs, wait=False)
        return len(procs)

    def deaths(self, taskdir: TaskDir) -> Deaths:
        """Name how worker ranks that vanished without evidence (SIGKILL) died: RP's launch
        script records each rank's exit status (see :meth:`start`); failing that, the
        worker's Hydra prints "PID n ... EXIT CODE: c" to its stdout in the pilot sandbox.
        Both may take a moment: they are awaited up to ``EVIDENCE_S``."""
        dead = {rank: pid for rank, pid in taskdir.pids().items() if ended(pid)}
        if not dead:
            return {}
        deadline = time.monotonic() + EVIDENCE_S
        while True:
            found = rank_exit_statuses(self.pilot.status_dir, dead)
            for root, _, files in os.walk(self.pilot.sandbox):
                for name in files:
                    if not found and name.endswith(".out"):
                        found = hydra_deaths(taskdir, tail(os.path.join(root, name), 20000))
            if found:
                return found
            if time.monotonic() > deadline:
                return {rank: ("vanished (killed from outside; no exit status was visible)", "")
                        for rank in dead}
            time.sleep(0.2)


def rank_exit_statuses(status_dir: str, pids: Dict[int, int]) -> Deaths:
    """``{rank: (description, "")}`` for worker ranks whose exit status RP's launch script
    recorded: ``128 + s`` is bash's status of a process killed by signal ``s``."""
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


def worker_lost(taskdir: TaskDir) -> bool:
    """Whether a rank of the worker running this task has ended (they never do while the
    worker lives)."""
    return any(ended(pid) for pid in taskdir.pids().values())
