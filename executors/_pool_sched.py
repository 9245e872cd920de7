"""Placement for the pool: the kernel's FIFO-with-backfill queue over slots grouped by MPI world.

A task's communicator must come from one MPI world, so a task fits only where one
world has enough free slots (best fit: the world with the fewest free slots that
suffice, keeping big holes for big tasks). A task carrying resident data is pinned
to the exact slots holding it. The no-starvation rule is SlotScheduler's: a
blocked head lets later tasks pass it at most ``max_bypass`` times.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence

from hetflow.executors.scheduler import SlotScheduler


class PoolScheduler(SlotScheduler):
    """Slots are global ids; ``world_of[slot]`` says which MPI world a slot belongs to.

    ``pinned_of(item)`` gives the exact slots a queued item must run on, or None.
    """

    def __init__(self, max_bypass: int = 16,
                 pinned_of: Callable[[object], Optional[Sequence[int]]] = lambda item: None):
        super().__init__(0, max_bypass=max_bypass)
        self.world_of: Dict[int, int] = {}
        self.pinned_of = pinned_of

    # slots come and go with worlds (start, loss, replacement)
    def add_slot(self, slot: int, world: int) -> None:
        self.world_of[slot] = world
        self.capacity += 1

    def remove_slot(self, slot: int) -> None:
        if slot in self.world_of:
            del self.world_of[slot]
            self.capacity -= 1
        if slot in self.free:
            self.free.remove(slot)

    def hold(self, slots: Iterable[int]) -> None:
        """Take ``slots`` out of the free list without giving them to a task (a retiring world)."""
        held = set(slots)
        self.free = [s for s in self.free if s not in held]

    def world_sizes(self) -> Dict[int, int]:
        """Slots per world (busy or free)."""
        sizes: Dict[int, int] = {}
        for world in self.world_of.values():
            sizes[world] = sizes.get(world, 0) + 1
        return sizes

    def place(self, need: int, pinned: Optional[Sequence[int]] = None) -> Optional[List[int]]:
        """Free slots for a task of ``need`` ranks within one world, or None."""
        if pinned is not None:
            return list(pinned) if all(s in self.free for s in pinned) else None
        by_world: Dict[int, List[int]] = {}
        for slot in self.free:
            by_world.setdefault(self.world_of[slot], []).append(slot)
        fits = [(len(free), world) for world, free in by_world.items() if len(free) >= need]
        if not fits:
            return None
        _, world = min(fits)
        return sorted(by_world[world])[:need]

    def take(self, item, need: int) -> Optional[List[int]]:
        slots = self.place(need, self.pinned_of(item))
        if slots is not None:
            self.hold(slots)
        return slots

    def release(self, slots: Iterable[int]) -> None:
        self.free = sorted(set(self.free) | {s for s in slots if s in self.world_of})
