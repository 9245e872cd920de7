"""Placement for the pool: the kernel's FIFO-with-backfill queue over slots grouped by MPI world.

A task's communicator must come from one MPI world, so a task fits only where one
world has enough free slots (best fit: the world with the fewest free slots that
suffice, keeping big holes for big tasks). Within a world placement is node-aware:
a task that fits on one node runs on one node (best fit again, a world where it
does is preferred), a bigger one packs the world's nodes in order, and its ranks
follow world-rank order (task rank 0 is its lowest world rank). A task carrying resident data is pinned
to the exact slots holding it. The no-starvation rule is SlotScheduler's: a
blocked head lets later tasks pass it at most ``max_bypass`` times.

GPUs: a pool rank binds its devices once, at start (CUDA reads ``CUDA_VISIBLE_DEVICES``
once per process), each rank of a node its own block. So devices are scheduled as the
slots holding them: a GPU task runs only on GPU slots (disjoint by construction), and a
CPU task takes CPU slots first, GPU slots only when no CPU slots suffice.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from hetflow.executors.scheduler import SlotScheduler


class PoolScheduler(SlotScheduler):
    """Slots are global ids; ``world_of[slot]`` says which MPI world a slot belongs to.

    ``pinned_of(item)`` gives the exact slots a queued item must run on, or None;
    ``gpus_of(item)`` the GPUs it needs per rank.
    """

    def __init__(self, max_bypass: int = 16,
                 pinned_of: Callable[[object], Optional[Sequence[int]]] = lambda item: None,
                 gpus_of: Callable[[object], int] = lambda item: 0):
        super().__init__(0, max_bypass=max_bypass)
        self.gpus_of = gpus_of
        #: slots whose rank holds GPUs (bound at its start)
        self.gpu_slots: set = set()
        self.world_of: Dict[int, int] = {}
        #: slot -> (node, world rank): where its rank runs
        self.where: Dict[int, Tuple[str, int]] = {}
        self.pinned_of = pinned_of

    # slots come and go with worlds (start, loss, replacement)
    def add_slot(self, slot: int, world: int, node: str = "", wrank: Optional[int] = None,
                 gpu: bool = False) -> None:
        self.world_of[slot] = world
        if gpu:
            self.gpu_slots.add(slot)
        self.where[slot] = (node, slot if wrank is None else wrank)
        self.capacity += 1

    def remove_slot(self, slot: int) -> None:
        if slot in self.world_of:
            del self.world_of[slot]
            del self.where[slot]
            self.gpu_slots.discard(slot)
            self.capacity -= 1
        if slot in self.free:
            self.free.remove(slot)

    def hold(self, slots: Iterable[int]) -> None:
        """Take ``slots`` out of the free list without giving them to a task (a retiring world)."""
        held = set(slots)
        self.free = [s for s in self.free if s not in held]

    def world_sizes(self, gpu: bool = False) -> Dict[int, int]:
        """Slots per world (busy or free); ``gpu``: its GPU slots only."""
        sizes: Dict[int, int] = {}
        for slot, world in self.world_of.items():
            if not gpu or slot in self.gpu_slots:
                sizes[world] = sizes.get(world, 0) + 1
        return sizes

    def place(self, need: int, pinned: Optional[Sequence[int]] = None,
              among: Optional[Sequence[int]] = None) -> Optional[List[int]]:
        """Free slots for a task of ``need`` ranks within one world (of ``among``, default all
        free slots), or None."""
        if pinned is not None:
            return list(pinned) if all(s in self.free for s in pinned) else None
        by_world: Dict[int, List[int]] = {}
        for slot in self.free if among is None else among:
            by_world.setdefault(self.world_of[slot], []).append(slot)
        fits = []
        for world, free in by_world.items():
            if len(free) >= need:
                on_one = self._on_one_node(free, need)
                fits.append((on_one is None, len(free), world, on_one))
        if not fits:
            return None
        _, _, world, on_one = min(fits, key=lambda fit: fit[:3])
        if on_one is None:      # nodes in order (by their lowest world rank), packed
            order = {}
            for slot in sorted(self.world_of, key=lambda s: self.where[s][1]):
                if self.world_of[slot] == world:
                    order.setdefault(self.where[slot][0], len(order))
            free = sorted(by_world[world], key=lambda s: (order[self.where[s][0]],
                                                          self.where[s][1]))
            on_one = free[:need]
        return sorted(on_one, key=lambda s: self.where[s][1])

    def _on_one_node(self, free: List[int], need: int) -> Optional[List[int]]:
        """``need`` free slots on one node (the one with the fewest that suffice), or None."""
        by_node: Dict[str, List[int]] = {}
        for slot in free:
            by_node.setdefault(self.where[slot][0], []).append(slot)
        fits = [(len(slots), min(self.where[s][1] for s in slots), node)
                for node, slots in by_node.items() if len(slots) >= need]
        if not fits:
            return None
        node = min(fits)[2]
        return sorted(by_node[node], key=lambda s: self.where[s][1])[:need]

    def take_devices(self, item, gpus: int) -> Optional[list]:
        return []           # the pool's devices are its slots' (see take)

    def take(self, item, need: int) -> Optional[List[int]]:
        pinned = self.pinned_of(item)
        if self.gpus_of(item):
            slots = self.place(need, pinned, [s for s in self.free if s in self.gpu_slots])
        else:
            cpu = [s for s in self.free if s not in self.gpu_slots]
            slots = self.place(need, pinned, cpu) if len(cpu) >= need else None
            slots = slots or self.place(need, pinned)
        if slots is not None:
            self.hold(slots)
        return slots

    def release(self, slots: Iterable[int]) -> None:
        self.free = sorted(set(self.free) | {s for s in slots if s in self.world_of})
