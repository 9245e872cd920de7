"""hetflow: MPI apps on heterogeneous communicators, through interchangeable runtimes.

The public surface is this module's ``__all__``. Parsl-facing names load lazily
so that MPI ranks, which only need the rank-side runner, start fast.
"""
import importlib

from hetflow.errors import (BackendUnavailable, ConfigError, ExecutorBroken, HetflowError,
                            InputError, KeyColumnError, LaunchError, NotSupported,
                            ResourcesUnavailable, SchemaMismatch, TaskCancelled, TaskFailed,
                            TaskLost, WalltimeExceeded)
from hetflow.spec import Resources

__version__ = "0.1.0"

_LAZY = {
    "mpi_app": "hetflow.apps", "MPIApp": "hetflow.apps", "current_comm": "hetflow._task",
    "runtime": "hetflow.runtime", "available_runtimes": "hetflow.runtime",
    "task_times": "hetflow.tasks", "TaskTimes": "hetflow.tasks", "TaskState": "hetflow.tasks",
    "cancel": "hetflow.tasks", "task_state": "hetflow.tasks",
    "keep": "hetflow.resident", "Resident": "hetflow.resident",
    "InvalidResourceSpec": "hetflow.executors.kernel",
}

__all__ = sorted(set(_LAZY) | {
    "Resources", "HetflowError", "ConfigError", "InputError", "ResourcesUnavailable",
    "NotSupported", "LaunchError", "TaskFailed", "TaskLost", "WalltimeExceeded", "TaskCancelled",
    "ExecutorBroken", "KeyColumnError", "SchemaMismatch", "BackendUnavailable"})


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        # Importing a submodule named like one of its functions (hetflow.runtime) rebinds the
        # package attribute to the module: bind every name that module provides, now.
        for other, where in _LAZY.items():
            if where == _LAZY[name]:
                globals()[other] = getattr(module, other)
        return globals()[name]
    raise AttributeError(f"module 'hetflow' has no attribute {name!r}")


def __dir__():
    return __all__
