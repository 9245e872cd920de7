"""Load: hundreds of short MPI tasks of mixed sizes (1-3 ranks) through each executor.

Every result must be correct, and a whole runtime life (start, the tasks, shut
down) must leak no processes, file descriptors or temp dirs: the test gives the
runtime a private ``TMPDIR`` (inherited by launchers, ranks and workers) that
must be empty again afterwards, and compares the client's child processes and
open descriptors before and after. On radical the tasks run on the tests' shared pilot
(conftest.SharedRuntime: a pilot's start and close cost ~40 s and a CPU), whose whole
life is checked the same way after its close (test_radical.py), with a temp dir of its
own as its ranks' ``TMPDIR``.

Task count: 500 where a task is cheap (the pool: 500 in ~0.7 s). Executors that
start one ``mpiexec`` per task (mpirun, Parsl's MPI mode) took ~105 s for 500 on 2
shared cores, radical ~44 s; every task takes the same path,
so CI runs 100 on those, and on slurm (a batch job per task, about 1 s each through
the queue). ``HETFLOW_LOAD_TASKS=500`` runs 500 everywhere;
``HETFLOW_LOAD_TASKS=radical=500,parsl=200`` sets counts per executor. The count per
executor is printed with its throughput.
"""
import os
import tempfile
import time

import psutil
import pytest

import hetflow
from bounds import RECOVERY_S
from conftest import EXECUTOR_OPTIONS, PARITY_EXECUTORS, lived, on_second_partition
from hetflow._guardian import marked_processes

#: Default task count per executor (see the module docstring); others run 500.
DEFAULT_TASKS = {"mpirun": 100, "parsl": 100, "radical": 100, "slurm": 100}


def task_count(name: str) -> int:
    """Tasks for executor ``name``: ``HETFLOW_LOAD_TASKS`` ("N" or "name=N,..."), else default."""
    override = os.environ.get("HETFLOW_LOAD_TASKS", "").strip()
    if override and "=" not in override:
        return int(override)
    counts = dict(item.split("=", 1) for item in override.split(",") if "=" in item)
    if name in counts:
        return int(counts[name])
    return DEFAULT_TASKS.get(name, 500)

pytestmark = pytest.mark.timeout(900)


@hetflow.mpi_app(ranks=1)
def rank_sum(comm, i):
    return comm.allreduce(i + comm.Get_rank())


def _expected(i, ranks):
    return sum(i + r for r in range(ranks))


def _snapshot():
    me = psutil.Process()
    return {"children": sorted(p.pid for p in me.children(recursive=True)), "fds": me.num_fds()}


def _settled(before, timeout=60):
    """The snapshot once it is back to ``before`` (processes end asynchronously)."""
    deadline = time.time() + timeout
    while True:
        after = _snapshot()
        if (after["children"] == before["children"] and after["fds"] <= before["fds"]) \
                or time.time() > deadline:
            return after
        time.sleep(0.2)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A TMPDIR of the test's own, so leaked temp dirs can be counted exactly."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)   # gettempdir() reads TMPDIR again
    yield tmp
    tempfile.tempdir = None


@pytest.mark.after_shared_runtime
@pytest.mark.parametrize("name", [on_second_partition(name) if name == "slurm" else name
                                  for name in PARITY_EXECUTORS if name != "radical"])
