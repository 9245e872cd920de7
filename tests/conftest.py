"""Shared fixtures: the executors every parity test runs on, and leak checks."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

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
#: The GPUs the local runtimes declare (no GPU here: ids as CUDA_VISIBLE_DEVICES spells
#: them, handed out but never opened), so GPU scheduling is tested on every runtime.
DECLARED_GPUS = ["7", "4"]
EXECUTOR_OPTIONS = {
    "mpirun": {"max_ranks": 4, "gpus": DECLARED_GPUS},
    "parsl": {"max_ranks": 4, "gpus": DECLARED_GPUS},
    "pool": {"max_ranks": 4, "gpus": DECLARED_GPUS},
    "radical": {"max_ranks": 4, "gpus": DECLARED_GPUS},
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
#: The test cluster's partitions (.ci/slurm) and their nodes: ``debug`` is the default; a
#: test marked ``slurm_partition("compute")`` runs its jobs there, in a chain of its own.
PARTITION_NODES = {"debug": ["n1", "n2"], "compute": ["n3", "n4"]}
SECOND_PARTITION = "compute"


def on_second_partition(*values):
    """``pytest.param`` of ``values`` marked to run on :data:`SECOND_PARTITION`."""
    return pytest.param(*values, marks=pytest.mark.slurm_partition(SECOND_PARTITION))


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


@pytest.hookimpl(tryfirst=True)     # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """A test run on a Slurm executor is a Slurm test; under pytest-xdist, every test
    gets the group it must share a worker with (see ``xdist_group_of``)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v in SLURM_EXECUTORS for v in params.values()):
            item.add_marker(pytest.mark.slurm)
        if shared_runtime_of(item) is not None:
            # The shared runtime starts in the setup of whichever of its tests comes first
            # (a radical one: three pilots, see SharedRuntime.use): its start is bounded by
            # the runtime's own startup_timeout, not by that one test's time limit.
            limit = item.get_closest_marker("timeout")
            seconds = (limit.args[0] if limit and limit.args
                       else limit.kwargs.get("timeout") if limit and "timeout" in limit.kwargs
                       else config.getini("timeout"))
            item.add_marker(pytest.mark.timeout(float(seconds), func_only=True))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for item in items:
            group = xdist_group_of(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


class _LongestFirst:
    """Under pytest-xdist, the dearest work is handed out first (run with
    ``--no-loadscope-reorder``, which keeps this order): the Slurm tests (one group, in
    series, most of it waiting on the queue), then everything that starts a
    RADICAL-Pilot pilot (~30 s and ~1 CPU to start, ~0.8 CPU while it runs), then the
    rest, each in collection order. A worker that picks up a long group last would
    make the whole run wait for it."""

    @pytest.hookimpl(trylast=True)   # after pytest ordered the tests by fixture
    def pytest_collection_modifyitems(self, items):
        def cost(item) -> tuple:
            radical = "radical" in item.nodeid or shared_runtime_of(item) == "radical"
            return (0 if item.get_closest_marker("slurm") else 1 if radical else 2,
                    item.get_closest_marker("after_shared_runtime") is not None)

        items.sort(key=cost)         # stable: keeps each group's order


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_LongestFirst(), "hetflow-longest-first")


