"""Packing tasks onto rank slots and GPUs: FIFO with bounded backfill (the kernel's queue).

A decision costs the same with 10 or 100,000 tasks waiting. Waiting tasks are kept in
one FIFO per *need* (what a task asks for: slots, GPUs, and for the pool its pinned
slots): tasks with the same need fit or do not fit alike, so a decision looks at the
first task of each need, never further down a queue. Free slots and devices are heaps
(the lowest ids first, as before), so taking and giving back cost ``log`` of their
number. :attr:`SlotScheduler.steps` counts the needs looked at, so tests can check that
no decision walks the queue.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Callable, Dict, Hashable, List, Optional, Sequence

#: An entry's fields: ``entry[ITEM]`` and so on (kept a list: runtimes read the head's
#: item and need as ``head[0]``, ``head[1]``).
ITEM, NEED, BYPASSED, GPUS, SEQ, KEY, QUEUED = range(7)


class SlotScheduler:
    """Packs tasks onto ``capacity`` slots: FIFO, with backfill that cannot starve.

    A task that does not fit lets later, smaller ones pass it at most
    ``max_bypass`` times; after that nothing passes it until it has run.
    Slots are concrete numbers (used for pinning); a subclass with its own
    placement rules (the pool's worlds) overrides :meth:`take`, :meth:`need_key`
    and :meth:`may_fit`.

    GPUs are a second resource: ``devices`` are the ids the tasks share; a task needing
    ``gpus`` of them waits until that many are free (as for slots), so tasks running at
    once hold disjoint devices and a task needing none runs beside them.
    """

    def __init__(self, capacity: int, max_bypass: int = 16, devices: Sequence[str] = ()):
        self.capacity = capacity
        self.max_bypass = max_bypass
        self._free: List[int] = list(range(capacity))      # a heap
        self.devices = list(devices)
        self._device_index = {d: i for i, d in enumerate(self.devices)}
        self._free_devices: List[int] = list(range(len(self.devices)))  # a heap of indices
        #: need key -> the FIFO of entries with that need (``[item, need, bypassed, gpus,
        #: seq, key, queued]``); ``seq`` orders entries across needs.
        self._needs: Dict[Hashable, deque] = {}
        self._entries: Dict[object, list] = {}             # item -> its entry, while queued
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)
        #: Needs looked at by :meth:`pop_ready` (one per FIFO head tried), ever.
        self.steps = 0
        #: The queue's head when the last :meth:`pop_ready` stopped because it did not fit.
        self.blocked = None

    # ------------------------------------------------------------------ the queue
    def need_key(self, item, slots: int, gpus: int) -> Hashable:
        """What decides whether ``item`` fits: items with equal keys fit or not alike."""
        return slots, gpus

    def push(self, item, slots: int, gpus: int = 0) -> None:
        self._enqueue(item, slots, gpus, next(self._back), front=False)

    def push_front(self, item, slots: int, gpus: int = 0) -> None:
        """Queue ``item`` first (it ran and lost its ranks through no fault of its own)."""
        self._enqueue(item, slots, gpus, next(self._front), front=True)

    def _enqueue(self, item, slots: int, gpus: int, seq: int, front: bool) -> None:
        key = self.need_key(item, slots, gpus)
        entry = [item, slots, 0, gpus, seq, key, True]
        fifo = self._needs.setdefault(key, deque())
        fifo.appendleft(entry) if front else fifo.append(entry)
        self._entries[item] = entry

    def remove(self, item) -> bool:
        """Take ``item`` out of the queue (its entry is dropped when it reaches the front)."""
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        entry[QUEUED] = False
        self._first(entry[KEY])
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def drain(self) -> list:
        """Every queued item, in queue order; the queue is empty afterwards."""
        entries = sorted(self._entries.values(), key=lambda e: e[SEQ])
        self._entries.clear()
        self._needs.clear()
        self.blocked = None
        return [e[ITEM] for e in entries]

    def _first(self, key) -> Optional[list]:
        """The first queued entry of need ``key`` (removed ones dropped on the way)."""
        fifo = self._needs.get(key)
        while fifo and not fifo[0][QUEUED]:
            fifo.popleft()
        if not fifo:
            self._needs.pop(key, None)
            return None
        return fifo[0]

    def _heads(self) -> List[list]:
        """The first entry of each need, in queue order."""
        if len(self._needs) == 1:       # one need (tasks of one shape): no sort
            (key,) = self._needs
            head = self._first(key)
            return [head] if head is not None else []
        heads = [self._first(key) for key in list(self._needs)]
        return sorted((h for h in heads if h is not None), key=lambda e: e[SEQ])

    def head(self) -> Optional[list]:
        """The first queued entry ``[item, need, bypassed, gpus, ...]``, or None."""
        heads = self._heads()
        return heads[0] if heads else None

    # ------------------------------------------------------------------ decisions
    def may_reshape(self, entry: list) -> bool:
        """Whether the runtime may need to reshape its slots for the blocked head ``entry``
        (it is told of it only then); here always: a deep queue's head waits for busy slots
        once per task, and a runtime that knows when that is all it waits for says so."""
        return True

    def may_fit(self, item, need: int, gpus: int, key: Hashable = None) -> bool:
        """False when ``item`` cannot fit now, without trying (cheap: no slot is looked at);
        ``key``: its :meth:`need_key`, when known."""
        return need <= len(self._free) and gpus <= len(self._free_devices)

    def pop_ready(self, take: Optional[Callable] = None) -> List[tuple]:
        """Entries that can start now, as ``(item, slots, devices)``; both are taken.

        FIFO: the head runs when it fits. When it does not, the earliest queued task that
        fits passes it (at most ``max_bypass`` times in all). Each step looks at the first
        task of each need only, and ends when the free slots fit none of them.
        """
        take = take or self.take
        ready: List[tuple] = []
        self.blocked = None
        while self._entries:
            heads = self._heads()
            head = heads[0]
            if self.blocked is None:
                got = self._try(head, take)
                if got is not None:
                    ready.append(got)
                    continue
                self.blocked = head
            if head[BYPASSED] >= self.max_bypass:
                break
            passer = None
            for entry in heads[1:]:
                passer = self._try(entry, take)
                if passer is not None:
                    break
            if passer is None:
                break
            ready.append(passer)
            head[BYPASSED] += 1
        return ready

    def _try(self, entry: list, take: Callable) -> Optional[tuple]:
        """Start ``entry`` if it fits: ``(item, slots, devices)``, its slots and devices taken."""
        self.steps += 1
        item, need, gpus, key = entry[ITEM], entry[NEED], entry[GPUS], entry[KEY]
        if not self.may_fit(item, need, gpus, key):
            return None
        devices = self.take_devices(item, gpus)
        slots = take(item, need, key) if devices is not None else None
        if slots is None:
            if devices:
                self.release_devices(devices)
            return None
        del self._entries[item]
        entry[QUEUED] = False
        self._first(entry[KEY])
        return item, slots, devices

    # ------------------------------------------------------------------ slots and devices
    @property
    def free(self) -> List[int]:
        """The free slots, lowest first (a copy)."""
        return sorted(self._free)

    @free.setter
    def free(self, slots) -> None:
        self._free = list(slots)
        heapq.heapify(self._free)

    @property
    def free_devices(self) -> List[str]:
        """The free device ids, in their declared order (a copy)."""
        return [self.devices[i] for i in sorted(self._free_devices)]

    def take(self, item, need: int, key: Hashable = None) -> Optional[list]:
        """Take slots for ``item`` (the ``need`` lowest free ones), or None when it does not fit;
        ``key``: its :meth:`need_key`, when known."""
        if need > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(need)]

    def take_devices(self, item, gpus: int) -> Optional[list]:
        """Take ``gpus`` free device ids for ``item`` (the first declared ones), or None."""
        if gpus > len(self._free_devices):
            return None
        return [self.devices[heapq.heappop(self._free_devices)] for _ in range(gpus)]

    def release(self, slots) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)

    def release_devices(self, devices) -> None:
        """Give device ids back (handed out in their declared order, so placement repeats)."""
        free = set(self._free_devices)
        for device in devices:
            index = self._device_index[device]
            if index not in free:
                free.add(index)
                heapq.heappush(self._free_devices, index)
