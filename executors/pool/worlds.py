"""The pool's MPI worlds and their ranks: launching, registering, liveness, retiring.

A world is one ``mpiexec -n N`` (or launcher) job of pool workers; each of its
ranks registers over ZeroMQ and becomes a *slot* (a global id: slots are never
reused, so a late message from a lost rank cannot be mistaken for its
replacement's). :class:`Worlds` is owned by the pool's broker thread; it knows
processes and sockets, not tasks' fates (see ``faults``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hetflow.errors import LaunchError
from hetflow.executors.pool import wire
from hetflow.executors.pool.faults import rank_death
from hetflow.executors.allocation import srun_prefix
from hetflow.executors._forensics import ended, forget_recorded_shm, kill_tree
from hetflow.executors._supervise import KILLED_EXIT
from hetflow.executors.launch import launcher_env, launcher_flavour, with_malloc_thp
from hetflow.executors.taskdir import PRIVATE_UMASK, TaskDir, private_dir
from hetflow.executors.watch import EVIDENCE_GRACE_S


#: How long a rank told to exit (:meth:`Worlds.kill`) may take before it is SIGKILLed.
KILL_GRACE_S = 1.0


def _force_kill(pid: int, supervisor: int) -> None:
    """SIGKILL ``pid`` if it is still the child of ``supervisor`` (not a reused pid)."""
    try:
        if os.path.isdir("/proc"):
            with open(f"/proc/{pid}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            if supervisor and parent != supervisor:
                return
        os.kill(pid, 9)
    except (OSError, ValueError, IndexError):   # gone already
        pass


@dataclass
class Slot:
    """One registered rank of a world."""

    id: int
    world: int
    wrank: int
    pid: int = 0
    host: str = ""
    identity: bytes = b""
    alive: bool = True
    task: Optional[int] = None           # the id of the task it runs, if any
    last_seen: float = 0.0
    core: Optional[int] = None
    devices: str = ""                    # its CUDA_VISIBLE_DEVICES, bound for life
    supervisor: int = 0                  # the rank's parent, which records how it ended
    dead_since: Optional[float] = None   # when it was first seen dead (evidence grace)
    kept_comms: int = 0                  # communicators of failed tasks it keeps (its last word)


@dataclass
class World:
    """One MPI world: its launcher process and state dir (the ranks' death evidence)."""

    id: int
    size: int
    proc: subprocess.Popen
    taskdir: TaskDir
    command: List[str]
    slot_ids: Dict[int, int] = field(default_factory=dict)   # world rank -> slot
    started: float = field(default_factory=time.monotonic)
    retiring: bool = False
    recycling: bool = False              # retiring, to be replaced by a world of its size
    going_down: Optional[float] = None   # when a rank was first seen taken down (teardown)
    comm_keys: set = field(default_factory=set)
    comm_generation: Dict[tuple, int] = field(default_factory=dict)   # ranks -> after failures
    cores: List[int] = field(default_factory=list)   # core index by world rank (pinning)

    @property
    def stderr(self) -> str:
        return self.taskdir.stderr

    @property
    def unregistered(self) -> int:
        return self.size - len(self.slot_ids)


class Worlds:
    """Every world of one pool, and every slot of those worlds.

    ``command(size)`` is the launcher prefix for ``size`` ranks (the worker's own
    arguments are appended); ``env`` the ranks' environment; ``send(identity,
    frames)`` sends on the pool's ROUTER (False when the peer is gone).
    """

    def __init__(self, root: str, endpoint: str, *, command: Callable[[int], List[str]],
                 python: str, env: dict, pin: bool, mpiexec: Optional[str],
                 send: Callable[..., bool], lost_after_s: float):
        self.root = root
        self.endpoint = endpoint
        self.command = command
        self.python = python
        self.env = env
        self.pin = pin
        self.mpiexec = mpiexec
        self.send = send
        self.lost_after_s = lost_after_s
        self.hostname = socket.gethostname()
        self.worlds: Dict[int, World] = {}
        self.slots: Dict[int, Slot] = {}
        self.by_identity: Dict[bytes, int] = {}
        #: Worlds :meth:`recycle` retired that are not dropped yet (0: nothing to look for).
        self.recycling = 0
        self._next_world = 0
        self._next_slot = 0

    # ------------------------------------------------------------------ launching
    def launch(self, size: int, cores: Sequence[int] = (), devices=None) -> World:
        """Start a world of ``size`` ranks; ``cores`` are the core indices its ranks pin to,
        ``devices`` the GPU ids its ranks bind on each node, in local-rank order (None: the
        pool has no GPUs, CUDA_VISIBLE_DEVICES is left alone)."""
        world_id = self._next_world
        self._next_world += 1
        taskdir = TaskDir(private_dir(os.path.join(self.root, f"world-{world_id}")))
        cmd = self.command(size) + [self.python, "-m", "hetflow.executors.pool.worker",
                                    self.endpoint, str(world_id), taskdir.path]
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        env = {**self.env, "HETFLOW_POOL_CORES": ",".join(
            str(allowed[c % len(allowed)]) for c in cores) if (self.pin and allowed and cores)
            else ""}
        if devices is not None:
            env["HETFLOW_POOL_DEVICES"] = json.dumps([str(d) for d in devices])
        env = launcher_env(self.mpiexec, env) if self.mpiexec else with_malloc_thp(env)
        out, err = taskdir.open_output()
        with out, err:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=taskdir.path,
                                        start_new_session=True, umask=PRIVATE_UMASK)
            except OSError as exc:
                raise LaunchError(f"could not start the pool's MPI world: {exc}", command=cmd,
                                  logs=[taskdir.stderr]) from exc
        world = World(world_id, size, proc, taskdir, cmd, cores=list(cores))
        self.worlds[world_id] = world
        return world

    def register(self, identity: bytes, info: dict) -> Optional[Slot]:
        """A rank says hello: its new slot, or None (told to exit) if its world is not wanted."""
        world = self.worlds.get(info["world"])
        if world is None or world.retiring or info["rank"] in world.slot_ids:
            self.send(identity, [wire.EXIT])
            return None
        slot = Slot(self._next_slot, world.id, info["rank"], info["pid"], info["host"], identity,
                    last_seen=time.monotonic(), supervisor=info.get("supervisor", 0),
                    core=world.cores[info["rank"] % len(world.cores)] if world.cores else None,
                    devices=info["devices"] if isinstance(info.get("devices"), str) else "")
        self._next_slot += 1
        world.slot_ids[slot.wrank] = slot.id
        self.slots[slot.id] = slot
        self.by_identity[identity] = slot.id
        return slot

    def slot_of(self, identity: bytes) -> Optional[Slot]:
        """The slot behind a main or control socket identity."""
        slot_id = self.by_identity.get(wire.rank_identity(identity))
        return self.slots.get(slot_id) if slot_id is not None else None

    def slots_of(self, world: World) -> List[Slot]:
        return [self.slots[s] for s in world.slot_ids.values()]

    # ------------------------------------------------------------------ slot state
    # The only place that changes a slot's or a world's fields: the broker asks.
    def heard_from(self, slot: Slot) -> None:
        slot.last_seen = time.monotonic()

    def assign(self, slot_ids: Sequence[int], task_id: int) -> None:
        """The task's ranks are busy for it from now on."""
        for slot_id in slot_ids:
            self.slots[slot_id].task = task_id

    def vacate(self, slot: Slot) -> None:
        """The rank reported its task's outcome: idle again."""
        slot.task = None

    def kept(self, slot: Slot, count: int) -> None:
        """The rank keeps ``count`` communicators of failed tasks (it says so with each outcome)."""
        slot.kept_comms = count

    def recycle(self, world: World) -> List[int]:
        """``world`` takes no more tasks: it is replaced once idle (:meth:`idle_recycling`).
        Its slot ids."""
        if not world.recycling and world.id in self.worlds:
            self.recycling += 1
        world.retiring = world.recycling = True
        return list(world.slot_ids.values())

    def idle_recycling(self) -> List[World]:
        """The worlds to be replaced whose live ranks all finished their tasks."""
        return [w for w in self.worlds.values() if w.recycling and not any(
            s.alive and s.task is not None for s in self.slots_of(w))]

    def mark_lost(self, slot_ids: Sequence[int]) -> None:
        """The ranks are gone for good (their tasks settled elsewhere)."""
        for slot_id in slot_ids:
            self.slots[slot_id].alive = False
            self.slots[slot_id].task = None

    def usable(self, slot_id: int) -> bool:
        """A live rank of a world that is not retiring: it may take tasks."""
        slot = self.slots[slot_id]
        return slot.alive and not self.worlds[slot.world].retiring

    def busy(self) -> Dict[int, int]:
        """Live ranks busy for a task: slot -> task id."""
        return {s.id: s.task for s in self.slots.values() if s.alive and s.task is not None}

    def busy_for(self, task_id: int, slot_ids: Sequence[int]) -> List[int]:
        """Those of ``slot_ids`` still alive and busy for ``task_id``."""
        return [s for s in slot_ids if self.slots[s].alive and self.slots[s].task == task_id]

    def any_busy(self) -> bool:
        """A live rank of a live world runs a task."""
        return any(s.task is not None and s.alive for s in self.slots.values()
                   if s.world in self.worlds)

    def communicator(self, slot_ids: Sequence[int], cache_size: int) -> Tuple[tuple, bool, int]:
        """``(world ranks, cache, generation)`` of the communicator a task on ``slot_ids``
        runs on: ranks cache the communicators of up to ``cache_size`` rank sets per world."""
        world = self.worlds[self.slots[slot_ids[0]].world]
        ranks = tuple([self.slots[s].wrank for s in slot_ids])
        cache = ranks in world.comm_keys or len(world.comm_keys) < cache_size
        if cache:
            world.comm_keys.add(ranks)
        return ranks, cache, world.comm_generation.get(ranks, 0)

    def retire_communicator(self, slot_ids: Sequence[int]) -> None:
        """A rank failed the task on ``slot_ids``: its ranks never use that communicator
        again (a peer's unreceived message may wait on it), each creating a new one next
        time."""
        world = self.worlds.get(self.slots[slot_ids[0]].world)
        if world is not None:
            ranks = tuple(self.slots[s].wrank for s in slot_ids)
            world.comm_generation[ranks] = world.comm_generation.get(ranks, 0) + 1

    def retire_all(self) -> List[int]:
        """Every world is to be drained and ended (consolidation); their slot ids."""
        for world in self.worlds.values():
            world.retiring = True
        return [s for world in self.worlds.values() for s in world.slot_ids.values()]

    def going_down_since(self, world: World, now: float) -> float:
        """When a rank of ``world`` was first seen taken down by its launcher."""
        world.going_down = world.going_down or now
        return world.going_down

    def starting(self) -> int:
        """Ranks of live worlds that have not registered yet."""
        return sum(w.unregistered for w in self.worlds.values() if not w.retiring)

    # ------------------------------------------------------------------ liveness
    def kill(self, slot: Slot) -> None:
        """End a rank's process (MPI cannot interrupt a rank waiting in a collective).

        Its control thread ends it (exit code ``KILLED_EXIT``): Hydra keeps the world up
        after ranks that exit, and with it the other ranks and what they keep, where a
        SIGKILLed rank made it end the whole world (MPICH 5.0.2, 3- and 4-rank pools).
        A rank of this host still there after :data:`KILL_GRACE_S` (its control thread
        could not run) is SIGKILLed."""
        self.send(wire.control_identity(slot.identity), [wire.KILL])
        if slot.host == self.hostname and slot.pid:
            timer = threading.Timer(KILL_GRACE_S, _force_kill, (slot.pid, slot.supervisor))
            timer.daemon = True
            timer.start()

    def dead(self, world: World, slot: Slot, now: float) -> bool:
        """The rank is gone (and its supervisor had its moment to record how)."""
        if slot.host == self.hostname and slot.pid:
            if not ended(slot.pid):
                return False
        elif now - slot.last_seen < self.lost_after_s and \
                world.taskdir.load_status(slot.pid) is None:
            # Another node's rank: its heartbeats stopping says so late; its supervisor's
            # record in the shared state dir says so at once.
            return False
        return not self._awaiting_evidence(world, slot, now)

    def taken_down(self, world: World, slot: Slot) -> bool:
        """A dead rank ended together with its supervisor, and nobody recorded how: its
        launcher ended it. MPICH's Hydra keeps a world up after one rank died
        (``-disable-auto-cleanup``) but ends all of it once a second one has (measured with
        MPICH 5.0.2): its other ranks go down through no fault of their own, a moment
        before the launcher itself exits. (A rank killed on its own leaves its supervisor
        to record the signal; one stopped with its supervisor from outside is treated as
        taken down until :data:`.faults.TEARDOWN_GRACE_S` has passed without the launcher exiting.)"""
        return (slot.host == self.hostname and bool(slot.supervisor)
                and ended(slot.supervisor) and world.taskdir.load_status(slot.pid) is None
                and slot.wrank not in world.taskdir.own_deaths())

    def _awaiting_evidence(self, world: World, slot: Slot, now: float) -> bool:
        if slot.host != self.hostname or not slot.supervisor:
            return False
        if world.taskdir.load_status(slot.pid) is not None:
            return False
        if slot.dead_since is None:
            slot.dead_since = now
        if now - slot.dead_since >= EVIDENCE_GRACE_S:
            return False
        return not ended(slot.supervisor)

    def not_its_doing(self, slot_ids: Sequence[int], sent: float) -> bool:
        """Every one of these lost ranks ended through no fault of the task sent to them at
        ``sent`` (``time.time()``): its supervisor recorded that it ended before the task was
        sent, or that it exited with ``KILLED_EXIT`` (told to, or its client looked gone),
        and it left no death record of its own (a task's crash, or its exit, leaves one)."""
        for slot_id in slot_ids:
            slot = self.slots[slot_id]
            world = self.worlds.get(slot.world)
            status = world.taskdir.load_status(slot.pid) if world is not None else None
            if not status or slot.wrank in world.taskdir.own_deaths():
                return False
            if status.get("exitcode") != KILLED_EXIT and status.get("at", sent) >= sent:
                return False
        return bool(slot_ids)

    def evidence(self, tasks_slots, lost) -> Dict[int, Tuple[str, str]]:
        """How ranks ended, by slot, from their worlds' state dirs, for the slots of each task.

        A lost rank: its own evidence completed by its supervisor's record; a peer
        not (yet) seen dead: its own evidence only. Cause first: ranks whose supervisor
        recorded their end, earliest first, then the others in the order given.
        """
        found, own = [], {}
        for slots in tasks_slots:
            for slot_id in slots:
                slot = self.slots[slot_id]
                world = self.worlds.get(slot.world)
                if world is None:
                    continue
                if world.id not in own:
                    own[world.id] = world.taskdir.own_deaths()
                recorded = own[world.id].get(slot.wrank)
                status = world.taskdir.load_status(slot.pid) if slot_id in lost else None
                death = rank_death(recorded, status) if slot_id in lost else recorded
                if death is not None:
                    ended_at = float((status or {}).get("at", float("inf")))
                    found.append((ended_at, len(found), slot_id, death))
        return {slot_id: death for _, _, slot_id, death in sorted(found)}

    def overdue(self, world: World, now: float, timeout: float) -> bool:
        """The world runs but has not registered all its ranks within ``timeout`` s."""
        return world.unregistered > 0 and world.proc.poll() is None and \
            now - world.started > timeout

    # ------------------------------------------------------------------ retiring
    def stop(self, world: World) -> None:
        kill_tree(world.proc.pid)
        world.proc.wait()
        forget_recorded_shm(world.taskdir)

    def drop(self, world: World) -> List[int]:
        """Forget a world whose launcher ended (stopping what is left); its slot ids."""
        self.stop(world)
        if self.worlds.pop(world.id, None) is not None and world.recycling:
            self.recycling -= 1
        return list(world.slot_ids.values())

    def retire(self, world: World) -> List[int]:
        """End a world whose ranks are all idle or dead (ask politely, then kill); its slot ids."""
        for slot in self.slots_of(world):
            if slot.alive:
                self.send(slot.identity, [wire.EXIT])
                slot.alive = False
        try:
            world.proc.wait(timeout=0.5)     # the broker must not stall: then kill what is left
        except subprocess.TimeoutExpired:
            pass
        return self.drop(world)

    def close(self, grace_s: float = 3.0) -> None:
        """Ask every rank to exit, give the worlds ``grace_s`` to end, then kill them."""
        for world in self.worlds.values():
            for slot in self.slots_of(world):
                if slot.alive:
                    self.send(slot.identity, [wire.EXIT])
        deadline = time.monotonic() + grace_s
        for world in list(self.worlds.values()):
            try:
                world.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.stop(world)
        self.worlds.clear()


def launcher_prefix(size: int, *, launcher: Optional[Sequence[str]], mpiexec: Optional[str],
                    mpiexec_args: Sequence[str], hostfile: Optional[str]) -> List[str]:
    """The command that starts ``size`` ranks: ``launcher`` with ``{ranks}`` filled, or mpiexec."""
    if launcher:
        return srun_prefix([part.replace("{ranks}", str(size)) for part in launcher])
    cmd = [mpiexec]
    if launcher_flavour(mpiexec) == "mpich":
        cmd.append("-disable-auto-cleanup")   # one rank's death must not end the world
    else:
        cmd.append("--enable-recovery")       # Open MPI's way of the same
        if size > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
    cmd += ["-n", str(size)]
    if hostfile:
        cmd += ["-f", hostfile]
    return cmd + list(mpiexec_args)
