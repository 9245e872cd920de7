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

Cost: free slots are kept per world and node (a heap by world rank for CPU slots, one for
GPU slots), with counts per world, updated as slots are taken and given back; a placement
looks at the worlds and their nodes, never at every slot, and never at the queue.
"""
from __future__ import annotations

import heapq
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from hetflow.executors.scheduler import KEY, NEED, SlotScheduler

#: The slots a task may take: GPU slots only, CPU slots only, or any.
GPU, CPU, ANY = "gpu", "cpu", "any"


class _FreeRanks:
    """One node's free slots of one kind, lowest world rank first (a heap; a slot taken out
    of turn stays in it, skipped, until it reaches the top)."""

    __slots__ = ("heap", "members")

    def __init__(self):
        self.heap: List[Tuple[int, int]] = []
        self.members: set = set()

    def add(self, wrank: int, slot: int) -> None:
        if slot not in self.members:
            self.members.add(slot)
            heapq.heappush(self.heap, (wrank, slot))
            if len(self.heap) > 2 * len(self.members) + 16:     # skipped ones: compact
                self.heap = [e for e in set(self.heap) if e[1] in self.members]
                heapq.heapify(self.heap)

    def discard(self, slot: int) -> None:
        self.members.discard(slot)

    def top(self) -> Optional[Tuple[int, int]]:
        while self.heap and self.heap[0][1] not in self.members:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None

    def pop(self) -> Tuple[int, int]:
        entry = self.top()
        heapq.heappop(self.heap)
        self.members.discard(entry[1])
        return entry

    def __len__(self) -> int:
        return len(self.members)


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
        self.pinned_of = pinned_of
        #: slots whose rank holds GPUs (bound at its start)
        self.gpu_slots: set = set()
        self.world_of: Dict[int, int] = {}
        #: slot -> (node, world rank): where its rank runs
        self.where: Dict[int, Tuple[str, int]] = {}
        self._free_set: set = set()
        #: world -> node -> {GPU: _FreeRanks, CPU: _FreeRanks}
        self._nodes: Dict[int, Dict[str, Dict[str, _FreeRanks]]] = {}
        #: world -> node -> the lowest world rank on it (the order a multi-node task packs)
        self._lowest: Dict[int, Dict[str, int]] = {}
        self._sizes: Dict[int, List[int]] = {}      # world -> [slots, GPU slots]
        self._free_count: Dict[int, Dict[str, int]] = {}  # world -> {GPU: n, CPU: n}
        #: Free slots placement may use, by kind (a retiring world's held slots are not).
        self.free_total = {GPU: 0, CPU: 0}
        self._largest: Optional[List[int]] = None   # [slots, GPU slots] of the largest world

    # slots come and go with worlds (start, loss, replacement)
    def add_slot(self, slot: int, world: int, node: str = "", wrank: Optional[int] = None,
                 gpu: bool = False) -> None:
        wrank = slot if wrank is None else wrank
        self._largest = None
        self.world_of[slot] = world
        if gpu:
            self.gpu_slots.add(slot)
        self.where[slot] = (node, wrank)
        self.capacity += 1
        nodes = self._nodes.setdefault(world, {})
        nodes.setdefault(node, {GPU: _FreeRanks(), CPU: _FreeRanks()})
        lowest = self._lowest.setdefault(world, {})
        lowest[node] = min(lowest.get(node, wrank), wrank)
        size = self._sizes.setdefault(world, [0, 0])
        size[0] += 1
        size[1] += gpu
        self._free_count.setdefault(world, {GPU: 0, CPU: 0})

    def remove_slot(self, slot: int) -> None:
        if slot not in self.world_of:
            return
        self.hold([slot])
        self._largest = None
        world, (node, wrank) = self.world_of.pop(slot), self.where.pop(slot)
        size = self._sizes[world]
        size[0] -= 1
        size[1] -= slot in self.gpu_slots
        self.gpu_slots.discard(slot)
        self.capacity -= 1
        if not size[0]:
            for table in (self._nodes, self._lowest, self._sizes, self._free_count):
                del table[world]
        elif self._lowest[world][node] == wrank:    # rare: recount that node
            ranks = [w for s, (n, w) in self.where.items()
                     if n == node and self.world_of[s] == world]
            if ranks:
                self._lowest[world][node] = min(ranks)
            else:
                del self._lowest[world][node], self._nodes[world][node]

    def _kind(self, slot: int) -> str:
        return GPU if slot in self.gpu_slots else CPU

    def hold(self, slots: Iterable[int]) -> None:
        """Take ``slots`` out of the free slots without giving them to a task (a retiring
        world, or a task's)."""
        for slot in slots:
            if slot in self._free_set:
                self._free_set.discard(slot)
                world, kind = self.world_of[slot], self._kind(slot)
                self._nodes[world][self.where[slot][0]][kind].discard(slot)
                self._free_count[world][kind] -= 1
                self.free_total[kind] -= 1

    def release(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if slot in self.world_of and slot not in self._free_set:
                self._free_set.add(slot)
                world, kind, (node, wrank) = self.world_of[slot], self._kind(slot), self.where[slot]
                self._nodes[world][node][kind].add(wrank, slot)
                self._free_count[world][kind] += 1
                self.free_total[kind] += 1

    @property
    def free(self) -> List[int]:
        return sorted(self._free_set)

    @free.setter
    def free(self, slots) -> None:
        self.hold(list(self._free_set))
        self.release(slots)

    def world_sizes(self, gpu: bool = False) -> Dict[int, int]:
        """Slots per world (busy or free); ``gpu``: its GPU slots only."""
        return {world: size[gpu] for world, size in self._sizes.items() if size[gpu]}

    # ------------------------------------------------------------------ placement
    def need_key(self, item, slots: int, gpus: int) -> Hashable:
        pinned = self.pinned_of(item)
        return slots, bool(self.gpus_of(item)), None if pinned is None else tuple(pinned)

    def may_reshape(self, entry: list) -> bool:
        """A head that some world could hold once its tasks end needs nothing of the pool
        (it is told of pinned heads, whose ranks may be lost, and of heads bigger than every
        world: consolidation)."""
        _, gpu, pinned = entry[KEY]
        if pinned is not None:
            return True
        largest = self._largest
        if largest is None:             # slots came or went since: once per change
            largest = self._largest = [max((size[kind] for size in self._sizes.values()),
                                           default=0) for kind in (0, 1)]
        return largest[gpu] < entry[NEED]

    def _gpu_pinned(self, item, key) -> Tuple[bool, Optional[Sequence[int]]]:
        """Whether ``item`` needs GPU slots, and the slots it is pinned to (from its need key
        when known: no call of ``gpus_of``/``pinned_of`` per try)."""
        if key is not None:
            return key[1], key[2]
        return bool(self.gpus_of(item)), self.pinned_of(item)

    def may_fit(self, item, need: int, gpus: int, key: Hashable = None) -> bool:
        gpu = key[1] if key is not None else self.gpus_of(item)
        free = self.free_total[GPU] if gpu else len(self._free_set)
        return need <= free

    def _count(self, world: int, kind: str) -> int:
        free = self._free_count[world]
        return free[GPU] + free[CPU] if kind == ANY else free[kind]

    @staticmethod
    def _heaps(node: Dict[str, _FreeRanks], kind: str) -> List[_FreeRanks]:
        return [node[GPU], node[CPU]] if kind == ANY else [node[kind]]

    def _place(self, need: int, pinned: Optional[Sequence[int]], kind: str) -> Optional[List[int]]:
        """Free slots of ``kind`` for a task of ``need`` ranks within one world, or None; they
        leave their nodes' heaps here, and :meth:`take` holds them."""
        if pinned is not None:
            return list(pinned) if all(s in self._free_set for s in pinned) else None
        if len(self._nodes) == 1 and kind != ANY:
            # One world on one node (a pool on one machine, between faults): its heap's
            # lowest world ranks, what the search below finds, without the search.
            (world, nodes), = self._nodes.items()
            if len(nodes) == 1 and self._free_count[world][kind] >= need:
                (node,) = nodes.values()
                return [node[kind].pop()[1] for _ in range(need)]
        fits = []
        for world in self._nodes:
            free = self._count(world, kind)
            if free >= need:
                node = self._on_one_node(world, need, kind)
                fits.append((node is None, free, world, node))
        if not fits:
            return None
        _, _, world, node = min(fits, key=lambda fit: fit[:3])
        nodes = self._nodes[world]
        if node is not None:
            order = [node]
        else:                   # nodes in order (by their lowest world rank), packed
            order = sorted(nodes, key=self._lowest[world].__getitem__)
        slots: List[int] = []
        for name in order:
            heaps = self._heaps(nodes[name], kind)
            while len(slots) < need and any(heaps):
                best = min((h for h in heaps if h), key=lambda h: h.top())
                slots.append(best.pop()[1])
            if len(slots) == need:
                break
        return sorted(slots, key=lambda s: self.where[s][1])

    def _on_one_node(self, world: int, need: int, kind: str) -> Optional[str]:
        """The node of ``world`` with the fewest free ``kind`` slots that suffice, or None."""
        fits = []
        for name, node in self._nodes[world].items():
            heaps = [h for h in self._heaps(node, kind) if h]
            free = sum(len(h) for h in heaps)
            if free >= need:
                fits.append((free, min(h.top()[0] for h in heaps), name))
        return min(fits)[2] if fits else None

    def take_devices(self, item, gpus: int) -> Optional[list]:
        return []           # the pool's devices are its slots' (see take)

    def take(self, item, need: int, key: Hashable = None) -> Optional[List[int]]:
        gpu, pinned = self._gpu_pinned(item, key)
        if gpu:
            slots = self._place(need, pinned, GPU)
        else:
            slots = self._place(need, pinned, CPU) if self.free_total[CPU] >= need else None
            slots = slots or self._place(need, pinned, ANY)
        if slots is not None:
            self.hold(slots)
        return slots
