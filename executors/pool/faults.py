"""The pool's fault decision, as pure functions of plain data (unit-tested without MPI).

When ranks are lost (a rank died, its world went down, the pool stopped them), the
pool must decide, for every task running on them: fail it (naming the rank that
died and how), run it again (it lost its ranks through no fault of its own), or
only forget it (its result was already delivered, or the pool stopped these very
ranks for it). A failed or re-run task's other ranks are stopped too: they may
wait in a collective forever, and MPI cannot interrupt them. Every lost rank is
replaced. :func:`settle_lost` makes that decision; ``pool.py`` carries it out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hetflow.executors.taskdir import Deaths, describe

#: How often a task lost through no fault of its own is re-queued before it fails.
MAX_REQUEUES = 3

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
    #: Task -> how its ranks died, by task rank in rank order (``_rank.collect``'s ``deaths``).
    fail: Dict[int, Deaths] = field(default_factory=dict)
    #: Tasks whose lost ranks need nothing more (delivered already, or stopped for them).
    forget: List[int] = field(default_factory=list)


def settle_lost(lost: Sequence[int], busy: Mapping[int, int], tasks: Mapping[int, RunningTask],
                evidence: Mapping[int, Death], *, collateral: bool = False,
                blame: Optional[int] = None, max_requeues: int = MAX_REQUEUES) -> Settlement:
    """Decide what becomes of the tasks on slots ``lost``.

    ``busy``: slot -> the task it runs, for every live slot running one (lost slots
    included). ``tasks``: task -> :class:`RunningTask`. ``evidence``: slot -> how its
    rank ended ``(description, text)``, where anything recorded it (see
    :func:`rank_death`), cause first (earliest end first). ``collateral``: the ranks
    went down with their world, or were unreachable, so a task with no death evidence
    is re-queued (at most ``max_requeues`` times) rather than failed; otherwise a lost
    rank with no evidence simply "died". ``blame``: the task the pool stopped these ranks for
    (its result is decided elsewhere: it is only forgotten).
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
        # Cause first (as ``_rank.collect`` reads it): ranks with evidence in the order
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
        if collateral and not deaths and task.requeues < max_requeues:
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