def xdist_group_of(item) -> Optional[str]:
    """The tests that must run in one worker, one after another (``--dist loadgroup``).

    - Every Slurm test, one group per partition of the test cluster: a partition has 4
      CPUs, and its tests ask for all of them (allocations, placement); two at once would
      wait on each other's jobs. Most run on the default partition; those marked
      ``slurm_partition(name)`` (a second chain, about half as long) on theirs.
    - The tests that share a runtime (``SharedRuntime``): one group per executor.
    - Tests that share a module- or class-scoped fixture: one group per module and
      fixture parameter, so each worker does not start the fixture's runtime again.
    Any other test runs wherever a worker is free.
    """
    if item.get_closest_marker("slurm") is not None:
        partition = item.get_closest_marker("slurm_partition")
        return "slurm" if partition is None else f"slurm-{partition.args[0]}"
    shared = shared_runtime_of(item)
    if shared is not None:
        return f"runtime-{shared}"
    if item.get_closest_marker("after_shared_runtime") is not None:
        return f"runtime-{item.callspec.params['name']}"
    info = getattr(item, "_fixtureinfo", None)
    scoped = [name for name, defs in getattr(info, "name2fixturedefs", {}).items()
              if defs and defs[-1].scope in ("module", "class", "package")]
    if not scoped:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    keys = [str(params[name]) for name in scoped if name in params]
    return "-".join([item.path.name, *keys])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Where and when each test ran, as properties in the JUnit XML (make test-main
    # JUNIT=path): .ci/timeline reads them to show each worker's last tests.
    item.user_properties += [("worker", os.environ.get("PYTEST_XDIST_WORKER", "-")),
                             ("start", f"{time.time():.2f}")]
    if item.get_closest_marker("slurm") is not None:
        require_slurm()


class SharedRuntime:
    """The one runtime the parity-style modules (parity, faults, foundation) share.

    Starting a runtime is most of what those modules cost on the slow runtimes (a
    RADICAL-Pilot pilot: ~30 s to start, ~5 s to close), so each executor gets one
    life for all of them: ``runtime_param`` is session-scoped, which makes pytest run
    every module's tests on one executor together, and the runtime is closed as soon
    as the next test does not need it (``pytest_runtest_teardown``), so no other
    test ever runs beside it. Later tests thus run on a runtime that earlier ones
    crashed ranks of, timed out and cancelled tasks on: it must keep working.
    """

    def __init__(self):
        self.name: Optional[str] = None
        self._context = None
        self._failed: dict = {}     # name -> the error its start raised (not retried)
        #: name -> the last life of that executor's shared runtime that ended
        self.lives: dict[str, Life] = {}
        self._life: Optional[Life] = None

    def use(self, name: str) -> None:
        if self.name == name:
            return
        self.close()
        if name in self._failed:
            raise self._failed[name]
        import psutil

        import hetflow
        from hetflow.executors.radical import pilot as rp_pilot

        options = dict(EXECUTOR_OPTIONS[name])
        scratch = None
        if name == "radical":
            from rp_faults import FaultyDescriptions

            if "sandbox_dir" not in options:
                # RP's files go to a directory of the tests' choosing (test_radical.py
                # checks that all of them do, and that the runtime removes it).
                scratch = tempfile.mkdtemp(prefix="hetflow-shared-")
                options["sandbox_dir"] = os.path.join(scratch, "rp")
            # Its RAPTOR masters drop their first queue announcement: the loss
            # executors/radical/raptor_master.py survives, made to happen on every run. Outside
            # an allocation, its first pilot's agent also blocks in its start-up, as a
            # stalled agent does, then its next pilot's master is held unplaced, as a stuck
            # agent scheduler holds it: the runtime gives up on each pilot (AGENT_STALL_S
            # 15 s, SCHEDULER_STUCK_S 10 s here) and starts a new one. Once per run (a
            # pilot start is dear), on this host's pilot, not in the allocation tests' runs.
            here = not os.environ.get("SLURM_JOB_ID")
            options["descriptions"] = FaultyDescriptions(stall_first_agent=here,
                                                         hold_first_master=here)
        bystander = tmp = None
        if name == "radical":
            # a child the client had before the runtime: not the runtime's to end
            bystander = subprocess.Popen(["sleep", "3600"])
            # The temp dir the runtime takes at its start (its run dir; its ranks' TMPDIR) is
            # one of the life's own, so what its ~40 tests' tasks leave there is counted
            # exactly (test_radical.py; test_load.py's 100 tasks run on this life).
            if scratch is not None:
                tmp = os.path.join(scratch, "tmp")
                os.mkdir(tmp, 0o700)
            # RP's sockets share the process's ZeroMQ context (zmq.Context.instance(), never
            # terminated), whose I/O threads' descriptors open with its first socket and then
            # stay: opened first here, so that the life's descriptors count from after them.
            import zmq

            zmq.Context.instance().socket(zmq.PUB).close()
        life = Life(children={p.pid for p in psutil.Process().children(recursive=True)},
                    environ=dict(os.environ), scratch=scratch, bystander=bystander, tmp=tmp,
                    fds=open_descriptors())
        context = hetflow.runtime(name, **options)
        stuck_s, rp_pilot.SCHEDULER_STUCK_S = rp_pilot.SCHEDULER_STUCK_S, 10.0
        stall_s, rp_pilot.AGENT_STALL_S = rp_pilot.AGENT_STALL_S, 15.0
        tempdir = tempfile.tempdir
        try:
            if tmp is not None:
                tempfile.tempdir = tmp        # read by the start only (tempfile.gettempdir)
            dfk = context.__enter__()
        except Exception as exc:
            self._failed[name] = exc
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            if bystander is not None:
                bystander.kill()
                bystander.wait()
            raise
        finally:
            rp_pilot.SCHEDULER_STUCK_S, rp_pilot.AGENT_STALL_S = stuck_s, stall_s
            tempfile.tempdir = tempdir
        life.executor, life.token = dfk.executors[name], dfk.hetflow_token
        self.name, self._context, self._life = name, context, life

    def close(self) -> None:
        name, context, self.name, self._context = self.name, self._context, None, None
        if context is not None:
            life, self._life = self._life, None
            try:
                context.__exit__(None, None, None)
            finally:
                lived.add(name)
                self.lives[name] = life
                if life.bystander is not None:
                    life.bystander_outlived = life.bystander.poll() is None
                    life.bystander.kill()
                    life.bystander.wait()
                if life.tmp is not None:
                    life.tmp_left = [os.path.relpath(os.path.join(d, n), life.tmp)
                                     for d, dirs, files in os.walk(life.tmp)
                                     for n in dirs + files]
                    shutil.rmtree(life.tmp, ignore_errors=True)
                if life.scratch is not None:
                    life.scratch_left = os.listdir(life.scratch)
                    shutil.rmtree(life.scratch, ignore_errors=True)


@dataclasses.dataclass
class Life:
    """One life of a shared runtime, for the tests that check what it left behind."""
    children: set                       # the client's child processes before it started
    environ: dict                       # os.environ before it started
    scratch: Optional[str] = None       # a temp dir holding its sandbox_dir, if it had one
    scratch_left: list = dataclasses.field(default_factory=list)  # in it after the close
    executor: object = None             # the hetflow executor
    token: Optional[str] = None         # the runtime's token (hetflow._guardian)
    bystander: object = None            # a child process the client started before it
    bystander_outlived: bool = False    # ... still running after the runtime's close
    tmp: Optional[str] = None           # the temp dir its start took (in scratch), if any
    tmp_left: list = dataclasses.field(default_factory=list)    # in it after the close
    fds: dict = dataclasses.field(default_factory=dict)   # open_descriptors() before it


def open_descriptors() -> dict:
    """This process's open file descriptors: ``{fd: what it refers to}``."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:            # the listing's own descriptor, closed since
            pass
    return found


shared_runtime = SharedRuntime()
#: Executors a whole runtime life of which (start, tasks, shutdown) has passed in this
#: process: its imports and lazily opened descriptors are there (see test_load.py).
lived: set = set()


def shared_runtime_of(item) -> Optional[str]:
    """The executor whose shared runtime test ``item`` runs on, if any: a parity-style
    test's ``runtime_param``, or a test marked ``on_shared_runtime(name)``."""
    if item is None:
        return None
    if "runtime_param" in getattr(item, "fixturenames", ()):
        return item.callspec.params.get("runtime_param")
    marker = item.get_closest_marker("on_shared_runtime")
    return marker.args[0] if marker is not None else None


@pytest.fixture(scope="session", params=PARITY_EXECUTORS)
def runtime_param(request):
    """The executor of a parity-style test (session-scoped: see SharedRuntime)."""
    return request.param


@pytest.fixture
def runtime_name(runtime_param):
    """Each parity-suite test runs once per executor, with that runtime loaded."""
    shared_runtime.use(runtime_param)
    return runtime_param


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Close the shared runtime after its last test in a row (see SharedRuntime)."""
    try:
        return (yield)
    finally:
        if shared_runtime.name is not None and shared_runtime_of(nextitem) != shared_runtime.name:
            shared_runtime.close()


@pytest.fixture
def shared_executor(request):
    """The executor of a test marked ``on_shared_runtime(name)``, its shared runtime up."""
    from parsl.dataflow.dflow import DataFlowKernelLoader

    name = request.node.get_closest_marker("on_shared_runtime").args[0]
    shared_runtime.use(name)
    return DataFlowKernelLoader.dfk().executors[name]


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
