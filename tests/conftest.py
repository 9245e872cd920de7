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
    "slurm": {"max_ranks": 4},
}

# A run re-invoked by another test (test_allocation.py) may change the options: JSON
# {executor: {option: value}} in HETFLOW_TEST_OPTIONS.
for _name, _options in __import__("json").loads(os.environ.get("HETFLOW_TEST_OPTIONS", "{}")).items():
    EXECUTOR_OPTIONS.setdefault(_name, {}).update(_options)

#: The executors the parity suite runs on; each back-end adds itself here when it lands.
PARITY_EXECUTORS = ["mpirun", "parsl", "pool", "radical", "slurm"]

#: Executors that need the Slurm test cluster: their tests get the ``slurm`` marker.
SLURM_EXECUTORS = {"slurm"}
ROOT = os.path.dirname(HERE)
_slurm_missing = []     # [reason or None], once per session


def slurm_cluster_up() -> bool:
    """Whether a Slurm cluster answers here with at least one usable node."""
    import shutil
    import subprocess

    if not shutil.which("sinfo"):
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s.rstrip("*") in ("idle", "mix", "alloc")
                                       for s in out.stdout.split())


def _why_no_slurm():
    """None if the Slurm cluster is up (started by the project's own script as root if
    need be), else the reason it is not."""
    import subprocess

    if slurm_cluster_up():
        return None
    if os.geteuid() != 0:
        return "no Slurm cluster answers (sinfo) and not root to start one: run `make slurm-up`"
    up = subprocess.run([os.path.join(ROOT, ".ci", "slurm"), "up"], capture_output=True,
                        text=True, timeout=900)
    if up.returncode != 0 or not slurm_cluster_up():
        return f"`.ci/slurm up` could not start the Slurm test cluster:\n{up.stderr[-2000:]}"
    return None


def require_slurm():
    """Skip (fail in CI: there a skip is a failure) unless the Slurm test cluster is up."""
    if not _slurm_missing:
        _slurm_missing.append(_why_no_slurm())
    reason = _slurm_missing[0]
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the Slurm test cluster: {reason}", pytrace=False)
        pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    """A test run on a Slurm executor is a Slurm test."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v in SLURM_EXECUTORS for v in params.values()):
            item.add_marker(pytest.mark.slurm)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("slurm") is not None:
        require_slurm()


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


_slurm_outcomes = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if "slurm" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _slurm_outcomes[report.outcome] = _slurm_outcomes.get(report.outcome, 0) + 1


def pytest_terminal_summary(terminalreporter):
    """One line for the CI log: how many Slurm tests ran, and how they ended."""
    ran = _slurm_outcomes["passed"] + _slurm_outcomes["failed"]
    if ran or _slurm_outcomes["skipped"]:
        terminalreporter.write_line(
            f"slurm: {ran} Slurm tests ran ({_slurm_outcomes['passed']} passed, "
            f"{_slurm_outcomes['failed']} failed, {_slurm_outcomes['skipped']} skipped)")
