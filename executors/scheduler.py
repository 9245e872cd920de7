"""Packing tasks onto rank slots and GPUs: FIFO with bounded backfill (the kernel's queue)."""
from __future__ import annotations

from collections import deque
from typing import Callable, List, Optional, Sequence


class SlotScheduler:
    """Packs tasks onto ``capacity`` slots: FIFO, with backfill that cannot starve.

    A task that does not fit lets later, smaller ones pass it at most
    ``max_bypass`` times; after that nothing passes it until it has run.
    Slots are concrete numbers (used for pinning); a subclass with its own
    placement rules (the pool's worlds) overrides :meth:`take`.

    GPUs are a second resource: ``devices`` are the ids the tasks share; a task needing
    ``gpus`` of them waits until that many are free (as for slots), so tasks running at
    once hold disjoint devices and a task needing none runs beside them.
    """

    def __init__(self, capacity: int, max_bypass: int = 16, devices: Sequence[str] = ()):
        self.capacity = capacity
        self.max_bypass = max_bypass
        self.free = list(range(capacity))
        self.devices = list(devices)
        self.free_devices = list(devices)
        self.queue: deque = deque()  # entries: [item, slots_needed, bypassed, gpus_needed]

    def push(self, item, slots: int, gpus: int = 0) -> None:
        self.queue.append([item, slots, 0, gpus])

    def push_front(self, item, slots: int, gpus: int = 0) -> None:
        """Queue ``item`` first (it ran and lost its ranks through no fault of its own)."""
        self.queue.appendleft([item, slots, 0, gpus])

    def remove(self, item) -> bool:
        for entry in self.queue:
            if entry[0] is item:
                self.queue.remove(entry)
                return True
        return False

    def head(self):
        """The first queued entry ``[item, need, bypassed]``, or None."""
        return self.queue[0] if self.queue else None

    def take(self, item, need: int) -> Optional[list]:
        """Take slots for ``item`` (the first ``need`` free ones), or None when it does not fit."""
        if need > len(self.free):
            return None
        slots, self.free = self.free[:need], self.free[need:]
        return slots

    def take_devices(self, item, gpus: int) -> Optional[list]:
        """Take ``gpus`` free device ids for ``item`` (the first ones), or None."""
        if gpus > len(self.free_devices):
            return None
        devices, self.free_devices = self.free_devices[:gpus], self.free_devices[gpus:]
        return devices

    def pop_ready(self, take: Optional[Callable] = None) -> List[tuple]:
        """Entries that can start now, as ``(item, slots, devices)``; both are taken."""
        take = take or self.take
        ready = []
        blocked_head = None
        for entry in list(self.queue):
            item, need, _, gpus = entry
            allowed = blocked_head is None or blocked_head[2] < self.max_bypass
            devices = self.take_devices(item, gpus) if allowed else None
            slots = take(item, need) if devices is not None else None
            if slots is None and devices:
                self.release_devices(devices)
            if slots is not None:
                self.queue.remove(entry)
                ready.append((item, slots, devices))
                if blocked_head is not None:
                    blocked_head[2] += 1
            elif blocked_head is None:
                blocked_head = entry
        return ready

    def release(self, slots) -> None:
        self.free = sorted(self.free + list(slots))

    def release_devices(self, devices) -> None:
        """Give device ids back (kept in their declared order, so placement is repeatable)."""
        back = set(self.free_devices) | set(devices)
        self.free_devices = [d for d in self.devices if d in back]