def test_many_mixed_tasks_lose_nothing_and_leak_nothing(name, private_tmp, request):
    options = dict(EXECUTOR_OPTIONS[name])
    partition = request.node.get_closest_marker("slurm_partition")
    if partition is not None:
        # The slurm case: 100 batch jobs, each started on slurmctld's 1 s scheduling
        # tick, so mostly waiting: on a partition of its own beside the other Slurm tests.
        options["partition"] = partition.args[0]
    tasks = task_count(name)
    # One short life first: imports and lazily opened descriptors (log files, entropy) are
    # the interpreter's, not leaks. The shared runtime's (conftest.SharedRuntime) was one
    # if it ran in this process: this test runs after it, in its group (a RADICAL-Pilot
    # life costs ~40 s and a CPU).
    if name not in lived:
        with hetflow.runtime(name, **options):
            assert [rank_sum.options(ranks=r)(0).result() for r in (1, 2, 3)] == [0, 1, 3]
    before = _settled(_snapshot())

    sizes = [1 + (i % 3) for i in range(tasks)]            # 1, 2, 3 ranks, interleaved
    with hetflow.runtime(name, **options) as dfk:
        run_dir = dfk.executors[name].run_dir
        token = dfk.hetflow_token
        start = time.time()
        futures = [rank_sum.options(ranks=r)(i) for i, r in enumerate(sizes)]
        results = [f.result(timeout=600) for f in futures]
        elapsed = time.time() - start
    print(f"\n{name}: {tasks} mixed 1-3 rank tasks in {elapsed:.1f} s "
          f"({tasks / elapsed:.1f} tasks/s)")
    assert results == [_expected(i, r) for i, r in enumerate(sizes)]

    after = _settled(before)
    assert after["children"] == before["children"], f"leaked processes: {after['children']}"
    # Daemonised runtime processes (RP's bridges and agent) are nobody's children:
    # they carry the runtime's token (hetflow._guardian).
    assert not marked_processes(token), f"leaked processes: {marked_processes(token)}"
    assert after["fds"] <= before["fds"], f"leaked file descriptors: {before} -> {after}"
    assert not os.path.exists(run_dir), f"run dir {run_dir} left behind"
    leftovers = sorted(os.listdir(private_tmp))
    assert not leftovers, f"temp files / dirs left behind: {leftovers}"


@pytest.mark.on_shared_runtime("radical")
def test_many_mixed_tasks_lose_nothing_and_leak_nothing_on_the_radical_pilot(shared_executor):
    # radical: the tasks run on the shared pilot (conftest.SharedRuntime), where a life of
    # their own cost a pilot's start and close (~40 s and a CPU, more under load). That
    # life's leaks are checked whole after its close (test_radical.py's
    # test_rp_sandbox_removed_and_no_process_left: processes, descriptors, its run dir, the
    # temp dir its ranks have as TMPDIR, its sandbox); here, that the tasks leave nothing
    # while it runs: no process, no descriptor.
    from parsl.dataflow.dflow import DataFlowKernelLoader

    token = DataFlowKernelLoader.dfk().hetflow_token
    tasks = task_count("radical")
    assert rank_sum(0).result(timeout=RECOVERY_S) == 0     # its worker is up
    before = _settled(_snapshot())
    # RP's daemonised processes (agent, bridges, the RAPTOR worker) are nobody's children:
    # they carry the runtime's token, and must be the same ones after the tasks.
    daemons = _daemons(token)
    sizes = [1 + (i % 3) for i in range(tasks)]
    start = time.time()
    futures = [rank_sum.options(ranks=r)(i) for i, r in enumerate(sizes)]
    results = [f.result(timeout=600) for f in futures]
    elapsed = time.time() - start
    print(f"\nradical: {tasks} mixed 1-3 rank tasks in {elapsed:.1f} s "
          f"({tasks / elapsed:.1f} tasks/s)")
    assert results == [_expected(i, r) for i, r in enumerate(sizes)]
    after = _settled(before)
    assert after["children"] == before["children"], f"leaked processes: {after['children']}"
    assert after["fds"] <= before["fds"], f"leaked file descriptors: {before} -> {after}"
    deadline = time.time() + 60
    while (now := _daemons(token)) != daemons and time.time() < deadline:
        time.sleep(0.2)
    assert now == daemons, f"before the tasks, not after: {daemons - now}; " \
                           f"after, not before: {now - daemons}"


def _daemons(token) -> set:
    """``(pid, command line)`` of the processes carrying ``token``, but the ``sleep`` of a
    shell's poll loop (RP's pilot bootstrapper waits on its agent that way)."""
    found = set()
    for pid in marked_processes(token):
        try:
            proc = psutil.Process(pid)
            if proc.name() != "sleep":
                found.add((pid, " ".join(proc.cmdline())[:200]))
        except psutil.Error:
            continue
    return found
