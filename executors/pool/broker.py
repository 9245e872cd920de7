"""The pool's broker: one thread, the single owner of the worlds, their slots and the socket.

Every request of another thread (the kernel's dispatch: start or stop a task; a blocked
queue head; a resident object to drop) is posted to the broker's inbox; the broker runs
it, reads what the ranks send (registrations, outcomes, heartbeats: :mod:`.wire`), and
looks at the worlds' health every so often. It changes slot state only through
:class:`~.worlds.Worlds`' methods, and touches the kernel's scheduler only through the
kernel's ``placement()``. What becomes of the tasks on lost ranks is decided in
:mod:`.faults` and carried out here.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Dict, List, Optional

from hetflow.errors import ExecutorBroken
from hetflow.executors.payload import collect
from hetflow.executors.kernel import Task
from hetflow.executors.pool import wire
from hetflow.executors.pool.faults import check_health, lose, recycle, recycle_idle
from hetflow.executors.pool.reshape import finish_consolidation, unblock
from hetflow.executors.pool.worlds import Worlds
from hetflow.executors.watch import PEER_GRACE_S

logger = logging.getLogger(__name__)

#: Distinct rank sets whose communicators a world caches (each is a few KiB).
COMM_CACHE = 512
#: How long a rank back from a multi-rank task waits for its peers to be back too, before
#: its slot goes back to the queue alone (see :meth:`Broker._on_outcome`).
PARK_S = 0.05


class Broker:
    """The pool's broker thread (see the module docstring). ``pool``: its
    :class:`~.executor.PoolExecutor`, whose kernel methods deliver, requeue and place;
    ``worlds(endpoint, send)`` makes the :class:`Worlds` once the socket is bound."""

    def __init__(self, pool, address: str, signer: wire.Signer,
                 worlds: Callable[[str, Callable[..., bool]], Worlds]):
        import zmq

        self.pool = pool
        self.signer = signer
        #: Messages dropped for a wrong or missing signature.
        self.rejected = 0
        self.broken: Optional[str] = None
        self.tasks: Dict[int, Task] = {}        # tasks with ranks busy for them
        #: Worlds replaced because a rank kept ``max_kept_comms`` communicators of failed tasks.
        self.recycled = 0
        self.consolidating = False
        self.ready = threading.Event()
        self._inbox: deque = deque()
        self._soon: List[tuple] = []             # what the broker posted to itself
        #: task id -> (deadline, slots back from it whose peers are not): oldest first
        self._parked: OrderedDict = OrderedDict()
        self._ident: Optional[int] = None        # the broker thread's, once it runs
        self._inbox_lock = threading.Lock()
        self._wake_pending = False
        self._blocked_pending = False
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self._router.bind_to_random_port(f"tcp://{address}")
        self.endpoint = f"tcp://{address}:{port}"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.mpi = worlds(self.endpoint, self.send)
        self.thread = threading.Thread(target=self._loop, name=f"{pool.label}-broker",
                                       daemon=True)

    # ------------------------------------------------------------------ other threads
    def post(self, command) -> None:
        """Ask the broker thread to run ``command`` (a tuple: kind, arguments)."""
        if threading.get_ident() == self._ident:
            # The broker itself (slots it freed placed a task): no wake-up through the pipe,
            # run once the message at hand is handled (a start: at once, see _on_outcome).
            self._soon.append(command)
            return
        with self._inbox_lock:
            self._inbox.append(command)
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            try:
                os.write(self._wake_w, b"!")
            except OSError:
                pass

    def head_blocked(self) -> None:
        if not self._blocked_pending:      # one pending look is enough: it reads the head anew
            self._blocked_pending = True
            self.post(("blocked",))

    def stop(self) -> None:
        """End the thread (it closes the worlds), then the socket."""
        if self.thread.is_alive():
            self.post(("exit",))
            self.thread.join(timeout=30)
        else:
            self.mpi.close()
        try:
            self._router.close(0)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    def event(self, text: str) -> None:
        """Note what the pool did about a fault (``PoolExecutor.events``, and the log)."""
        self.pool.events.append(text)
        label = self.pool.label
        logger.warning("%s: %s", "pool" if label == "pool" else f"pool {label!r}", text)

    # ------------------------------------------------------------------ the loop
    def send(self, identity: bytes, frames, copy: bool = True) -> bool:
        import zmq
        try:
            wire.send(self._router, [identity] + self.signer.sign(wire.TO_RANK, identity, frames),
                      copy=copy)
            return True
        except zmq.ZMQError:          # peer gone (ROUTER_MANDATORY): the monitor will notice
            return False

    def _loop(self) -> None:
        import zmq

        self._ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_check = 0.0
        try:
            while True:
                busy = bool(self.tasks) or self.consolidating
                until = next(iter(self._parked.values()))[0] if self._parked else next_check
                events = dict(poller.poll(max(0, int((min(until, next_check) - time.monotonic())
                                                     * 1000) + 1)))
                if self._wake_r in events and self._drain_inbox():
                    return
                if self._router in events:
                    self._drain_router()
                now = time.monotonic()
                if self._parked:
                    self._unpark_overdue(now)
                if now >= next_check:
                    check_health(self)
                    recycle_idle(self)
                    next_check = now + (0.2 if busy else 1.0)
        except BaseException as exc:  # a dead broker must fail every future (logged)
            logger.exception("pool broker crashed")
            self.broken = f"broker thread crashed: {type(exc).__name__}: {exc}"
            self.ready.set()
            self.fail_all()
            self.mpi.close()

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
        return self._run(commands)

    def _run(self, commands) -> bool:
        """Run posted commands (then what they posted meanwhile); True when told to exit."""
        for kind, *args in commands:
            if self._soon and self._run_soon():
                return True
            if kind == "start":
                self._dispatch(*args)
            elif kind == "stop":
                self._on_stop(*args)
            elif kind == "peers":
                self._on_peer_grace(*args)
            elif kind == "blocked":
                self._blocked_pending = False
                unblock(self)
            elif kind == "release":
                for slot_id in args[0].slots:
                    slot = self.mpi.slots.get(slot_id)
                    if slot is not None and slot.alive:
                        self.send(slot.identity, [wire.DROP, args[0].key.encode()])
            elif kind == "exit":
                self.mpi.close()
                return True
        return bool(self._soon) and self._run_soon()

    def _run_soon(self) -> bool:
        commands, self._soon = self._soon, []
        return self._run(commands)

    def _start_soon(self) -> None:
        """Send the tasks placed on slots the broker just freed, now (their ranks start
        while the broker delivers what came back); the other commands wait their turn."""
        if self._soon:
            starts = [c for c in self._soon if c[0] == "start"]
            self._soon = [c for c in self._soon if c[0] != "start"]
            for _, task in starts:
                self._dispatch(task)

    def _drain_router(self) -> None:
        import zmq

        while True:
            try:
                frames = wire.recv(self._router, zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]
            message = self.signer.check(wire.TO_POOL, identity, frames[1:])
            if message is None:
                self._reject(identity)
                continue
            try:
                self._on_message(identity, message)
            except Exception as exc:  # noqa: BLE001 - a signed but malformed message
                self._malformed(identity, message[0], exc)
            if self._soon:
                self._run_soon()

    def _on_message(self, identity: bytes, message: list) -> None:
        kind = message[0]
        if kind == wire.HEARTBEAT:
            slot = self.mpi.slot_of(identity)
            if slot is not None:
                self.mpi.heard_from(slot)
            self.send(identity, [wire.HEARTBEAT_ACK])
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
            label = self.pool.label
            logger.warning("%s: dropped a message that was not signed with the runtime's "
                           "key (peer identity %r); later ones are only counted in "
                           "executor.rejected", "pool" if label == "pool" else f"pool {label!r}",
                           identity[:40])

    def _malformed(self, identity: bytes, kind: bytes, exc: Exception) -> None:
        """A rank signed a message it should not have sent: the rank is broken. Its task
        fails with TaskLost, and the rank is stopped and replaced like a dead one."""
        slot = self.mpi.slot_of(identity)
        why = f"rank sent a malformed {bytes(kind[:16])!r} message ({type(exc).__name__}: {exc})"
        if slot is None or not slot.alive:
            self.event(f"unregistered peer {identity[:40]!r}: {why}; ignored")
            return
        self.mpi.kill(slot)
        self.lost([slot.id], why)

    # ------------------------------------------------------------------ slots (under the lock)
    def _free(self, slot_ids) -> None:
        """Give idle slots back to the queue (not those of a retiring world, nor dead ones)."""
        free = [s for s in slot_ids if self.mpi.usable(s)]
        if free:
            self.pool.release(free)

    def _register(self, identity: bytes, info: dict) -> None:
        slot = self.mpi.register(identity, info)
        if slot is None:
            return
        with self.pool.placement() as scheduler:
            scheduler.add_slot(slot.id, slot.world, slot.host, slot.wrank,
                               gpu=bool(slot.devices))
        self.pool.release([slot.id])
        world = self.mpi.worlds[slot.world]
        if world.id == 0 and not world.unregistered:
            self.ready.set()

    def remove_slots(self, slot_ids) -> None:
        with self.pool.placement(wake=True) as scheduler:   # the head may be blocked for good
            for slot_id in slot_ids:
                scheduler.remove_slot(slot_id)

    # ------------------------------------------------------------------ running tasks
    def _dispatch(self, task: Task) -> None:
        """Send a task the kernel placed to its ranks."""
        slots = [self.mpi.slots.get(s) for s in task.slots]
        if task.done:                       # cancelled (or shut down) on its way here
            self._free([s.id for s in slots if s is not None])
            return
        for slot in slots:
            if slot is None or not slot.alive:
                # Its ranks were lost (or retired) between placement and here: it never ran.
                self._free([s.id for s in slots if s is not None])
                self.pool.requeue(task)
                return
        ranks, cache, generation = self.mpi.communicator(task.slots, COMM_CACHE)
        frames = wire.task_frames(task.id, ranks, tuple(task.slots), cache, generation,
                                  task.resources.cores_per_rank, task.payload)
        copy = len(task.payload) < wire.ZERO_COPY_BYTES
        task.handle.outcomes = {}
        task.handle.sent = time.time()
        self.tasks[task.id] = task
        self.mpi.assign(task.slots, task.id)
        unreachable = [slot.id for slot in slots
                       if not self.send(slot.identity, frames, copy=copy)]
        if unreachable:   # the rank vanished since it last spoke: same as a death under the task
            self.lost(unreachable, "rank unreachable when the task was sent", collateral=True)

    def _on_outcome(self, identity: bytes, task_id: int, outcome, kept: int = 0) -> None:
        slot = self.mpi.slot_of(identity)
        if slot is None:
            return
        self.mpi.heard_from(slot)
        self.mpi.kept(slot, kept)
        task = self.tasks.get(task_id)
        if slot.task == task_id and task is not None:
            self.mpi.vacate(slot)
            if not outcome.ok:              # before the slot is free for another task
                self.mpi.retire_communicator(task.slots)
            if kept >= self.pool.max_kept_comms:    # before the slot is free, too
                recycle(self, slot)
            run = task.handle
            outcome.rank = task.slots.index(slot.id)
            run.outcomes[outcome.rank] = outcome
            if outcome.ok and not task.done and len(run.outcomes) < len(task.slots):
                self._park(task.id, slot.id)
            else:
                self._free(self._unpark(task.id) + [slot.id])
                self._start_soon()
            task.times.returned.setdefault(outcome.rank, time.time())   # no returned-<r> file
            if len(run.outcomes) == len(task.slots):
                self.deliver(task)
                self.forget(task)
                if self.mpi.recycling:
                    recycle_idle(self)
            elif not outcome.ok and not task.done:
                # A rank raised: that is the task's result. Its peers may wait in a
                # collective for it; those still busy after the grace are stopped.
                self.deliver(task)
                run.peer_grace = self.pool.call_later(
                    PEER_GRACE_S, lambda: self.post(("peers", task)))
        finish_consolidation(self)

    def deliver(self, task: Task, deaths=None, lost: str = "") -> None:
        """Deliver the task's result from its ranks' outcomes (``lost``: the ranks it lost)."""
        run = task.handle
        value, error = None, None
        detail = f"; lost {lost}; the pool replaces the lost rank(s)" if lost else ""
        if task.samples is not None:
            task.samples.carry(run.outcomes)
        try:
            value = collect(run.outcomes, task.id, task.resources, self.pool.label,
                            deaths=deaths, detail=detail)
        except BaseException as exc:  # noqa: BLE001 - the task's typed error
            error = exc
        self.pool.finish(task, value, error, root=run.outcomes.get(0), release=False)

    def _park(self, task_id: int, slot_id: int) -> None:
        """Keep a rank back from a task whose peers still run off the queue until they are
        back too (at most :data:`PARK_S`), then give the task's slots back together: the next
        task placed on them is likely to run on the same ranks, whose communicator they keep.
        Given back one by one, a 2-rank task on a 32-slot pool paired each rank with whichever
        came back next, and 1,000 tasks made about 430 communicators (one of each 2 tasks)."""
        entry = self._parked.get(task_id)
        if entry is None:
            self._parked[task_id] = (time.monotonic() + PARK_S, [slot_id])
        else:
            entry[1].append(slot_id)

    def _unpark(self, task_id: int) -> List[int]:
        entry = self._parked.pop(task_id, None)
        return entry[1] if entry is not None else []

    def unpark(self, task_id: int) -> None:
        """Give back the slots parked for ``task_id`` (its other ranks were lost or stopped)."""
        if task_id in self._parked:
            self._free(self._unpark(task_id))

    def _unpark_overdue(self, now: float) -> None:
        while self._parked:
            task_id, (deadline, _) = next(iter(self._parked.items()))
            if deadline > now:
                break
            self.unpark(task_id)
        if self._soon:
            self._run_soon()

    def forget(self, task: Task) -> None:
        """Drop the broker's record of a delivered task once none of its ranks is busy for it."""
        self.unpark(task.id)
        if not self.mpi.busy_for(task.id, task.slots):
            if task.handle.peer_grace is not None:
                task.handle.peer_grace.cancel()
            self.tasks.pop(task.id, None)

    def _on_stop(self, task: Task) -> None:
        """The kernel's verdict (walltime, cancel, shutdown): stop the ranks, deliver it."""
        if self.tasks.get(task.id) is task:
            victims = self.mpi.busy_for(task.id, task.slots)
            if victims:
                why = str(task.error).splitlines()[0] if task.error else f"task {task.id} stopped"
                self._stop_ranks(task, victims, why)
        self.pool.dequeue(task)                 # re-queued meanwhile: it stops all the same
        if task.error is not None:
            self.pool.finish(task, release=False)
        else:
            self.deliver(task)
        if self.tasks.get(task.id) is task:
            self.forget(task)

    def _on_peer_grace(self, task: Task) -> None:
        if self.tasks.get(task.id) is not task:
            return
        stuck = self.mpi.busy_for(task.id, task.slots)
        if stuck:
            self._stop_ranks(task, stuck, f"rank(s) of failed task {task.id} still waited for "
                             f"their peers {PEER_GRACE_S} s after it failed")
        self.forget(task)

    def _stop_ranks(self, task: Task, victims: List[int], why: str) -> None:
        """Kill ranks busy for ``task`` (MPI cannot interrupt them) and replace them."""
        for slot_id in victims:
            self.mpi.kill(self.mpi.slots[slot_id])
        self.lost(victims, why, blame=task.id)

    # ------------------------------------------------------------------ faults
    def lost(self, slot_ids: List[int], why: str, *, collateral: bool = False,
             blame: Optional[int] = None) -> None:
        """Ranks are gone: settle their tasks and start replacements (:func:`.faults.lose`)."""
        lose(self, slot_ids, why, collateral=collateral, blame=blame)

    def fail_all(self) -> None:
        """The pool is broken: every task it holds, queued or running, fails."""
        self.pool.fail_all(lambda task: ExecutorBroken(
            f"pool {self.pool.label!r} is broken: {self.broken}"), release=False)
        self.tasks.clear()
