"""The rank-side half of an MPI app (no Parsl import: ranks start fast).

The rank-side runner sets the task's communicator with :class:`task_comm`;
:class:`MPITask` hands it to the user's function as its first argument.
"""
from __future__ import annotations

import functools
from _thread import _local   # threading.local itself; a rank need not import threading for it
from collections.abc import Callable

_task_context = _local()


def current_comm():
    """The communicator of the task running on this rank (None outside a task)."""
    return getattr(_task_context, "comm", None)


class task_comm:
    """Context manager the rank-side runner uses to hand ``comm`` to the app."""

    def __init__(self, comm):
        self.comm = comm

    def __enter__(self):
        self.previous = current_comm()
        _task_context.comm = self.comm
        return self.comm

    def __exit__(self, *exc):
        _task_context.comm = self.previous
        return False


class MPITask:
    """What executors run on each rank: calls ``fn(comm, *args, **kwargs)``.

    It is a plain picklable callable so any Parsl executor can carry it; the
    communicator comes from the rank-side runner (:func:`task_comm`).
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        kwargs.pop("parsl_resource_specification", None)
        comm = current_comm()
        if comm is None:
            from hetflow.errors import HetflowError   # here: ranks do not pay for the errors module
            raise HetflowError(
                f"MPI app {self.fn.__name__!r} ran outside an MPI task: no communicator "
                "(was it submitted to an executor that is not a hetflow executor?)")
        return self.fn(comm, *args, **kwargs)

    def __reduce__(self):
        return (MPITask, (self.fn,))
