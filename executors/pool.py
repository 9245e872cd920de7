"""hetflow's own pilot: a persistent MPI pool with a fresh communicator per task.

One ``mpiexec -n N`` world starts with the executor; its ranks (workers, see
``_pool_worker.py``) register over ZeroMQ and take tasks from a scheduler in the
client. Each task runs on the ranks it was given through a communicator built
over exactly those ranks, with the shared rank-side runner, so values and errors
are those of every other executor. No process launch, no interpreter start per task.

Faults. The world runs with Hydra's ``-disable-auto-cleanup``, so one rank's
death does not take the others down. The pool notices a dead rank (its pid is
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
world went down (not their fault) are re-queued, not failed.

Multi-node: pass ``hostfile=`` (Hydra ``-f``; lines ``host:slots``) or a launcher
prefix such as ``launcher=["srun", "--ntasks={ranks}", "--kill-on-bad-exit=0"]``
inside an allocation; the ranks connect back to ``address`` (an interface the
compute nodes reach, e.g. the head node's IP). Ranks on other hosts are watched
through heartbeats (lost after ``lost_after_s`` of silence) and stopped through
their control thread; ranks exit by themselves when the client disappears.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


from hetflow.errors import (ConfigError, ExecutorBroken, LaunchError, ResourcesUnavailable,
                            TaskCancelled, TaskLost, WalltimeExceeded)
from hetflow.executors.base import HetflowExecutor, collect
from hetflow.executors.launch import (default_mpiexec, ended, kill_tree, launcher_env,
                                      launcher_flavour, tail)
from hetflow.executors._pool_sched import PoolScheduler
from hetflow.executors._supervise import read_status
from hetflow.executors._rank import read_deaths
from hetflow.resident import find_handles

logger = logging.getLogger(__name__)

# Task states, as in RADICAL-Pilot; read them with ``hetflow.task_state(future)``.
NEW, SCHEDULING, EXECUTING, DONE, FAILED, CANCELED = (
    "NEW", "SCHEDULING", "EXECUTING", "DONE", "FAILED", "CANCELED")

#: Seconds a task's other ranks get to report after one rank raised, before the
#: pool concludes they wait in a collective that will never complete.
STUCK_GRACE_S = 1.0
#: How often a task lost through no fault of its own is re-queued before it fails.
MAX_REQUEUES = 3
#: Distinct rank sets whose communicators a world caches (each is a few KiB).
COMM_CACHE = 512
#: Seconds a dead rank's supervisor gets to record how the rank ended (its signal).
EVIDENCE_GRACE_S = 2.0


@dataclass
class _Slot:
    id: int
    world: int
    wrank: int
    pid: int = 0
    host: str = ""
    identity: bytes = b""
    alive: bool = True
    task: Optional[int] = None
    last_seen: float = 0.0
    core: Optional[int] = None
    supervisor: int = 0          # the rank's parent, which records how it ended
    dead_since: Optional[float] = None


@dataclass
class _World:
    id: int
    size: int
    proc: subprocess.Popen
    statedir: str
    stderr: str
    command: List[str]
    slot_ids: Dict[int, int] = field(default_factory=dict)   # world rank -> slot
    started: float = field(default_factory=time.monotonic)
    retiring: bool = False
    comm_keys: set = field(default_factory=set)
    cores: List[int] = field(default_factory=list)   # core index by world rank (pinning)


@dataclass
class _Task:
    id: int
    future: Future
    resources: object
    payload: bytes
    pinned: Optional[tuple] = None
    slots: List[int] = field(default_factory=list)
    outcomes: dict = field(default_factory=dict)
    deadline: Optional[float] = None
    stuck_deadline: Optional[float] = None
    delivered: bool = False
    requeues: int = 0
    launched: float = float("nan")
    delivered_error: Optional[BaseException] = None


class PoolExecutor(HetflowExecutor):
    """A Parsl executor running MPI tasks on one long-lived MPI world of ``max_ranks`` ranks.

    max_ranks: ranks in the world (default: this machine's cores); tasks take 1..max_ranks.
    hostfile: a Hydra hostfile (``host:slots`` lines) to spread the world over nodes.
    launcher: a full launcher prefix instead of mpiexec, ``{ranks}`` replaced by the
        count, e.g. ``["srun", "--ntasks={ranks}", "--cpu-bind=cores"]``.
    address: the interface ranks connect back to (default loopback; a node's
        reachable address for multi-node pools).
    pin: pin each rank to one core (``os.sched_setaffinity``) when the OS allows.
    gpus_per_rank: GPUs bound to each rank via CUDA_VISIBLE_DEVICES at rank start
        (default 1 when the machine has GPUs, else 0).
    heartbeat_s / lost_after_s: rank heartbeats, and the silence that marks a remote rank lost.
    start_timeout: seconds for a world to register before LaunchError.
    """

    unsupported: Dict[str, str] = {}

    def __init__(self, label: str = "pool", *, max_ranks: Optional[int] = None,
                 hostfile: Optional[str] = None, launcher: Optional[Sequence[str]] = None,
                 mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = (),
                 address: str = "127.0.0.1", pin: bool = True, gpus: Optional[int] = None,
                 gpus_per_rank: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 python: Optional[str] = None, heartbeat_s: float = 1.0,
                 lost_after_s: float = 10.0, start_timeout: float = 120.0, max_bypass: int = 16):
        super().__init__(label=label, max_ranks=max_ranks, gpus=gpus)
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
        self.uid = uuid.uuid4().hex[:12]
        #: What the pool did about faults, in order (also logged as warnings).
        self.events: List[str] = []
        self._sched = PoolScheduler(max_bypass=max_bypass)
        self._slots: Dict[int, _Slot] = {}
        self._by_identity: Dict[bytes, int] = {}
        self._worlds: Dict[int, _World] = {}
        self._tasks: Dict[int, _Task] = {}
        self._inbox: deque = deque()
        self._inbox_lock = threading.Lock()
        self._wake_pending = False
        self._next_slot = 0
        self._next_world = 0
        self._consolidating = False
        self._stopping = False
        self._broken: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._hostname = socket.gethostname()

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        import zmq

        self.state_root = os.path.join(self.run_dir, f"{self.label}-pool")
        os.makedirs(self.state_root, exist_ok=True)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self._router.bind_to_random_port(f"tcp://{self.address}")
        self.endpoint = f"tcp://{self.address}:{port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._launch_world(self.max_ranks, cores=list(range(self.max_ranks)))
        self._thread = threading.Thread(target=self._loop, name=f"{self.label}-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout) or self._broken:
            why = self._broken or f"not all {self.max_ranks} ranks registered in {self.start_timeout} s"
            world = self._worlds.get(0)
            self.shutdown()
            raise LaunchError(f"pool {self.label!r} did not start: {why}",
                              command=world.command if world else None,
                              logs=[world.stderr] if world else ())

    def submit(self, func, resource_specification, *args, **kwargs) -> Future:
        if self._stopping or self._broken:
            raise ExecutorBroken(f"executor {self.label!r} is "
                                 f"{'shut down' if self._stopping else 'broken: ' + str(self._broken)}")
        task_id, resources, future = self.new_task(resource_specification)
        future.hetflow_state = NEW
        pinned = self._pinned(resources, args, kwargs)
        task = _Task(task_id, future, resources,
                     self.payload(task_id, func, args, kwargs, resources), pinned)
        self._post(("submit", task))
        return future

    def cancel(self, future: Future) -> bool:
        """Cancel a queued or running task: its future fails with TaskCancelled."""
        if future.done():
            return False
        answer = threading.Event()
        box = []
        if threading.current_thread() is self._thread:
            return self._cancel(future.parsl_executor_task_id)
        self._post(("cancel", future.parsl_executor_task_id, answer, box))
        answer.wait(30)
        return bool(box and box[0])

    def release_resident(self, handle) -> None:
        """Drop the object behind a :class:`~hetflow.Resident` handle from its ranks."""
        self._post(("release", handle))

    def check_resources(self, resources) -> None:
        if resources.ranks > self.max_ranks:
            raise ResourcesUnavailable(
                f"task needs {resources.ranks} rank(s), but pool {self.label!r} has "
                f"max_ranks={self.max_ranks}")
        if resources.gpus_per_rank > self.gpus_per_rank:
            raise ResourcesUnavailable(
                f"task needs {resources.gpus_per_rank} GPU(s) per rank, but pool "
                f"{self.label!r} binds {self.gpus_per_rank} per rank "
                f"(machine GPUs: {self.gpus})")

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._post(("stop",))
            self._thread.join(timeout=30)
        else:
            self._stop_everything()
        try:
            self._router.close(0)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        super().shutdown()

    @property
    def world_sizes(self) -> Dict[int, int]:
        """Live ranks per MPI world (one world of max_ranks unless ranks were replaced)."""
        return self._sched.world_sizes()

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
        logger.warning("pool %s: %s", self.label, text)

    # ------------------------------------------------------------------ worlds
    def _launch_world(self, size: int, cores: Sequence[int] = ()) -> _World:
        world_id = self._next_world
        self._next_world += 1
        statedir = os.path.join(self.state_root, f"world-{world_id}")
        os.makedirs(statedir, exist_ok=True)
        worker = [self.python, "-m", "hetflow.executors._pool_worker", self.endpoint,
                  str(world_id), statedir]
        if self.launcher:
            cmd = [part.replace("{ranks}", str(size)) for part in self.launcher] + worker
        else:
            cmd = [self.mpiexec]
            if launcher_flavour(self.mpiexec) == "mpich":
                cmd.append("-disable-auto-cleanup")   # one rank's death must not end the world
            elif size > (os.cpu_count() or 1):
                cmd.append("--oversubscribe")
            cmd += ["-n", str(size)]
            if self.hostfile:
                cmd += ["-f", self.hostfile]
            cmd += list(self.mpiexec_args) + worker
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        env = {**os.environ, **self.extra_env,
               "HETFLOW_POOL_UID": self.uid,
               "HETFLOW_POOL_SYSPATH": os.pathsep.join(self.client_sys_path()),
               "HETFLOW_POOL_CLIENT_PID": str(os.getpid()),
               "HETFLOW_POOL_CLIENT_HOST": self._hostname,
               "HETFLOW_POOL_HEARTBEAT": str(self.heartbeat_s),
               "HETFLOW_POOL_GPUS": str(self.gpus),
               "HETFLOW_POOL_GPUS_PER_RANK": str(self.gpus_per_rank),
               "HETFLOW_POOL_CORES": ",".join(str(allowed[c % len(allowed)]) for c in cores)
               if (self.pin and allowed and cores) else ""}
        env = launcher_env(self.mpiexec, env) if self.mpiexec else env
        stderr = os.path.join(statedir, "stderr")
        with open(os.path.join(statedir, "stdout"), "wb") as out, open(stderr, "wb") as err:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=statedir,
                                        start_new_session=True)
            except OSError as exc:
                raise LaunchError(f"could not start the pool's MPI world: {exc}", command=cmd,
                                  logs=[stderr]) from exc
        world = _World(world_id, size, proc, statedir, stderr, cmd, cores=list(cores))
        self._worlds[world_id] = world
        return world

    def _register(self, identity: bytes, info: dict) -> None:
        world = self._worlds.get(info["world"])
        if world is None or world.retiring or info["rank"] in world.slot_ids:
            self._send(identity, [b"X"])
            return
        slot = _Slot(self._next_slot, world.id, info["rank"], info["pid"], info["host"], identity,
                     last_seen=time.monotonic(), supervisor=info.get("supervisor", 0),
                     core=world.cores[info["rank"] % len(world.cores)] if world.cores else None)
        self._next_slot += 1
        world.slot_ids[slot.wrank] = slot.id
        self._slots[slot.id] = slot
        self._by_identity[identity] = slot.id
        self._sched.add_slot(slot.id, world.id)
        self._sched.release([slot.id])
        if world.id == 0 and len(world.slot_ids) == world.size:
            self._ready.set()

    def _retire_world(self, world: _World) -> None:
        """End a world whose ranks are all idle or dead (ask politely, then kill)."""
        for slot_id in world.slot_ids.values():
            slot = self._slots[slot_id]
            if slot.alive:
                self._send(slot.identity, [b"X"])
                slot.alive = False
            self._sched.remove_slot(slot_id)
        try:
            world.proc.wait(timeout=0.5)     # the broker must not stall: then kill what is left
        except subprocess.TimeoutExpired:
            pass
        kill_tree(world.proc.pid)
        world.proc.wait()
        self._worlds.pop(world.id, None)

    # ------------------------------------------------------------------ broker loop
    def _send(self, identity: bytes, frames, copy: bool = True) -> bool:
        import zmq
        try:
            self._router.send_multipart([identity] + list(frames), copy=copy)
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
                busy = any(t.slots for t in self._tasks.values())
                timeout = self._next_timeout(busy, next_check)
                events = dict(poller.poll(timeout))
                if self._wake_r in events:
                    if self._drain_inbox():
                        return
                if self._router in events:
                    self._drain_router()
                now = time.monotonic()
                if now >= next_check:
                    self._check_health()
                    next_check = now + (0.2 if busy or self._consolidating else 1.0)
                self._check_deadlines()
                self._schedule()
        except BaseException as exc:  # noqa: BLE001 - a dead broker must fail every future
            logger.exception("pool broker crashed")
            self._broken = f"broker thread crashed: {type(exc).__name__}: {exc}"
            self._stop_everything()

    def _next_timeout(self, busy: bool, next_check: float) -> int:
        now = time.monotonic()
        wake = next_check
        for task in self._tasks.values():
            for d in (task.deadline, task.stuck_deadline):
                if d is not None:
                    wake = min(wake, d)
        return max(0, int((wake - now) * 1000) + 1)

    def _drain_inbox(self) -> bool:
        try:
            os.read(self._wake_r, 4096)
        except (BlockingIOError, OSError):
            pass
        with self._inbox_lock:
            commands = list(self._inbox)
            self._inbox.clear()
            self._wake_pending = False
        for command in commands:
            kind = command[0]
            if kind == "submit":
                task = command[1]
                self._tasks[task.id] = task
                task.future.hetflow_state = SCHEDULING
                self._sched.push(task, task.resources.ranks)
            elif kind == "cancel":
                _, task_id, answer, box = command
                box.append(self._cancel(task_id))
                answer.set()
            elif kind == "release":
                for slot_id in command[1].slots:
                    slot = self._slots.get(slot_id)
                    if slot is not None and slot.alive:
                        self._send(slot.identity, [b"D", command[1].key.encode()])
            elif kind == "stop":
                self._stop_everything()
                return True
        return False

    def _drain_router(self) -> None:
        import zmq

        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, kind = frames[0], frames[1]
            if kind == b"H":
                slot_id = self._by_identity.get(identity[:-2])
                if slot_id is not None:
                    self._slots[slot_id].last_seen = time.monotonic()
                self._send(identity, [b"h"])
            elif kind == b"O":
                self._on_outcome(identity, int.from_bytes(frames[2], "little"), frames[3],
                                 frames[4])
            elif kind == b"R":
                self._register(identity, pickle.loads(frames[2]))

    def _schedule(self) -> None:
        if self._stopping:
            return
        ready = self._sched.pop_ready(lambda task: task.pinned)
        for task, slots in ready:
            self._dispatch(task, slots)
        head = self._sched.head()
        if head is not None:
            self._unblock(head)

    def _unblock(self, head) -> None:
        """The head task cannot run now: fail it if it never can; consolidate worlds if needed."""
        task, need, _ = head
        if task.pinned is not None:
            lost = [s for s in task.pinned if not self._slots.get(s, _Slot(s, -1, -1, alive=False)).alive]
            if lost:
                self._sched.remove(task)
                self._finish(task, error=TaskLost(
                    f"task {task.id} ({self.label}): its resident data lived on pool slot(s) "
                    f"{lost}, which were lost (rank died or the pool restarted); re-create it",
                    rank=task.pinned.index(lost[0]), task_id=task.id))
            return
        sizes = self._sched.world_sizes()
        starting = sum(w.size - len(w.slot_ids) for w in self._worlds.values() if not w.retiring)
        if max(sizes.values(), default=0) >= need or starting:
            return
        if not self._consolidating:
            self._consolidating = True
            self._event(f"task {task.id} needs {need} ranks but the largest world has "
                        f"{max(sizes.values(), default=0)} (worlds: {sizes}): draining and "
                        f"restarting the pool as one world of {self.max_ranks} ranks "
                        "(resident data on the old ranks is lost)")
            for world in self._worlds.values():
                world.retiring = True
                for slot_id in world.slot_ids.values():
                    if slot_id in self._sched.free:
                        self._sched.free.remove(slot_id)
        self._try_finish_consolidation()

    def _try_finish_consolidation(self) -> None:
        if not self._consolidating:
            return
        if any(self._slots[s].task is not None and self._slots[s].alive
               for w in self._worlds.values() for s in w.slot_ids.values()):
            return
        for world in list(self._worlds.values()):
            self._retire_world(world)
        self._consolidating = False
        self._launch_world(self.max_ranks, cores=list(range(self.max_ranks)))

    def _dispatch(self, task: _Task, slots: List[int]) -> None:
        world = self._worlds[self._slots[slots[0]].world]
        ranks = tuple(self._slots[s].wrank for s in slots)
        cache = ranks in world.comm_keys or len(world.comm_keys) < COMM_CACHE
        if cache:
            world.comm_keys.add(ranks)
        header = pickle.dumps((task.id, ranks, tuple(slots), cache,
                               task.resources.cores_per_rank))
        task.slots = list(slots)
        task.outcomes = {}
        task.launched = time.time()
        if task.resources.walltime is not None:
            task.deadline = time.monotonic() + task.resources.walltime
        task.future.hetflow_state = EXECUTING
        copy = len(task.payload) < 65536     # zero-copy only pays off for big payloads
        unreachable = []
        for slot_id in slots:
            slot = self._slots[slot_id]
            slot.task = task.id
            if not self._send(slot.identity, [b"T", header, task.payload], copy=copy):
                unreachable.append(slot_id)
        if unreachable:   # the rank vanished since it last spoke: same as a death under the task
            self._lost(unreachable, "rank unreachable when the task was sent", collateral=True)

    def _on_outcome(self, identity: bytes, task_id: int, data: bytes, value: bytes) -> None:
        slot_id = self._by_identity.get(identity)
        if slot_id is None:
            return
        slot = self._slots[slot_id]
        slot.last_seen = time.monotonic()
        if slot.task == task_id:
            slot.task = None
            if slot.alive and not self._worlds[slot.world].retiring:
                self._sched.release([slot_id])
        task = self._tasks.get(task_id)
        if task is None or slot_id not in task.slots:
            self._try_finish_consolidation()
            return
        outcome = pickle.loads(data)
        outcome.value = value
        outcome.rank = task.slots.index(slot_id)
        task.outcomes[outcome.rank] = outcome
        if len(task.outcomes) == len(task.slots):
            self._finish_collected(task)
        elif not outcome.ok and not task.delivered:
            # A rank raised: that is the task's result. Peers may wait in a collective for it.
            self._finish_collected(task, partial=True)
            task.stuck_deadline = time.monotonic() + STUCK_GRACE_S
        self._try_finish_consolidation()

    def _finish_collected(self, task: _Task, partial: bool = False) -> None:
        if not task.delivered:
            value, error = None, None
            try:
                value = collect(task.outcomes, task.resources, task_id=task.id,
                                executor=self.label)
            except BaseException as exc:  # noqa: BLE001
                error = exc
            self._finish(task, value, error, keep=partial)
        if not partial:
            self._forget(task)

    def _finish(self, task: _Task, value=None, error: Optional[BaseException] = None,
                keep: bool = False) -> None:
        """Deliver the task's result once; ``keep``: its ranks are still being settled."""
        if not task.delivered:
            task.delivered = True
            state = DONE if error is None else (CANCELED if isinstance(error, TaskCancelled)
                                                 else FAILED)
            task.future.hetflow_state = state
            stamps = {"launched": task.launched}
            root = task.outcomes.get(0)
            if root is not None:
                stamps.update(started=root.started, finished=root.finished)
            self.deliver(task.future, value, error, stamps)
        if not keep:
            self._forget(task)

    def _forget(self, task: _Task) -> None:
        task.deadline = task.stuck_deadline = None
        if not any(self._slots[s].task == task.id for s in task.slots):
            self._tasks.pop(task.id, None)

    # ------------------------------------------------------------------ faults
    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for task in list(self._tasks.values()):
            if task.deadline is not None and now >= task.deadline and not task.delivered:
                walltime = task.resources.walltime
                self._stop_ranks(task, f"task {task.id} exceeded its walltime of {walltime} s")
                self._finish(task, error=WalltimeExceeded(
                    f"task {task.id} ({self.label}) exceeded its walltime of {walltime} s and "
                    f"was stopped; its ranks (pool slots {task.slots}) were replaced",
                    walltime=walltime, task_id=task.id))
            elif task.stuck_deadline is not None and now >= task.stuck_deadline:
                task.stuck_deadline = None
                stuck = [s for s in task.slots if self._slots[s].task == task.id]
                if stuck:
                    self._stop_ranks(task, f"rank(s) of failed task {task.id} still waited for "
                                     f"their peers {STUCK_GRACE_S} s after it failed")
                self._forget(task)

    def _cancel(self, task_id: int) -> bool:
        task = self._tasks.get(task_id)
        if task is None or task.delivered:
            return False
        error = TaskCancelled(f"task {task_id} ({self.label}) was cancelled")
        if not task.slots:
            self._sched.remove(task)
            self._finish(task, error=error)
            return True
        self._stop_ranks(task, f"task {task_id} was cancelled while running")
        self._finish(task, error=error)
        return True

    def _stop_ranks(self, task: _Task, why: str) -> None:
        """Kill the task's ranks still busy with it (MPI cannot interrupt them) and replace them."""
        victims = [s for s in task.slots if self._slots[s].alive and self._slots[s].task == task.id]
        for slot_id in victims:
            self._kill_slot(self._slots[slot_id])
        if victims:
            self._lost(victims, why, blame=task.id)

    def _kill_slot(self, slot: _Slot) -> None:
        if slot.host == self._hostname and slot.pid:
            try:
                os.kill(slot.pid, 9)
            except ProcessLookupError:
                pass
        else:  # another node: the rank's control thread ends the process
            self._send(slot.identity + b".c", [b"K"])

    def _check_health(self) -> None:
        now = time.monotonic()
        for world in list(self._worlds.values()):
            if (len(world.slot_ids) < world.size and world.proc.poll() is None
                    and now - world.started > self.start_timeout):
                self._event(f"world {world.id} did not register its {world.size} rank(s) within "
                            f"{self.start_timeout} s; stopped it:\n{tail(world.stderr)}")
                kill_tree(world.proc.pid)
                world.proc.wait()
            exited = world.proc.poll() is not None
            if exited and len(world.slot_ids) < world.size and not world.retiring:
                missing = world.size - len(world.slot_ids)
                text = tail(world.stderr)
                if world.id == 0 and not self._ready.is_set():
                    self._broken = f"the MPI world exited ({world.proc.returncode}) before its ranks registered:\n{text}"
                    self._ready.set()
                    return
                self._event(f"replacement world {world.id} exited (code {world.proc.returncode}) "
                            f"with {missing} rank(s) unregistered:\n{text}")
            dead = []
            for slot_id in world.slot_ids.values():
                slot = self._slots[slot_id]
                if not slot.alive:
                    continue
                if exited or (not self._slot_alive(slot, now)
                              and not self._awaiting_evidence(world, slot, now)):
                    dead.append(slot_id)
            if dead:
                self._lost(dead, f"world {world.id} exited (code {world.proc.returncode})"
                           if exited else "rank process died", collateral=exited)
            if exited and all(not self._slots[s].alive for s in world.slot_ids.values()):
                kill_tree(world.proc.pid)
                for slot_id in world.slot_ids.values():
                    self._sched.remove_slot(slot_id)
                self._worlds.pop(world.id, None)
        if not self._worlds and not self._stopping and not self._consolidating:
            self._broken = "every MPI world of the pool is gone"
            self._fail_all(ExecutorBroken(f"pool {self.label!r} is broken: {self._broken}"))

    def _slot_alive(self, slot: _Slot, now: float) -> bool:
        if slot.host == self._hostname and slot.pid:
            return not ended(slot.pid)
        return now - slot.last_seen < self.lost_after_s

    def _awaiting_evidence(self, world: _World, slot: _Slot, now: float) -> bool:
        """A rank just died: give its supervisor a moment to record how (the signal)."""
        if slot.host != self._hostname or not slot.supervisor:
            return False
        if read_status(world.statedir, slot.pid) is not None:
            return False
        if slot.dead_since is None:
            slot.dead_since = now
        if now - slot.dead_since >= EVIDENCE_GRACE_S:
            return False
        return not ended(slot.supervisor)

    def _death(self, world: Optional[_World], slot: _Slot, recorded: Optional[tuple]):
        """``(description, text)`` naming how a rank that really died ended, or None if unknown."""
        status = read_status(world.statedir, slot.pid) if world else None
        if recorded is None:
            return (status[0], "") if status else None
        what, text = recorded
        if status and status[1] and "signal" not in what:   # e.g. a segfault's stack dump
            what = f"{what}, {status[0]}"
        return what, text

    def _lost(self, slot_ids: List[int], why: str, blame: Optional[int] = None,
              collateral: bool = False, launch: bool = True) -> List[int]:
        """Slots are gone: settle their tasks (fail or re-queue) and start replacements.

        Returns every slot lost (with the peers stopped on the way); ``launch``
        starts one replacement world for all of them.
        """
        slot_ids = list(slot_ids)
        failed = []   # delivered last, so the replacement is already under way (and told)
        by_task: Dict[int, List[int]] = {}
        worlds = set()
        for slot_id in slot_ids:
            slot = self._slots[slot_id]
            slot.alive = False
            worlds.add(slot.world)
            self._sched.remove_slot(slot_id)
            if slot.task is not None:
                by_task.setdefault(slot.task, []).append(slot_id)
        for task_id, dead in by_task.items():
            task = self._tasks.get(task_id)
            for slot_id in dead:
                self._slots[slot_id].task = None
            if task is None:
                continue
            if task.delivered or task_id == blame:
                self._forget(task)
                continue
            world = self._worlds.get(self._slots[dead[0]].world)
            deaths_by_wrank = read_deaths(world.statedir) if world else {}
            deaths = {}
            for i, slot_id in enumerate(task.slots):
                wrank = self._slots[slot_id].wrank
                if slot_id in dead:       # it died on its own: name how, if anything saw it
                    death = self._death(world, self._slots[slot_id], deaths_by_wrank.get(wrank))
                    if death is None and not collateral:
                        death = ("died", "")
                    if death is not None:
                        deaths[i] = death
                elif wrank in deaths_by_wrank:
                    deaths[i] = deaths_by_wrank[wrank]
            if collateral and not deaths and task.requeues < MAX_REQUEUES:
                # Not this task's fault (its world went down around it, or its rank was gone
                # before the task reached it): run it again.
                others = [s for s in task.slots if self._slots[s].alive and self._slots[s].task == task.id]
                for slot_id in others:
                    self._kill_slot(self._slots[slot_id])
                task.requeues += 1
                self._event(f"task {task.id} lost its ranks when world {self._slots[dead[0]].world} "
                            f"went down ({why}); re-queued (attempt {task.requeues + 1})")
                for slot_id in task.slots:
                    self._slots[slot_id].task = None
                task.slots, task.outcomes, task.deadline = [], {}, None
                task.future.hetflow_state = SCHEDULING
                self._sched.push_front(task, task.resources.ranks)
                if others:
                    slot_ids += self._lost(others, f"peers of re-queued task {task.id}",
                                           blame=task.id, launch=False)
                continue
            # The task killed its rank (or the rank died under it): fail it, stop its peers.
            peers = [s for s in task.slots if self._slots[s].alive and self._slots[s].task == task.id]
            for slot_id in peers:
                self._kill_slot(self._slots[slot_id])
            desc = ", ".join(f"pool slot {s} (world {self._slots[s].world} rank "
                             f"{self._slots[s].wrank}, pid {self._slots[s].pid})" for s in dead)
            error = None
            try:
                collect(task.outcomes, task.resources, task_id=task.id, executor=self.label,
                        deaths=deaths)
            except TaskLost as exc:
                error = exc
            except BaseException as exc:  # noqa: BLE001 - a rank raised before the others died
                error = exc
            if error is None:
                error = TaskLost(f"task {task.id} ({self.label}): {desc} died", task_id=task.id,
                                 rank=task.slots.index(dead[0]))
            if isinstance(error, TaskLost):
                error.args = (error.args[0] + f"; lost {desc}; the pool replaces the lost "
                              "rank(s)",)
            self._event(f"task {task.id}: {desc} died ({why}); task failed, rank(s) replaced")
            task.delivered_error = error
            failed.append(task)
            if peers:
                slot_ids += self._lost(peers, f"peers of failed task {task.id}", blame=task.id,
                                       launch=False)
        replace = len(slot_ids)
        if launch and replace and not self._stopping and not self._consolidating:
            cores = [self._slots[s].core for s in slot_ids if self._slots[s].core is not None]
            world = self._launch_world(replace, cores=cores)
            self._event(f"{replace} rank(s) lost ({why}): started replacement world {world.id} "
                        f"of {replace} rank(s)")
        for task in failed:
            self._finish(task, error=task.delivered_error)
        return slot_ids

    # ------------------------------------------------------------------ shutdown
    def _fail_all(self, error: BaseException) -> None:
        for task in list(self._tasks.values()):
            self._sched.remove(task)
            self._finish(task, error=error)
        self._tasks.clear()

    def _stop_everything(self) -> None:
        self._fail_all(ExecutorBroken(f"executor {self.label!r} shut down before the task "
                                      "finished"))
        for world in list(self._worlds.values()):
            for slot_id in world.slot_ids.values():
                slot = self._slots[slot_id]
                if slot.alive:
                    self._send(slot.identity, [b"X"])
        deadline = time.monotonic() + 3
        for world in list(self._worlds.values()):
            try:
                world.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_tree(world.proc.pid)
            world.proc.wait()
        self._worlds.clear()
