"""Resident data: objects that stay on a pool task's ranks for a later task on the same ranks.

Inside a task run by the ``pool`` runtime, ``return hetflow.keep(table)`` stores
``table`` in the rank's memory and returns a small picklable :class:`Resident`
handle. Passing that handle to a later task makes the pool place the task on the
very same ranks (same rank order), where the handle unpickles into the live
object again: nothing travels through the client. Every rank of the task calls
``keep`` (collectively, in the same order), so every rank keeps its own part.

An object bound to a communicator (an mpi4py ``comm`` attribute, like
``frame.DistributedTable``) reaches the later task rebound to that task's
communicator over the same ranks: the communicator it was made on ended with its task.

Outside the pool (other runtimes, or plain Python) ``keep`` raises
:class:`~hetflow.NotSupported`: only a persistent pool has ranks that outlive a task.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from hetflow.errors import HetflowError, NotSupported

# Rank-side state, set by the pool worker around each task (None on the client).
_local = threading.local()
_store: Dict[str, Any] = {}
_pool_uid: Optional[str] = None
_released: set = set()     # keys dropped by release(): a later use says so (a few bytes each)


@dataclass(frozen=True)
class Resident:
    """A handle to an object kept on the ranks ``slots`` of pool ``pool`` (in task-rank order).

    Pickling the handle carries only ``key``, ``slots`` and ``pool``; on one of
    those ranks it unpickles into the live object, anywhere else into the handle.
    """

    key: str
    pool: str
    slots: Tuple[int, ...]
    type_name: str = ""

    @property
    def ranks(self) -> int:
        """How many ranks hold a part of the object (a consuming task must ask for exactly this)."""
        return len(self.slots)

    def __reduce__(self):
        return (_resolve, (self.key, self.pool, self.slots, self.type_name))

    def __repr__(self):
        return (f"Resident({self.type_name or 'object'} on pool slots {list(self.slots)}, "
                f"key={self.key!r})")


class ResidentMissing(HetflowError, LookupError):
    """A task got a :class:`Resident` handle but its rank does not hold that object."""


def _resolve(key: str, pool: str, slots, type_name: str = ""):
    """Unpickle hook: the live object on a rank that holds it, else the handle itself."""
    handle = Resident(key=key, pool=pool, slots=tuple(slots), type_name=type_name)
    task = getattr(_local, "task", None)
    if _pool_uid is None or task is None:
        return handle          # the client, or a rank outside a task: keep the handle
    if key in _store:
        return _rebind(_store[key], task.get("comm"))
    return stored(key, handle, type_name)


def current_task() -> Optional[dict]:
    """The pool task running on this rank (None on the client, or outside the pool)."""
    return getattr(_local, "task", None) if _pool_uid is not None else None


def stored(key: str, handle, type_name: str = ""):
    """The object this rank keeps under ``key`` for ``handle``; ResidentMissing saying why not."""
    if key in _store:
        return _store[key]
    task = current_task() or {}
    what = f"resident object {key!r} ({type_name or 'object'})"
    if key in _released:
        raise ResidentMissing(f"{what} was released (hetflow.resident.release) before this "
                              "task used it; keep it again to use it")
    raise ResidentMissing(
        f"{what} lives on pool slots {list(handle.slots)}, but this rank (pool slot "
        f"{task.get('slot')}, a task on slots {list(task.get('slots', ()))}) does not hold it: "
        "a task consuming resident data must run on the ranks that made it")


def _rebind(obj: Any, comm):
    """``obj`` itself, or a shallow copy on ``comm`` if it holds an MPI communicator."""
    held = getattr(obj, "comm", None)
    if comm is None or held is None or held is comm:
        return obj
    from mpi4py import MPI

    if not isinstance(held, MPI.Comm):
        return obj
    from hetflow.frame import DistributedTable

    if isinstance(obj, DistributedTable):
        # Built on ``comm`` itself: a copy would first touch the old communicator, which
        # may already be freed with the task that kept the table.
        return DistributedTable(comm, obj.local, backend=obj.backend)
    import copy

    rebound = copy.copy(obj)
    rebound.comm = comm
    return rebound


def keep(obj: Any) -> Resident:
    """Keep ``obj`` on this rank for a later task; returns the handle to return from the task.

    Call it on every rank of the task (the same number of times, in the same
    order), and return the handle (rank 0's is the task's value by default).
    Raises NotSupported outside a ``pool`` runtime task.
    """
    task = getattr(_local, "task", None)
    if _pool_uid is None or task is None:
        raise NotSupported(
            "resident_data: hetflow.keep() needs the 'pool' runtime (a persistent MPI pool whose "
            "ranks outlive a task); this task runs under another runtime or outside any task")
    task["kept"] += 1
    key = f"{task['task_id']}.{task['kept']}"
    _store[key] = obj
    return Resident(key=key, pool=_pool_uid, slots=tuple(task["slots"]),
                    type_name=type(obj).__qualname__)


def release(handle) -> None:
    """Drop a kept object from the ranks holding it (call on the client, with the handle).

    Kept objects otherwise live as long as their ranks; a later task given the
    released handle fails with :class:`ResidentMissing`. A ``hetflow.TableHandle``
    is released too: a pool's from its ranks, any other's files removed at once.
    """
    from hetflow.tables import TableHandle

    if isinstance(handle, TableHandle) and not handle.pool:
        for path in handle.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return
    if not isinstance(handle, (Resident, TableHandle)):
        raise TypeError(f"release() takes a Resident handle, got {type(handle).__name__}")
    from parsl.dataflow.dflow import DataFlowKernelLoader

    from hetflow.errors import ConfigError

    for executor in DataFlowKernelLoader.dfk().executors.values():
        if getattr(executor, "uid", None) == handle.pool:
            executor.release_resident(handle)
            return
    raise ConfigError(f"{handle!r}: no loaded pool holds it (its pool has shut down?)")


def _drop(key: str) -> None:
    _store.pop(key, None)
    _released.add(key)


# ----------------------------------------------------------------- used by the pool worker
def _set_pool(uid: str) -> None:
    global _pool_uid
    _pool_uid = uid


def _enter_task(task_id: int, slots, slot: int, comm=None) -> None:
    _local.task = {"task_id": task_id, "slots": tuple(slots), "slot": slot, "kept": 0,
                   "comm": comm}


def _leave_task() -> None:
    _local.task = None


def find_handles(args, kwargs) -> list:
    """The :class:`Resident` handles among a task's arguments (top level and one level down),
    with the handles of tables a pool's task returned (``hetflow.TableHandle``)."""
    from hetflow.tables import TableHandle

    found = []

    def visit(value, depth):
        if isinstance(value, Resident) or (isinstance(value, TableHandle) and value.pool):
            found.append(value)
        elif depth and isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                visit(item, depth - 1)
        elif depth and isinstance(value, dict):
            for item in value.values():
                visit(item, depth - 1)

    for value in list(args) + list(kwargs.values()):
        visit(value, 1)
    return found


__all__ = ["Resident", "ResidentMissing", "keep", "release", "find_handles"]
