"""Shared fixtures: the executors every parity test runs on, and leak checks."""
from __future__ import annotations

import os
import sys

import pytest

# RADICAL-Pilot forks its components and makes logging's locks fork-safe when it is
# imported; that only works before pytest attaches its log handlers (else a fork can
# deadlock on a handler lock held by another thread). Import it first when installed.
try:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import radical.pilot  # noqa: F401 - imported for its fork-safety set-up
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

#: Executor name -> the options the tests start it with (4 rank slots on this 2-core
#: machine, so 3-rank tasks and heterogeneous pairs fit; oversubscribed on purpose).
EXECUTOR_OPTIONS = {
    "mpirun": {"max_ranks": 4},
    "parsl": {"max_ranks": 4},
    "pool": {"max_ranks": 4},
    "radical": {"max_ranks": 4},
}

#: The executors the parity suite runs on; each back-end adds itself here when it lands.
PARITY_EXECUTORS = ["mpirun", "parsl", "pool", "radical"]


@pytest.fixture(scope="module", params=PARITY_EXECUTORS)
def runtime_name(request):
    """Each parity-suite module runs once per executor, with that runtime loaded."""
    import hetflow

    with hetflow.runtime(request.param, **EXECUTOR_OPTIONS[request.param]):
        yield request.param


@pytest.fixture
def executor(runtime_name):
    """The loaded hetflow executor object of the current parity run."""
    from parsl.dataflow.dflow import DataFlowKernelLoader

    return DataFlowKernelLoader.dfk().executors[runtime_name]
