"""hetflow's own pilot: a persistent MPI pool with a fresh communicator per task.

One ``mpiexec -n N`` world starts with the executor; its ranks (workers, see
``worker.py``) register over ZeroMQ and take tasks from the kernel's queue
(placed by ``scheduler.PoolScheduler``). Each task runs on the ranks it was given
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
re-runs and what is replaced is decided in ``faults``.

Threads. The kernel's dispatch thread takes slots for a task and calls
:meth:`PoolExecutor._start`; that and every other request (stop, consolidate,
release resident data) is posted to the broker thread, the single owner of the
worlds, the slots and the ZeroMQ socket. The broker touches the kernel's
scheduler only through the kernel's ``placement()``.

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
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from hetflow import errors
from hetflow.errors import ConfigError, ExecutorBroken, LaunchError, ResourcesUnavailable
from hetflow.executors.pool import wire
from hetflow.executors.pool.faults import RunningTask, settle_lost
from hetflow.executors.pool.scheduler import PoolScheduler
from hetflow.executors.providers import Provider, provider_for
from hetflow.executors.pool.worlds import (TEARDOWN_GRACE_S, Slot, World, Worlds,
                                             launcher_prefix)
from hetflow.executors._rank import collect
from hetflow.executors.kernel import Executor, Task
from hetflow._progress import waiting
from hetflow.executors.launch import default_mpiexec, tail
from hetflow.executors.taskdir import write_private
from hetflow.executors.watch import PEER_GRACE_S
from hetflow.resident import find_handles
from hetflow.spec import Resources

logger = logging.getLogger(__name__)

#: Distinct rank sets whose communicators a world caches (each is a few KiB).
COMM_CACHE = 512


@dataclass(eq=False)
class _Run:
    """The pool's own part of a task (``task.handle``): what the kernel's Task does not hold."""

    pinned: Optional[tuple] = None      # slots holding its resident arguments
    outcomes: dict = field(default_factory=dict)   # task rank -> outcome, as ranks report
    requeues: int = 0
    peer_grace: object = None           # the failed-peer deadline, once a rank raised


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
    authenticate: sign and check every message on the pool's socket (see ``wire``);
        False only to measure what that costs (``experiments/pool_bench.py --auth``).

    ``rejected`` counts the messages dropped because they were not signed with the
    runtime's key (the first is logged): anyone who can reach ``address`` can connect,
    but nothing they send is read.
    """

    unsupported: Dict[str, str] = {}
    dispatch_on_release = True          # the broker starts what fits on the slots it frees

    def __init__(self, label: str = "pool", *, max_ranks: Optional[int] = None,
                 hostfile: Optional[str] = None, launcher: Optional[Sequence[str]] = None,
                 mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = (),
                 address: str = "127.0.0.1", pin: bool = True, gpus=None,
                 gpus_per_rank: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 python: Optional[str] = None, heartbeat_s: float = 1.0,
                 lost_after_s: float = 10.0, start_timeout: float = 120.0, max_bypass: int = 16,
                 slurm: Optional[dict] = None, provider: Optional[Provider] = None,
                 authenticate: bool = True):
        self.runs_on = provider_for(slurm, provider)
        self.runs_on.check("pool")
        if self.runs_on.pool_launcher() is not None:    # a place of its own: its launcher
            if hostfile is not None or launcher is not None:
                raise ConfigError("give slurm=/provider= (the pool asks for its own "
                                  "allocation) or hostfile=/launcher=, not both")
            launcher = self.runs_on.pool_launcher()
        if max_ranks is None:
            max_ranks = self.runs_on.default_slots("pool")
        super().__init__(label, max_ranks=max_ranks, max_bypass=max_bypass,
                         gpus=self.runs_on.gpus_per_node() if gpus is None else gpus)
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
        #: Messages dropped for a wrong or missing signature (see the class docstring).
        self.rejected = 0
        self._signer = wire.Signer(None)
        self.uid = uuid.uuid4().hex[:12]
        #: What the pool did about faults, in order (also logged as warnings).
        self.events: List[str] = []
        self._mpi: Optional[Worlds] = None
        self._tasks: Dict[int, Task] = {}        # broker's: tasks with ranks busy for them
        self._inbox: deque = deque()
        self._inbox_lock = threading.Lock()
        self._wake_pending = False
        self._blocked_pending = False
        self._consolidating = False
        self._broken: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()

    # ------------------------------------------------------------------ kernel hooks
    def _make_scheduler(self, max_bypass: int) -> PoolScheduler:
        return PoolScheduler(max_bypass, pinned_of=lambda task: task.handle.pinned,
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
        task.handle = _Run(pinned=pinned)

    def _start_runtime(self) -> None:
        import zmq

        self.runs_on.start("pool", f"hetflow-{self.label}", self.max_ranks)
        self.launcher = self.runs_on.pool_launcher() or self.launcher

        # The key reaches the ranks as a 0600 file in the 0700 run dir (works on a shared
        # file system for multi-node pools); its path, never the key, is in their environment.
        self._signer = wire.Signer.new() if self.authenticate else wire.Signer(None)
        self._keyfile = ""
        if self._signer.key is not None:
            self._keyfile = os.path.join(self.run_root, "pool.key")
            write_private(self._keyfile, self._signer.key)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self._router.bind_to_random_port(f"tcp://{self.address}")
        self.endpoint = f"tcp://{self.address}:{port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._mpi = Worlds(
            self.run_root, self.endpoint, python=self.python, pin=self.pin, mpiexec=self.mpiexec,
            send=self._send, lost_after_s=self.lost_after_s, env=self._world_env(),
            command=functools.partial(launcher_prefix, launcher=self.launcher,
                                      mpiexec=self.mpiexec, mpiexec_args=self.mpiexec_args,
                                      hostfile=self.hostfile))
        self._mpi.launch(self.max_ranks, cores=list(range(self.max_ranks)),
                         devices=self._devices())
        self._thread = threading.Thread(target=self._loop, name=f"{self.label}-broker", daemon=True)
        self._thread.start()
        with waiting("the pool's ranks to register"):
            ready = self._ready.wait(self.start_timeout)
        if not ready or self._broken:
            why = self._broken or (f"not all {self.max_ranks} ranks registered in "
                                   f"{self.start_timeout} s")
            world = self._mpi.worlds.get(0)
            self.shutdown()
            raise LaunchError(f"pool {self.label!r} did not start: {why}",
                              command=world.command if world else None,
                              logs=[world.stderr] if world else ())

    def _start(self, task: Task) -> None:
        self._post(("start", task))

    def _stop(self, task: Task, error: Optional[BaseException]) -> None:
        self._post(("stop", task))

    def _head_blocked(self, task: Task) -> None:
        if not self._blocked_pending:      # one pending look is enough: it reads the head anew
            self._blocked_pending = True
            self._post(("blocked",))

    def _stop_runtime(self) -> None:
        try:
            self._stop_worlds()
        finally:
            self.runs_on.stop()

    def _stop_worlds(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._post(("exit",))
            self._thread.join(timeout=30)
        elif self._mpi is not None:
            self._mpi.close()
        if self._mpi is None:
            return
        try:
            self._router.close(0)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    # ------------------------------------------------------------------ public
    def release_resident(self, handle) -> None:
        """Drop the object behind a :class:`~hetflow.Resident` handle from its ranks."""
        self._post(("release", handle))

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
                "HETFLOW_POOL_HEARTBEAT": str(self.heartbeat_s),
                "HETFLOW_POOL_GPUS_PER_RANK": str(self.gpus_per_rank)}

    def _devices(self):
        """The GPU ids a new full world binds on each node (None: no GPUs, left alone)."""
        return list(self.gpu_ids) if self.gpus else None

    def _post(self, command) -> None:
        with self._inbox_lock:
            self._inbox.append(command)
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            try:
                os.write(self._wake_w, b"!")
            except OSError:
                pass

    def _event(self, text: str) -> None:
        self.events.append(text)
        logger.warning("%s: %s", "pool" if self.label == "pool" else f"pool {self.label!r}", text)

    # ------------------------------------------------------------------ broker loop
    def _send(self, identity: bytes, frames, copy: bool = True) -> bool:
        import zmq
        try:
            self._router.send_multipart([identity] + self._signer.sign(wire.TO_RANK, identity,
                                                                       frames), copy=copy)
            return True
        except zmq.ZMQError:          # peer gone (ROUTER_MANDATORY): the monitor will notice
            return False

    def _loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_check = 0.0
        try:
            while True:
                busy = bool(self._tasks) or self._consolidating
                events = dict(poller.poll(max(0, int((next_check - time.monotonic()) * 1000) + 1)))
                if self._wake_r in events and self._drain_inbox():
                    return
                if self._router in events:
                    self._drain_router()
                now = time.monotonic()
                if now >= next_check:
                    self._check_health()
                    next_check = now + (0.2 if busy else 1.0)
        except BaseException as exc:  # a dead broker must fail every future (logged)
            logger.exception("pool broker crashed")
            self._broken = f"broker thread crashed: {type(exc).__name__}: {exc}"
            self._ready.set()
            self._fail_all()
            self._mpi.close()

    def _drain_inbox(self) -> bool:
        """Run what other threads asked for; True when told to exit."""
        try:
            os.read(self._wake_r, 4096)
        except (BlockingIOError, OSError):
            pass
        with self._inbox_lock:
            commands = list(self._inbox)
            self._inbox.clear()
            self._wake_pending = False
        for kind, *args in commands:
            if kind == "start":
                self._dispatch(*args)
            elif kind == "stop":
                self._on_stop(*args)
            elif kind == "peers":
                self._on_peer_grace(*args)
            elif kind == "blocked":
                self._blocked_pending = False
                self._unblock()
            elif kind == "release":
                for slot_id in args[0].slots:
                    slot = self._mpi.slots.get(slot_id)
                    if slot is not None and slot.alive:
                        self._send(slot.identity, [wire.DROP, args[0].key.encode()])
            elif kind == "exit":
                self._mpi.close()
                return True
        return False

    def _drain_router(self) -> None:
        import zmq

        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]
            message = self._signer.check(wire.TO_POOL, identity, frames[1:])
            if message is None:
                self._reject(identity)
                continue
            try:
                self._on_message(identity, message)
            except Exception as exc:  # noqa: BLE001 - a signed but malformed message
                self._malformed(identity, message[0], exc)

    def _on_message(self, identity: bytes, message: list) -> None:
        kind = message[0]
        if kind == wire.HEARTBEAT:
            slot = self._mpi.slot_of(identity)
            if slot is not None:
                slot.last_seen = time.monotonic()
            self._send(identity, [wire.HEARTBEAT_ACK])
        elif kind == wire.OUTCOME:
            if len(message) != 4:
                raise ValueError(f"{len(message) - 1} frame(s) after the kind, not 3")
            self._on_outcome(identity, *wire.read_outcome(*message[1:]))
        elif kind == wire.REGISTER:
            if len(message) != 2:
                raise ValueError(f"{len(message) - 1} frame(s) after the kind, not 1")
            self._register(identity, wire.read_register(message[1]))
        else:
            raise ValueError(f"unknown message kind {kind[:16]!r}")

    def _reject(self, identity: bytes) -> None:
        """An unsigned (or wrongly signed) message: dropped unread, counted, logged once."""
        self.rejected += 1
        if self.rejected == 1:
            logger.warning("%s: dropped a message that was not signed with the runtime's "
                           "key (peer identity %r); later ones are only counted in "
                           "executor.rejected", "pool" if self.label == "pool" else f"pool {self.label!r}",
                           identity[:40])

    def _malformed(self, identity: bytes, kind: bytes, exc: Exception) -> None:
        """A rank signed a message it should not have sent: the rank is broken. Its task
        fails with TaskLost, and the rank is stopped and replaced like a dead one."""
        slot = self._mpi.slot_of(identity)
        why = f"rank sent a malformed {bytes(kind[:16])!r} message ({type(exc).__name__}: {exc})"
        if slot is None or not slot.alive:
            self._event(f"unregistered peer {identity[:40]!r}: {why}; ignored")
            return
        self._mpi.kill(slot)
        self._lost([slot.id], why)

    # ------------------------------------------------------------------ slots (under the lock)
    def _free(self, slot_ids) -> None:
        """Give idle slots back to the queue (not those of a retiring world, nor dead ones)."""
        free = [s for s in slot_ids if self._mpi.slots[s].alive
                and not self._mpi.worlds[self._mpi.slots[s].world].retiring]
        if free:
            self.release(free)

    def _register(self, identity: bytes, info: dict) -> None:
        slot = self._mpi.register(identity, info)
        if slot is None:
            return
        with self.placement() as scheduler:
            scheduler.add_slot(slot.id, slot.world, slot.host, slot.wrank,
                               gpu=bool(slot.devices))
        self.release([slot.id])
        world = self._mpi.worlds[slot.world]
        if world.id == 0 and not world.unregistered:
            self._ready.set()

    def _remove_slots(self, slot_ids) -> None:
        with self.placement(wake=True) as scheduler:   # the head may be blocked for good now
            for slot_id in slot_ids:
                scheduler.remove_slot(slot_id)

    # ------------------------------------------------------------------ running tasks
    def _dispatch(self, task: Task) -> None:
        """Send a task the kernel placed to its ranks."""
        slots = [self._mpi.slots.get(s) for s in task.slots]
        if task.done:                       # cancelled (or shut down) on its way here
            self._free([s.id for s in slots if s is not None])
            return
        if any(s is None or not s.alive for s in slots):
            # Its ranks were lost (or retired) between placement and here: it never ran.
            self._free([s.id for s in slots if s is not None])
            self.requeue(task)
            return
        world = self._mpi.worlds[slots[0].world]
        ranks = tuple(s.wrank for s in slots)
        cache = ranks in world.comm_keys or len(world.comm_keys) < COMM_CACHE
        if cache:
            world.comm_keys.add(ranks)
        frames = wire.task_frames(task.id, ranks, tuple(task.slots), cache,
                                  world.comm_generation.get(ranks, 0),
                                  task.resources.cores_per_rank, task.payload)
        copy = len(task.payload) < wire.ZERO_COPY_BYTES
        task.handle.outcomes = {}
        self._tasks[task.id] = task
        unreachable = []
        for slot in slots:
            slot.task = task.id
            if not self._send(slot.identity, frames, copy=copy):
                unreachable.append(slot.id)
        if unreachable:   # the rank vanished since it last spoke: same as a death under the task
            self._lost(unreachable, "rank unreachable when the task was sent", collateral=True)

    def _on_outcome(self, identity: bytes, task_id: int, outcome) -> None:
        slot = self._mpi.slot_of(identity)
        if slot is None:
            return
        slot.last_seen = time.monotonic()
        task = self._tasks.get(task_id)
        if slot.task == task_id and task is not None:
            slot.task = None
            if not outcome.ok:              # before the slot is free for another task
                self._retire_comm(task)
            self._free([slot.id])
            run: _Run = task.handle
            outcome.rank = task.slots.index(slot.id)
            run.outcomes[outcome.rank] = outcome
            if len(run.outcomes) == len(task.slots):
                self._deliver(task)
                self._forget(task)
            elif not outcome.ok and not task.done:
                # A rank raised: that is the task's result. Its peers may wait in a
                # collective for it; those still busy after the grace are stopped.
                self._deliver(task)
                run.peer_grace = self.call_later(
                    PEER_GRACE_S, lambda: self._post(("peers", task)))
        self._try_finish_consolidation()

    def _retire_comm(self, task: Task) -> None:
        """A rank failed the task: its ranks never use that task's communicator again (a
        peer's unreceived message may wait on it), each creating a new one next time."""
        slots = [self._mpi.slots[s] for s in task.slots]
        world = self._mpi.worlds.get(slots[0].world)
        if world is not None:
            ranks = tuple(s.wrank for s in slots)
            world.comm_generation[ranks] = world.comm_generation.get(ranks, 0) + 1

    def _deliver(self, task: Task, deaths=None, lost: str = "") -> None:
        """Deliver the task's result from its ranks' outcomes (``lost``: the ranks it lost)."""
        run: _Run = task.handle
        value, error = None, None
        detail = f"; lost {lost}; the pool replaces the lost rank(s)" if lost else ""
        try:
            value = collect(run.outcomes, task.id, task.resources, self.label, deaths=deaths,
                            detail=detail)
        except BaseException as exc:  # noqa: BLE001 - the task's typed error
            error = exc
        self.finish(task, value, error, root=run.outcomes.get(0), release=False)

    def _forget(self, task: Task) -> None:
        """Drop the broker's record of a delivered task once none of its ranks is busy for it."""
        if not any(self._mpi.slots[s].task == task.id for s in task.slots):
            if task.handle.peer_grace is not None:
                task.handle.peer_grace.cancel()
            self._tasks.pop(task.id, None)

    def _busy_for(self, task: Task) -> List[int]:
        slots = self._mpi.slots
        return [s for s in task.slots if slots[s].alive and slots[s].task == task.id]

    def _on_stop(self, task: Task) -> None:
        """The kernel's verdict (walltime, cancel, shutdown): stop the ranks, deliver it."""
        if self._tasks.get(task.id) is task:
            victims = self._busy_for(task)
            if victims:
                why = str(task.error).splitlines()[0] if task.error else f"task {task.id} stopped"
                self._stop_ranks(task, victims, why)
        self.dequeue(task)                 # re-queued meanwhile: it stops all the same
        if task.error is not None:
            self.finish(task, release=False)
        else:
            self._deliver(task)
        if self._tasks.get(task.id) is task:
            self._forget(task)

    def _on_peer_grace(self, task: Task) -> None:
        if self._tasks.get(task.id) is not task:
            return
        stuck = self._busy_for(task)
        if stuck:
            self._stop_ranks(task, stuck, f"rank(s) of failed task {task.id} still waited for "
                             f"their peers {PEER_GRACE_S} s after it failed")
        self._forget(task)

    def _stop_ranks(self, task: Task, victims: List[int], why: str) -> None:
        """Kill ranks busy for ``task`` (MPI cannot interrupt them) and replace them."""
        for slot_id in victims:
            self._mpi.kill(self._mpi.slots[slot_id])
        self._lost(victims, why, blame=task.id)

    # ------------------------------------------------------------------ faults
    def _lost(self, slot_ids: List[int], why: str, *, collateral: bool = False,
              blame: Optional[int] = None) -> None:
        """Ranks are gone: settle their tasks (see ``faults``) and start replacements."""
        busy = {s.id: s.task for s in self._mpi.slots.values() if s.alive and s.task is not None}
        running = {busy[s]: self._tasks[busy[s]] for s in slot_ids
                   if s in busy and busy[s] in self._tasks}
        plan = settle_lost(
            slot_ids, busy,
            {tid: RunningTask(tuple(t.slots), t.done, t.handle.requeues)
             for tid, t in running.items()},
            self._mpi.evidence([t.slots for t in running.values()], slot_ids),
            collateral=collateral, blame=blame)
        for slot_id in plan.stop:
            self._mpi.kill(self._mpi.slots[slot_id])
        for slot_id in plan.lost:
            self._mpi.slots[slot_id].alive = False
            self._mpi.slots[slot_id].task = None
        self._remove_slots(plan.lost)
        for task_id in plan.forget:
            self._forget(running[task_id])
        for task_id in plan.requeue:
            task = running[task_id]
            task.handle.requeues += 1
            self._event(f"task {task_id} lost its ranks when world "
                        f"{self._mpi.slots[plan.dead[task_id][0]].world} went down ({why}); "
                        f"re-queued (attempt {task.handle.requeues + 1})")
            self._tasks.pop(task_id, None)
            self.requeue(task)
        if plan.lost and not self.stopping and not self._consolidating:
            # The replacement's ranks take over the lost ranks' cores and devices (these
            # first: a world binds its devices to its first local ranks).
            lost = sorted(plan.lost, key=lambda s: not self._mpi.slots[s].devices)
            cores = [c for c in (self._mpi.slots[s].core for s in lost) if c is not None]
            devices = [d for s in lost for d in self._mpi.slots[s].devices.split(",") if d]
            world = self._mpi.launch(len(lost), cores=cores,
                                     devices=devices if self.gpus else None)
            self._event(f"{len(plan.lost)} rank(s) lost ({why}): started replacement world "
                        f"{world.id} of {len(plan.lost)} rank(s)")
        for task_id, deaths in plan.fail.items():   # last: the replacement is under way
            task = running[task_id]
            desc = ", ".join(f"pool slot {s} (world {self._mpi.slots[s].world} rank "
                             f"{self._mpi.slots[s].wrank}, pid {self._mpi.slots[s].pid})"
                             for s in plan.dead[task_id])
            self._event(f"task {task_id}: {desc} died ({why}); task failed, rank(s) replaced")
            self._deliver(task, deaths, lost=f"{desc} ({why})")
            self._forget(task)

    def _check_health(self) -> None:
        now = time.monotonic()
        for world in list(self._mpi.worlds.values()):
            if self._mpi.overdue(world, now, self.start_timeout):
                self._event(f"world {world.id} did not register its {world.size} rank(s) within "
                            f"{self.start_timeout} s; stopped it:\n{tail(world.stderr)}")
                self._mpi.stop(world)
            exited = world.proc.poll() is not None
            if exited and world.unregistered and not world.retiring:
                text = tail(world.stderr)
                if world.id == 0 and not self._ready.is_set():
                    self._broken = (f"the MPI world exited ({world.proc.returncode}) before its "
                                    f"ranks registered:\n{text}")
                    self._ready.set()
                    return
                self._event(f"replacement world {world.id} exited (code {world.proc.returncode}) "
                            f"with {world.unregistered} rank(s) unregistered:\n{text}")
            dead = [s.id for s in self._mpi.slots_of(world)
                    if s.alive and (exited or self._mpi.dead(world, s, now))]
            if dead and not exited:
                # Ranks their launcher took down: the world is going down (Hydra ends it
                # once a second rank died). Their tasks are not to blame: wait for the
                # launcher's exit, which makes them collateral (re-queued) below.
                down = [s for s in dead if self._mpi.taken_down(world, self._mpi.slots[s])]
                if down:
                    world.going_down = world.going_down or now
                    if now - world.going_down < TEARDOWN_GRACE_S:
                        dead = [s for s in dead if s not in down]
            if dead:
                self._lost(dead, f"world {world.id} exited (code {world.proc.returncode})"
                           if exited else "rank process died", collateral=exited)
            if exited and not any(s.alive for s in self._mpi.slots_of(world)):
                self._remove_slots(self._mpi.drop(world))
        if not self._mpi.worlds and not self.stopping and not self._consolidating:
            self._broken = "every MPI world of the pool is gone"
            self._fail_all()

    def _fail_all(self) -> None:
        """The pool is broken: every task it holds, queued or running, fails."""
        self.fail_all(lambda task: ExecutorBroken(
            f"pool {self.label!r} is broken: {self._broken}"), release=False)
        self._tasks.clear()

    # ------------------------------------------------------------------ blocked head
    def _unblock(self) -> None:
        """The queue's head cannot run now: fail it if it never can; consolidate if needed."""
        with self.placement() as scheduler:
            head = scheduler.head()
            gpu = head is not None and bool(head[0].resources.gpus_per_rank)
            sizes = scheduler.world_sizes(gpu=gpu)
        if head is None or self.stopping:
            return
        task, need = head[0], head[1]
        pinned = task.handle.pinned
        if pinned is not None:
            lost = [s for s in pinned if s not in self._mpi.slots or not self._mpi.slots[s].alive]
            if lost:
                if self.dequeue(task):
                    self.finish(task, error=errors.resident_lost(task.id, self.label, pinned,
                                                                  lost))
            return
        if max(sizes.values(), default=0) >= need or self._mpi.starting():
            return
        if not self._consolidating:
            self._consolidating = True
            self._event(f"task {task.id} needs {need} {'GPU ' if gpu else ''}ranks but the "
                        f"largest world has "
                        f"{max(sizes.values(), default=0)} (worlds: {sizes}): draining and "
                        f"restarting the pool as one world of {self.max_ranks} ranks "
                        "(resident data on the old ranks is lost)")
            with self.placement() as scheduler:
                for world in self._mpi.worlds.values():
                    world.retiring = True
                    scheduler.hold(world.slot_ids.values())
        self._try_finish_consolidation()

    def _try_finish_consolidation(self) -> None:
        if not self._consolidating or self.stopping:
            return
        if any(s.task is not None and s.alive for s in self._mpi.slots.values()
               if s.world in self._mpi.worlds):
            return
        for world in list(self._mpi.worlds.values()):
            self._remove_slots(self._mpi.retire(world))
        self._consolidating = False
        self._mpi.launch(self.max_ranks, cores=list(range(self.max_ranks)),
                         devices=self._devices())
