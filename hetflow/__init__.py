"""hetflow: MPI apps on heterogeneous communicators, through interchangeable runtimes.

The public surface is this module's ``__all__``. Every name loads on first use, so
that an MPI rank, which imports this package on its way to the rank-side runner,
pays for nothing a no-op task does not need (the errors module alone pulls in
``concurrent.futures`` and ``logging``).
"""
import importlib
import os as _os

__version__ = "0.1.0"

# An install maps the checkout's executors/ and experiments/ to hetflow.executors and
# hetflow.experiments (pyproject's package-dir). Python started in the checkout's root
# imports this folder instead of the install: find those two beside it there too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "executors")) and _os.path.isfile(
        _os.path.join(_checkout, "executors", "__init__.py")):
    __path__.append(_checkout)

_ERRORS = ("BackendUnavailable", "ConfigError", "ExecutorBroken", "HetflowError", "InputError",
           "KeyColumnError", "LaunchError", "NotSupported", "PartitionFailed", "ResourcesUnavailable",
           "SchemaMismatch", "TableHandoffError", "TaskCancelled", "TaskFailed", "TaskLost",
           "WalltimeExceeded")

#: Submodules that ``import hetflow`` used to import eagerly: ``hetflow.errors.X`` keeps working.
_SUBMODULES = ("errors", "spec")

_LAZY = {
    **{name: "hetflow.errors" for name in _ERRORS}, "Resources": "hetflow.spec",
    "mpi_app": "hetflow.apps", "MPIApp": "hetflow.apps", "current_comm": "hetflow._task",
    "runtime": "hetflow.runtime", "available_runtimes": "hetflow.runtime",
    "task_times": "hetflow.tasks", "TaskTimes": "hetflow.tasks", "TaskState": "hetflow.tasks",
    "cancel": "hetflow.tasks", "task_state": "hetflow.tasks", "task_output": "hetflow.tasks",
    "task_samples": "hetflow.tasks",
    "keep": "hetflow.resident", "Resident": "hetflow.resident", "TableHandle": "hetflow.tables",
    "InvalidResourceSpec": "hetflow.executors.kernel", "DependencyFailed": "hetflow._chained",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        # Importing a submodule named like one of its functions (hetflow.runtime) rebinds the
        # package attribute to the module: bind every name that module provides, now.
        for other, where in _LAZY.items():
            if where == _LAZY[name]:
                globals()[other] = getattr(module, other)
        return globals()[name]
    if name in _SUBMODULES:
        return importlib.import_module(f"hetflow.{name}")
    raise AttributeError(f"module 'hetflow' has no attribute {name!r}")


def __dir__():
    return __all__
