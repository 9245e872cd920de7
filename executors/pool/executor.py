"""hetflow's own pilot: a persistent MPI pool with a fresh communicator per task.

One ``mpiexec -n N`` world starts with the executor; its ranks (workers, see
:mod:`.worker`) register over ZeroMQ and take tasks from the kernel's queue
(placed by :class:`.scheduler.PoolScheduler`). Each task runs on the ranks it was given
through a communicator built over exactly those ranks, with the shared rank-side
runner, so values and errors are those of every other executor. No process
launch, no interpreter start per task.

Faults. The world runs with Hydra's ``-disable-auto-cleanup``, so one rank's
death does not take the others down (a second one does: Hydra then ends the world,
see ``Worlds.taken_down``). The pool notices a dead rank (its pid is
gone, its launcher exited, or its heartbeats stopped), fails the task that killed
it with :class:`~hetflow.TaskLost` naming that rank and how it ended (each rank's
supervisor process records its exit code or signal: Hydra reports nothing until
the whole world ends), stops the task's other ranks (they may wait in
a collective forever: MPI cannot interrupt them), and starts a small replacement
world of the same number of ranks; running tasks elsewhere carry on. When a task
needs more ranks than any one world has left, the pool drains and restarts as one
world of N. A task past its ``walltime``, or cancelled while running, has its ranks
stopped and replaced the same way. Every such step is logged and kept in
:attr:`PoolExecutor.events`. Tasks whose ranks died only because their whole
world went down (not their fault) are re-queued, not failed. Who fails, who
re-runs and what is replaced is decided in :mod:`.faults`.

Threads. The thread submitting a task (Parsl's task launcher) or freeing slots (the
broker) takes slots for it and calls :meth:`PoolExecutor._start`; that and every other
request (stop, consolidate, release resident data) is posted to the broker thread
(:mod:`.broker`), the single owner of the worlds, the slots and the ZeroMQ socket. The
broker touches the kernel's scheduler only through the kernel's ``placement()``; slot
state changes only through :class:`~.worlds.Worlds`' methods.

Multi-node: pass ``hostfile=`` (Hydra ``-f``; lines ``host:slots``) or a launcher
prefix such as ``launcher=["srun", "--ntasks={ranks}", "--kill-on-bad-exit=0"]``
inside an allocation; the ranks connect back to ``address`` (an interface the
compute nodes reach, e.g. the head node's IP). Ranks on other hosts are watched
through heartbeats (lost after ``lost_after_s`` of silence) and stopped through
their control thread; ranks exit by themselves when the client disappears.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from hetflow._progress import waiting
from hetflow.errors import ConfigError, ExecutorBroken, LaunchError, ResourcesUnavailable
from hetflow.executors import _rankio
from hetflow.executors.kernel import Executor, Task
from hetflow.executors.launch import default_mpiexec
from hetflow.executors.pool import wire
from hetflow.executors.pool.broker import Broker
from hetflow.executors.pool.reshape import launch_full
from hetflow.executors.pool.scheduler import PoolScheduler
from hetflow.executors.pool.worlds import Slot, World, Worlds, launcher_prefix
from hetflow.executors.providers import Provider, runtime_place
from hetflow.executors.taskdir import write_private
from hetflow.resident import find_handles
from hetflow.spec import Resources

logger = logging.getLogger(__name__)

__all__ = ["PoolExecutor"]


@dataclass(eq=False)
class _Run:
    """The pool's own part of a task (``task.handle``): what the kernel's Task does not hold;
    made when the task starts (at submit for a pinned task), so a queued task has none."""

    pinned: Optional[tuple] = None      # slots holding its resident arguments
    outcomes: dict = field(default_factory=dict)   # task rank -> outcome, as ranks report
    requeues: int = 0
    peer_grace: object = None           # the failed-peer deadline, once a rank raised
    sent: float = 0.0                   # when it was last sent to its ranks (time.time())


def _pinned_of(task: Task) -> Optional[tuple]:
    """The slots ``task`` must run on (its resident arguments'), or None."""
    run = task.handle
    return None if run is None else run.pinned


class PoolExecutor(Executor):
    """A Parsl executor running MPI tasks on one long-lived MPI world of ``max_ranks`` ranks.

    max_ranks: ranks in the world (default: this machine's cores); tasks take 1..max_ranks.
    hostfile: a Hydra hostfile (``host:slots`` lines) to spread the world over nodes.
    launcher: a full launcher prefix instead of mpiexec, ``{ranks}`` replaced by the
        count, e.g. ``["srun", "--ntasks={ranks}", "--cpu-bind=cores"]``.
    address: the interface ranks connect back to (default loopback; a node's
        reachable address for multi-node pools).
    pin: pin each rank to one core (``os.sched_setaffinity``) when the OS allows.
    gpus: the GPUs of each node (a count, or their ids; default: this machine's).
    gpus_per_rank: GPUs each rank binds for life at its start (default 1 when there are
        GPUs, else 0): a node's first ``gpus // gpus_per_rank`` ranks hold a block each, the
        others none (``CUDA_VISIBLE_DEVICES=""``). GPU tasks run only on ranks holding
        devices, so tasks running at once never share one; CPU tasks prefer the others.
    heartbeat_s / lost_after_s: rank heartbeats, and the silence that marks a remote rank lost.
    start_timeout: seconds for a world to register before LaunchError.
    provider: where the world runs (:mod:`hetflow.executors.providers`): this machine, the
        allocation hetflow runs in, or a batch job of its own. ``slurm={"nodes": 2,
        "ntasks": 4, "partition": ..., "time": "30"}`` is short for
        ``provider=SlurmJob(...)``: the pool asks Slurm for an allocation as a batch user
        would from a login node, runs the world in it with ``srun --jobid``, and gives it
        back at shutdown; ``max_ranks`` defaults to ``ntasks``, else the nodes' CPUs.
    max_kept_comms: a rank keeps the communicators of the tasks that failed on it (freeing
        one a peer may still have sent on is unsafe, see ``_rank.release_comm``), and each
        holds one of the MPI's context ids (MPICH has about 2,048); a world one of whose ranks
        keeps this many is replaced by a fresh one once idle (``recycled`` counts them). The
        default leaves room for the 512 cached communicators of the tasks' rank sets.
    authenticate: sign and check every message on the pool's socket (see ``wire``);
        False only to measure what that costs (``experiments/pool_bench.py --auth``).

    ``rejected`` counts the messages dropped because they were not signed with the
    runtime's key (the first is logged): anyone who can reach ``address`` can connect,
    but nothing they send is read.
    """

    unsupported: Dict[str, str] = {}
    dispatch_on_release = True          # the broker starts what fits on the slots it frees
    dispatch_on_submit = True           # _start only posts to the broker: no hand-off first
    own_stacks = True                   # a rank's stack file is its own; outcomes say returned

    def __init__(self, label: str = "pool", *, max_ranks: Optional[int] = None,
                 hostfile: Optional[str] = None, launcher: Optional[Sequence[str]] = None,
                 mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = (),
                 address: str = "127.0.0.1", pin: bool = True, gpus=None,
                 gpus_per_rank: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 python: Optional[str] = None, heartbeat_s: float = 1.0,
                 lost_after_s: float = 10.0, start_timeout: float = 120.0, max_bypass: int = 16,
                 slurm: Optional[dict] = None, provider: Optional[Provider] = None,
                 authenticate: bool = True, max_kept_comms: int = 512):
        place = runtime_place(slurm, provider, max_ranks, gpus, by_start=True)
        self.runs_on, where = place.provider, place.provider.placement(None)
        if where.launcher is not None:    # a place of its own: its launcher
            if hostfile is not None or launcher is not None:
                raise ConfigError("give slurm=/provider= (the pool asks for its own "
                                  "allocation) or hostfile=/launcher=, not both")
            launcher = where.launcher
        super().__init__(label, max_ranks=place.max_ranks, max_bypass=max_bypass,
                         gpus=place.gpus)
        if hostfile is not None and not os.path.isfile(hostfile):
            raise ConfigError(f"hostfile {hostfile!r} does not exist")
        if hostfile is not None and launcher is not None:
            raise ConfigError("give hostfile= (for mpiexec) or launcher=, not both")
        self.hostfile = os.path.abspath(hostfile) if hostfile else None
        self.launcher = list(launcher) if launcher else None
        self.mpiexec = mpiexec or (None if launcher else default_mpiexec())
        self.mpiexec_args = tuple(mpiexec_args)
        self.address = address
        self.pin = pin
        self.gpus_per_rank = (1 if self.gpus else 0) if gpus_per_rank is None else gpus_per_rank
        self.python = python or sys.executable
        self.heartbeat_s = heartbeat_s
        self.lost_after_s = lost_after_s
        self.start_timeout = start_timeout
        self.extra_env = dict(env or {})
        self.authenticate = authenticate
        if max_kept_comms < 1:
            raise ConfigError(f"max_kept_comms must be at least 1, not {max_kept_comms}")
        self.max_kept_comms = max_kept_comms
        self._signer = wire.Signer(None)
        self.uid = uuid.uuid4().hex[:12]
        #: What the pool did about faults, in order (also logged as warnings).
        self.events: List[str] = []
        self._broker: Optional[Broker] = None
        self._mpi: Optional[Worlds] = None       # the broker's (snapshots: _worlds, _slots)
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ kernel hooks
    def _make_scheduler(self, max_bypass: int) -> PoolScheduler:
        return PoolScheduler(max_bypass, pinned_of=_pinned_of,
                             gpus_of=lambda task: task.resources.gpus_per_rank)

    def _slots_needed(self, resources: Resources) -> int:
        return resources.ranks

    def check_resources(self, resources: Resources) -> None:
        if resources.ranks > self.max_ranks:
            raise ResourcesUnavailable(
                f"task needs {resources.ranks} rank(s), but pool {self.label!r} has "
                f"max_ranks={self.max_ranks}")
        if resources.gpus_per_rank > self.gpus_per_rank:
            raise ResourcesUnavailable(
                f"task needs {resources.gpus_per_rank} GPU(s) per rank, but pool "
                f"{self.label!r} binds {self.gpus_per_rank} per rank "
                f"(GPUs: {self.gpu_ids})")
        gpu_ranks = self.gpus // self.gpus_per_rank if self.gpus_per_rank else 0
        if (resources.gpus_per_rank and self.hostfile is None and self.launcher is None
                and resources.ranks > min(gpu_ranks, self.max_ranks)):
            raise ResourcesUnavailable(
                f"task needs {resources.ranks} rank(s) with GPUs, but pool {self.label!r} "
                f"has {min(gpu_ranks, self.max_ranks)} (GPUs {self.gpu_ids}, "
                f"{self.gpus_per_rank} per rank)")

    def _admit(self, task: Task, args: tuple, kwargs: dict) -> None:
        if self._broken:
            raise ExecutorBroken(f"executor {self.label!r} is broken: {self._broken}")
        pinned = self._pinned(task.resources, args, kwargs)
        if pinned is not None and task.resources.gpus_per_rank:
            with self.placement() as scheduler:
                without = [s for s in pinned if s not in scheduler.gpu_slots]
            if without:
                raise ConfigError(f"the task asks for GPUs, but its resident data lives on "
                                  f"pool slots {without}, whose ranks hold none")
        if pinned is not None:          # else made when it starts: none while it waits
            task.handle = _Run(pinned=pinned)

    def _start_runtime(self) -> None:
        self.runs_on.start(f"hetflow-{self.label}", self.max_ranks)
        where = self.runs_on.placement(self.max_ranks)     # (the launcher, once granted)
        self.launcher = list(where.launcher or ()) or self.launcher
        self.extra_env = {**where.env, **self.extra_env}

        # The key reaches the ranks as a 0600 file in the 0700 run dir (works on a shared
        # file system for multi-node pools); its path, never the key, is in their environment.
        self._signer = wire.Signer.new() if self.authenticate else wire.Signer(None)
        self._keyfile = ""
        if self._signer.key is not None:
            self._keyfile = os.path.join(self.run_root, "pool.key")
            write_private(self._keyfile, self._signer.key)
        self._broker = Broker(self, self.address, self._signer, lambda endpoint, send: Worlds(
            self.run_root, endpoint, python=self.python, pin=self.pin, mpiexec=self.mpiexec,
            send=send, lost_after_s=self.lost_after_s, env=self._world_env(),
            command=functools.partial(launcher_prefix, launcher=self.launcher,
                                      mpiexec=self.mpiexec, mpiexec_args=self.mpiexec_args,
                                      hostfile=self.hostfile)))
        self.endpoint = self._broker.endpoint
        self._mpi = self._broker.mpi
        launch_full(self._broker)
        self._thread = self._broker.thread
        self._thread.start()
        with waiting("the pool's ranks to register"):
            ready = self._broker.ready.wait(self.start_timeout)
        if not ready or self._broken:
            why = self._broken or (f"not all {self.max_ranks} ranks registered in "
                                   f"{self.start_timeout} s")
            world = self._mpi.worlds.get(0)
            self.shutdown()
            raise LaunchError(f"pool {self.label!r} did not start: {why}",
                              command=world.command if world else None,
                              logs=[world.stderr] if world else ())

    def _start(self, task: Task) -> None:
        if task.handle is None:
            task.handle = _Run()
        self._broker.post(("start", task))

    def _stop(self, task: Task, error: Optional[BaseException]) -> None:
        self._broker.post(("stop", task))

    def _head_blocked(self, task: Task) -> None:
        self._broker.head_blocked()

    def _stop_runtime(self) -> None:
        try:
            if self._broker is not None:
                self._broker.stop()
        finally:
            self.runs_on.stop()

    # ------------------------------------------------------------------ public
    def release_resident(self, handle) -> None:
        """Drop the object behind a :class:`~hetflow.Resident` handle from its ranks."""
        self._broker.post(("release", handle))

    @property
    def rejected(self) -> int:
        """Messages dropped for a wrong or missing signature (see the class docstring)."""
        return self._broker.rejected if self._broker is not None else 0

    @property
    def recycled(self) -> int:
        """Worlds replaced because a rank kept ``max_kept_comms`` communicators."""
        return self._broker.recycled if self._broker is not None else 0

    @property
    def _broken(self) -> Optional[str]:
        return self._broker.broken if self._broker is not None else None

    @property
    def batch(self):
        """The Slurm allocation the pool asked for (``slurm=``), once granted."""
        return getattr(self.runs_on, "batch_allocation", None)

    @property
    def world_sizes(self) -> Dict[int, int]:
        """Live ranks per MPI world (one world of max_ranks unless ranks were replaced)."""
        with self.placement() as scheduler:
            return scheduler.world_sizes()

    # Snapshots for observers on other threads (tests); the broker uses self._mpi's own.
    @property
    def _worlds(self) -> Dict[int, World]:
        return dict(self._mpi.worlds) if self._mpi is not None else {}

    @property
    def _slots(self) -> Dict[int, Slot]:
        return dict(self._mpi.slots) if self._mpi is not None else {}

    def _stack_files(self, task: Task) -> Optional[dict]:
        """The running task's ranks on this node, with the stack file each keeps for life."""
        here, slots = socket.gethostname(), self._slots
        known = {}
        for rank, slot_id in enumerate(task.slots):
            slot = slots.get(slot_id)
            if slot is not None and slot.host == here and slot.pid and self.node_root:
                known[rank] = (slot.pid, os.path.join(self.node_root, _rankio.process_stack_name(
                    slot.world, slot.wrank, slot.pid)))
        return known

    # ------------------------------------------------------------------ client-side helpers
    def _pinned(self, resources, args, kwargs) -> Optional[tuple]:
        handles = find_handles(args, kwargs)
        if not handles:
            return None
        for h in handles:
            if h.pool != self.uid:
                raise ConfigError(f"{h!r} was made by another pool (or a restarted one): resident "
                                  "data lives only in the pool whose task kept it")
        slots = {h.slots for h in handles}
        if len(slots) > 1:
            raise ConfigError(f"a task's resident arguments must live on the same ranks; got "
                              f"{sorted(list(s) for s in slots)}")
        (pinned,) = slots
        if resources.ranks != len(pinned):
            raise ConfigError(
                f"resident data lives on {len(pinned)} rank(s) (pool slots {list(pinned)}), but "
                f"the task asks for ranks={resources.ranks}: it must run on those same ranks")
        return pinned

    def _world_env(self) -> dict:
        return {**os.environ, **self.extra_env,
                "HETFLOW_POOL_UID": self.uid,
                wire.KEY_ENV: self._keyfile,
                "HETFLOW_POOL_SYSPATH": os.pathsep.join(self.client_sys_path()),
                "HETFLOW_POOL_CLIENT_PID": str(os.getpid()),
                "HETFLOW_POOL_CLIENT_HOST": socket.gethostname(),
                "HETFLOW_POOL_STACKS": self.node_root or "",
                "HETFLOW_POOL_HEARTBEAT": str(self.heartbeat_s),
                "HETFLOW_POOL_GPUS_PER_RANK": str(self.gpus_per_rank)}

