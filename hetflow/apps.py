"""``@mpi_app``: a Python function that runs on its own MPI communicator, as a Parsl app.

The decorated function is written ``def f(comm, *args, **kwargs)``. Calling it
submits a task to the loaded Parsl DataFlowKernel (so futures passed as
arguments become dependencies, and Parsl's retries, memoization and monitoring
apply); the executor runs it on ``ranks`` processes, each of which receives a
communicator of exactly that size, private to the call.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import pickle

from parsl.app.app import AppBase
from parsl.dataflow.dflow import DataFlowKernelLoader
from parsl.dataflow.memoization import id_for_memo

from hetflow._task import MPITask, current_comm, task_comm
from hetflow.errors import ConfigError, ResourcesUnavailable
from hetflow.spec import Resources

#: The per-call override keyword accepted by every MPI app.
RESOURCES_KWARG = "hetflow_resources"
#: The keyword that carries a call's arguments, pickled once at the call, to the executor
#: (which takes it out: the function never sees it; memoization ignores it).
ARGUMENTS_KWARG = "hetflow_pickled_arguments"


class MPIApp(AppBase):
    """The object ``@mpi_app`` returns; call it to get an AppFuture."""

    def __init__(self, fn: Callable, resources: Resources, *, executors="all",
                 cache: bool = False, ignore_for_cache: Optional[Sequence[str]] = None,
                 data_flow_kernel=None):
        self.resources = resources
        self.fn = fn
        #: Checked once (see __call__): the DFK every loaded executor was checked against,
        #: and a call without arguments' pickled arguments (the same bytes each time).
        self._fits_in = None
        self._bare_arguments: Optional[bytes] = None
        task = MPITask(fn)
        if isinstance(executors, str) and executors != "all":
            executors = [executors]      # one label, as the docs allow; Parsl wants a list
        super().__init__(task, data_flow_kernel=data_flow_kernel, executors=executors,
                         cache=cache, ignore_for_cache=ignore_for_cache)
        functools.update_wrapper(self, fn)

    def options(self, **overrides: Any) -> "MPIApp":
        """The same app with some resources replaced, e.g. ``f.options(ranks=4)(x)``."""
        return MPIApp(self.fn, self.resources.replace(**overrides), executors=self.executors,
                      cache=self.cache, ignore_for_cache=self.ignore_for_cache,
                      data_flow_kernel=self.data_flow_kernel)

    def __call__(self, *args: Any, **kwargs: Any):
        resources = self.resources
        override = kwargs.pop(RESOURCES_KWARG, None)
        if override is not None:
            if not isinstance(override, dict):
                raise ConfigError(f"{RESOURCES_KWARG} must be a dict, got {type(override).__name__}")
            resources = resources.replace(**override)
        if "parsl_resource_specification" in kwargs:
            from hetflow.executors.kernel import InvalidResourceSpec

            raise InvalidResourceSpec("pass resources through mpi_app(...), .options(...) or "
                                      f"{RESOURCES_KWARG}=..., not parsl_resource_specification",
                                      {"parsl_resource_specification"})
        app_kwargs = dict(self.kwargs)
        app_kwargs.update(kwargs)
        app_kwargs["parsl_resource_specification"] = resources.to_spec()
        # A call with no arguments (and the app's own resources) pickles the same bytes
        # every time, and has no resident handle to check: done once per app.
        bare = not args and not kwargs and not self.kwargs and resources is self.resources
        if bare and self._bare_arguments is not None:
            arguments = self._bare_arguments
        else:
            arguments = _pickled_arguments(self.fn.__name__, args, kwargs, app_kwargs)
            _check_resident(self.fn.__name__, resources, args, kwargs)
            if bare:
                self._bare_arguments = arguments
        dfk = self.data_flow_kernel or DataFlowKernelLoader.dfk()
        if resources is not self.resources or self._fits_in is None or self._fits_in() is not dfk:
            _check_fits(self.fn.__name__, resources, dfk, self.executors)
            if resources is self.resources:   # what fits stays fitting: executors are only added
                self._fits_in = weakref.ref(dfk)
        ignore_for_cache = self.ignore_for_cache
        if arguments is not None:
            app_kwargs[ARGUMENTS_KWARG] = arguments
            ignore_for_cache = list(ignore_for_cache or ()) + [ARGUMENTS_KWARG]
        # A checkpointed runtime memoizes every MPI app: that is what makes a restart skip them.
        cache = self.cache or bool(getattr(dfk, "hetflow_checkpoint", False))
        return dfk.submit(self.func, app_args=args, executors=self.executors, cache=cache,
                          ignore_for_cache=ignore_for_cache, app_kwargs=app_kwargs)


def _check_fits(name: str, resources: Resources, dfk, executors) -> None:
    """Raise ResourcesUnavailable at call time if no loaded executor could ever run the task.

    Executors that are not hetflow's (no ``check_resources``) are assumed to fit.
    """
    labels = list(dfk.executors) if executors == "all" else (
        [executors] if isinstance(executors, str) else list(executors))
    candidates = [dfk.executors[label] for label in labels
                  if label in dfk.executors and not label.startswith("_parsl")]
    if not candidates:
        return
    errors = []
    for executor in candidates:
        check = getattr(executor, "check_resources", None)
        if check is None:
            return
        try:
            check(resources)
            return
        except ResourcesUnavailable as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise ResourcesUnavailable(f"MPI app {name!r}: {errors[0]}")
    raise ResourcesUnavailable(f"MPI app {name!r} fits none of the loaded executors: "
                               + "; ".join(map(str, errors)))


@id_for_memo.register(MPITask)
def _memo_id(task: MPITask, output_ref: bool = False) -> bytes:
    # Like Parsl's rule for plain functions: identity is the function's module and name.
    return pickle.dumps(["hetflow.MPITask", task.fn.__module__, task.fn.__qualname__])


def _pickled_arguments(name: str, args, kwargs, app_kwargs) -> Optional[bytes]:
    """``(args, app_kwargs)`` pickled once, here, for the executor's payload; or None when
    Parsl resolves a Future among them later (the executor pickles them then, and only the
    others are checked here). ConfigError for what no executor could ship."""
    from concurrent.futures import Future

    if any(isinstance(value, Future) for value in list(args) + list(kwargs.values())):
        _check_picklable(name, args, kwargs)
        return None
    from hetflow.executors._pickling import dumps

    try:
        return dumps((tuple(args), app_kwargs))
    except Exception as exc:  # any pickling failure is the user's input (re-raised)
        _check_picklable(name, args, kwargs)          # names the argument, if it can
        raise ConfigError(f"the arguments of MPI app {name!r} cannot be pickled "
                          f"({type(exc).__name__}: {exc})") from exc


def _check_picklable(name: str, args, kwargs) -> None:
    """Reject arguments no executor could ship, at call time rather than on a rank."""
    import cloudpickle
    from concurrent.futures import Future

    for i, value in enumerate(list(args) + list(kwargs.values())):
        if isinstance(value, Future):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # any pickling failure is the user's input (re-raised)
            where = f"argument {i}" if i < len(args) else f"keyword {list(kwargs)[i - len(args)]!r}"
            raise ConfigError(f"{where} of MPI app {name!r} cannot be pickled "
                              f"({type(exc).__name__}: {exc})") from exc


def _check_resident(name: str, resources: Resources, args, kwargs) -> None:
    """A pool's kept object can only be used on the ranks that keep it: a task of another
    size fails here, at the call (a handle that arrives as a future, at its ``result()``)."""
    from hetflow.resident import Resident, find_handles

    for handle in find_handles(args, kwargs):
        if isinstance(handle, Resident) and handle.ranks != resources.ranks:
            raise ConfigError(
                f"MPI app {name!r}: resident data lives on {handle.ranks} rank(s) (pool slots "
                f"{list(handle.slots)}), but the task asks for ranks={resources.ranks}: it "
                "must run on those same ranks")


def mpi_app(function: Optional[Callable] = None, *, ranks: int = 1, cores_per_rank: int = 1,
            gpus_per_rank: int = 0, walltime: Optional[float] = None, returns: str = "root",
            retries: int = 0, executors: Union[str, Sequence[str]] = "all", cache: bool = False,
            ignore_for_cache: Optional[Sequence[str]] = None, data_flow_kernel=None):
    """Decorate ``def f(comm, *args, **kwargs)`` as an MPI app of ``ranks`` ranks.

    Usable bare (``@mpi_app``) or with arguments (``@mpi_app(ranks=4)``).
    """
    resources = Resources(ranks=ranks, cores_per_rank=cores_per_rank, gpus_per_rank=gpus_per_rank,
                          walltime=walltime, returns=returns, retries=retries)

    def decorate(fn: Callable) -> MPIApp:
        if not callable(fn):
            raise ConfigError(f"mpi_app decorates a function, got {fn!r}")
        return MPIApp(fn, resources, executors=executors, cache=cache,
                      ignore_for_cache=ignore_for_cache, data_flow_kernel=data_flow_kernel)

    return decorate(function) if function is not None else decorate


__all__ = ["mpi_app", "MPIApp", "MPITask", "current_comm", "task_comm"]
