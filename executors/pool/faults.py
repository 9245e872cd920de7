"""The pool's fault decision, as pure functions of plain data (unit-tested without MPI).

When ranks are lost (a rank died, its world went down, the pool stopped them), the
pool must decide, for every task running on them: fail it (naming the rank that
died and how), run it again (it lost its ranks through no fault of its own), or
only forget it (its result was already delivered, or the pool stopped these very
ranks for it). A failed or re-run task's other ranks are stopped too: they may
wait in a collective forever, and MPI cannot interrupt them. Every lost rank is
replaced. :func:`settle_lost` makes that decision; :func:`lose` carries it out on the
broker thread, and :func:`check_health` finds the lost ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from hetflow.executors.launch import tail
from hetflow.executors.taskdir import Deaths, describe

#: How often a task lost through no fault of its own is re-queued before it fails.
MAX_REQUEUES = 3
#: How long the pool waits for a world's launcher to exit once a rank of it was taken
#: down by it (see :meth:`.worlds.Worlds.taken_down`), before it treats the rank as simply dead.
TEARDOWN_GRACE_S = 10.0

Death = Tuple[str, str]


@dataclass(frozen=True)
class RunningTask:
    """What the decision needs to know of a task that has ranks."""

    #: Its ranks' slots, in task-rank order.
    slots: Tuple[int, ...]
    #: Its result was already delivered (a rank raised; its peers were still settling).
    done: bool = False
    #: How often it was re-queued so far.
    requeues: int = 0


@dataclass
class Settlement:
    """What to do about lost ranks (slot and task ids only)."""

    #: Every slot now gone: the lost ones, then the stopped peers. One replacement
    #: world of ``len(lost)`` ranks replaces them.
    lost: List[int] = field(default_factory=list)
    #: Live slots to stop first: the other ranks of a failed or re-queued task.
    stop: List[int] = field(default_factory=list)
    #: Task -> its slots among the lost ones (what the pool tells the user it lost).
    dead: Dict[int, List[int]] = field(default_factory=dict)
    #: Tasks to queue again, first.
    requeue: List[int] = field(default_factory=list)
    #: Task -> how its ranks died, by task rank in rank order (``payload.collect``'s ``deaths``).
    fail: Dict[int, Deaths] = field(default_factory=dict)
    #: Tasks whose lost ranks need nothing more (delivered already, or stopped for them).
    forget: List[int] = field(default_factory=list)


def settle_lost(lost: Sequence[int], busy: Mapping[int, int], tasks: Mapping[int, RunningTask],
                evidence: Mapping[int, Death], *, collateral: bool = False,
                blame: Optional[int] = None, max_requeues: int = MAX_REQUEUES,
                innocent: Collection[int] = ()) -> Settlement:
    """Decide what becomes of the tasks on slots ``lost``.

    ``busy``: slot -> the task it runs, for every live slot running one (lost slots
    included). ``tasks``: task -> :class:`RunningTask`. ``evidence``: slot -> how its
    rank ended ``(description, text)``, where anything recorded it (see
    :func:`rank_death`), cause first (earliest end first). ``collateral``: the ranks
    went down with their world, or were unreachable, so a task with no death evidence
    is re-queued (at most ``max_requeues`` times) rather than failed; otherwise a lost
    rank with no evidence simply "died". ``blame``: the task the pool stopped these ranks for
    (its result is decided elsewhere: it is only forgotten). ``innocent``: tasks whose lost
    ranks all ended through no fault of theirs (see :meth:`.worlds.Worlds.not_its_doing`):
    re-queued like a collateral loss, whatever the evidence says.
    """
    plan = Settlement(lost=list(dict.fromkeys(lost)))
    gone = set(plan.lost)
    for slot in plan.lost:
        task_id = busy.get(slot)
        if task_id is not None and task_id in tasks:
            plan.dead.setdefault(task_id, []).append(slot)
    for task_id, dead in plan.dead.items():
        task = tasks[task_id]
        if task.done or task_id == blame:
            plan.forget.append(task_id)
            continue
        # Cause first (as ``payload.collect`` reads it): ranks with evidence in the order
        # the evidence gives (earliest end first), then lost ranks that left none. A rank
        # killed from outside is named although a peer that died of its loss, with no
        # record yet, has the lower rank.
        rank_of = {slot: rank for rank, slot in enumerate(task.slots)}
        deaths: Deaths = {rank_of[slot]: death for slot, death in evidence.items()
                          if slot in rank_of}
        if not collateral:
            for rank, slot in enumerate(task.slots):
                if slot in dead and rank not in deaths:
                    deaths[rank] = ("died", "")
        peers = [s for s in task.slots if busy.get(s) == task_id and s not in gone]
        plan.stop += peers
        plan.lost += peers
        gone.update(peers)
        if ((collateral and not deaths) or task_id in innocent) and \
                task.requeues < max_requeues:
            plan.requeue.append(task_id)
        else:
            plan.fail[task_id] = deaths
    return plan


def rank_death(recorded: Optional[Death], status: Optional[dict]) -> Optional[Death]:
    """How a lost rank ended: its own evidence (``TaskDir.own_deaths``), completed by its
    supervisor's record (``TaskDir.load_status``); None if neither saw anything.

    A signal the supervisor saw is added to a description that names none (a
    segfault's stack dump says what, the signal says how).
    """
    if recorded is None:
        return (describe(status), "") if status else None
    what, text = recorded
    if status and status.get("signal") and "signal" not in what:
        what = f"{what}, {describe(status)}"
    return what, text


# ---------------------------------------------------------------------- carried out
def lose(broker, slot_ids: List[int], why: str, *, collateral: bool = False,
         blame: Optional[int] = None) -> None:
    """Ranks are gone: settle their tasks (:func:`settle_lost`) and start replacements, on
    the pool's broker thread (``broker``: its :class:`~.broker.Broker`)."""
    busy = broker.mpi.busy()
    running = {busy[s]: broker.tasks[busy[s]] for s in slot_ids
               if s in busy and busy[s] in broker.tasks}
    plan = settle_lost(
        slot_ids, busy,
        {tid: RunningTask(tuple(t.slots), t.done, t.handle.requeues)
         for tid, t in running.items()},
        broker.mpi.evidence([t.slots for t in running.values()], slot_ids),
        collateral=collateral, blame=blame,
        innocent={tid for tid, t in running.items() if tid != blame and broker.mpi.not_its_doing(
            [s for s in slot_ids if busy.get(s) == tid], t.handle.sent)})
    slots = broker.mpi.slots
    for slot_id in plan.stop:
        broker.mpi.kill(slots[slot_id])
    broker.mpi.mark_lost(plan.lost)
    broker.remove_slots(plan.lost)
    for task_id in plan.forget:
        broker.forget(running[task_id])
    for task_id in plan.requeue:
        task = running[task_id]
        task.handle.requeues += 1
        broker.event(f"task {task_id} lost its ranks when world "
                           f"{slots[plan.dead[task_id][0]].world} went down ({why}); "
                           f"re-queued (attempt {task.handle.requeues + 1})")
        broker.tasks.pop(task_id, None)
        broker.unpark(task_id)
        broker.pool.requeue(task)
    if plan.lost and not broker.pool.stopping and not broker.consolidating:
        # The replacement's ranks take over the lost ranks' cores and devices (these
        # first: a world binds its devices to its first local ranks).
        lost = sorted(plan.lost, key=lambda s: not slots[s].devices)
        cores = [c for c in (slots[s].core for s in lost) if c is not None]
        devices = [d for s in lost for d in slots[s].devices.split(",") if d]
        world = broker.mpi.launch(len(lost), cores=cores,
                                  devices=devices if broker.pool.gpus else None)
        broker.event(f"{len(plan.lost)} rank(s) lost ({why}): started replacement "
                           f"world {world.id} of {len(plan.lost)} rank(s)")
    for task_id, deaths in plan.fail.items():   # last: the replacement is under way
        task = running[task_id]
        desc = ", ".join(f"pool slot {s} (world {slots[s].world} rank "
                         f"{slots[s].wrank}, pid {slots[s].pid})"
                         for s in plan.dead[task_id])
        broker.event(f"task {task_id}: {desc} died ({why}); task failed, rank(s) "
                           "replaced")
        broker.deliver(task, deaths, lost=f"{desc} ({why})")
        broker.forget(task)


def check_health(broker) -> None:
    """Find dead ranks and ended worlds (:meth:`~.worlds.Worlds.dead`), and settle them."""
    now = time.monotonic()
    timeout = broker.pool.start_timeout
    for world in list(broker.mpi.worlds.values()):
        if broker.mpi.overdue(world, now, timeout):
            broker.event(f"world {world.id} did not register its {world.size} rank(s) "
                               f"within {timeout} s; stopped it:\n{tail(world.stderr)}")
            broker.mpi.stop(world)
        exited = world.proc.poll() is not None
        if exited and world.unregistered and not world.retiring:
            text = tail(world.stderr)
            if world.id == 0 and not broker.ready.is_set():
                broker.broken = (f"the MPI world exited ({world.proc.returncode}) before its "
                                 f"ranks registered:\n{text}")
                broker.ready.set()
                return
            broker.event(f"replacement world {world.id} exited (code "
                               f"{world.proc.returncode}) with {world.unregistered} rank(s) "
                             f"unregistered:\n{text}")
        dead = [s.id for s in broker.mpi.slots_of(world)
                if s.alive and (exited or broker.mpi.dead(world, s, now))]
        if dead and not exited:
            # Ranks their launcher took down: the world is going down (Hydra ends it
            # once a second rank died). Their tasks are not to blame: wait for the
            # launcher's exit, which makes them collateral (re-queued) below.
            down = [s for s in dead if broker.mpi.taken_down(world, broker.mpi.slots[s])]
            if down and now - broker.mpi.going_down_since(world, now) < TEARDOWN_GRACE_S:
                dead = [s for s in dead if s not in down]
        if dead:
            why = f"world {world.id} exited (code {world.proc.returncode})" if exited else \
                "rank process died"
            lose(broker, dead, why, collateral=exited)
        if exited and not any(s.alive for s in broker.mpi.slots_of(world)):
            broker.remove_slots(broker.mpi.drop(world))
    if not broker.mpi.worlds and not broker.pool.stopping and not broker.consolidating:
        broker.broken = "every MPI world of the pool is gone"
        broker.fail_all()


# ---------------------------------------------------------------------- kept communicators
def recycle(broker, slot) -> None:
    """``slot``'s rank keeps ``max_kept_comms`` communicators of failed tasks (each holds one
    of the MPI's context ids, which run out: MPICH has about 2,048, and its world died at
    the 1,023rd failed task): its world takes no more tasks and is replaced by a world of
    its size once its running tasks end (:func:`recycle_idle`). Queued tasks wait for the
    new world; resident data on the old one is lost."""
    world = broker.mpi.worlds.get(slot.world)
    if world is None or world.retiring or broker.consolidating or broker.pool.stopping:
        return
    with broker.pool.placement() as scheduler:
        scheduler.hold(broker.mpi.recycle(world))
    broker.event(f"world {world.id}: rank {slot.wrank} keeps {slot.kept_comms} communicators "
                 f"of failed tasks (max_kept_comms={broker.pool.max_kept_comms}): replacing "
                 "the world once its running tasks end")


def recycle_idle(broker) -> None:
    """Replace the worlds :func:`recycle` retired whose ranks are all idle now."""
    if broker.consolidating or broker.pool.stopping:
        return
    for world in broker.mpi.idle_recycling():
        alive = sorted((s for s in broker.mpi.slots_of(world) if s.alive),
                       key=lambda s: not s.devices)
        cores = [s.core for s in alive if s.core is not None]
        devices = [d for s in alive for d in s.devices.split(",") if d]
        broker.remove_slots(broker.mpi.retire(world))
        broker.recycled += 1
        if alive:
            new = broker.mpi.launch(len(alive), cores=cores,
                                    devices=devices if broker.pool.gpus else None)
            broker.event(f"world {world.id} replaced by world {new.id} of {len(alive)} "
                         f"rank(s) (communicators of failed tasks kept)")
