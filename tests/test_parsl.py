"""The Parsl executor (HTEX in MPI mode): spec translation, node file, faults, clean exit.

Real Parsl, real mpiexec; the parity suite (test_parity.py) covers results and
task-level failures. Here: what is specific to running through Parsl.
"""
import json
import os
import signal
import tempfile
import time

import psutil
import pytest

import hetflow
from hetflow.executors._parsl_worker import LAUNCHER_FILE
from hetflow.executors.parsl_htex import ParslMPIExecutor, parsl_resource_spec
from hetflow.spec import Resources
from meet import meet

pytestmark = pytest.mark.timeout(240)


@hetflow.mpi_app(ranks=2, returns="all")
def rendezvous(comm, mine, theirs, timeout=60.0):
    """Rank 0 touches ``mine`` and waits for ``theirs``: both tasks ran at once."""
    return meet(comm, mine, theirs, timeout)


@hetflow.mpi_app(ranks=2)
def total(comm, x):
    return comm.allreduce(x)


@hetflow.mpi_app(ranks=1)
def mark_and_sleep(comm, path, seconds):
    open(path, "w").close()
    time.sleep(seconds)
    return "finished"


@pytest.fixture(scope="module")
def parsl_executor():
    with hetflow.runtime("parsl", max_ranks=4) as dfk:
        yield dfk.executors["parsl"]


def _wait_for(path, timeout=90):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- translation
@pytest.mark.parametrize("resources, expected", [
    (Resources(ranks=1), {"num_nodes": 1, "ranks_per_node": 1, "num_ranks": 1}),
    (Resources(ranks=3), {"num_nodes": 3, "ranks_per_node": 1, "num_ranks": 3}),
    # Each node-file entry is one core slot: 2 ranks x 2 cores take 4 entries.
    (Resources(ranks=2, cores_per_rank=2), {"num_nodes": 4, "ranks_per_node": 1, "num_ranks": 2}),
])
def test_resource_spec_gives_all_three_keys(resources, expected):
    from parsl.executors.high_throughput.mpi_prefix_composer import (compose_mpiexec_launch_cmd,
                                                                      validate_resource_spec)

    spec = parsl_resource_spec(resources)
    assert spec == expected
    validate_resource_spec(spec)  # Parsl's own check: accepted and nothing derived
    assert spec == expected
    _, prefix = compose_mpiexec_launch_cmd(spec, ["localhost"] * spec["num_nodes"])
    assert f"-n {resources.ranks} -ppn 1 " in prefix


# ------------------------------------------------- user config (before the module runtime loads)
@pytest.mark.timeout(300)
def test_in_a_users_own_parsl_config_and_nothing_survives_exit():
    import parsl
    from parsl.config import Config

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(executors=[ParslMPIExecutor(label="mine", max_ranks=2)],
                        run_dir=os.path.join(tmp, "runinfo"), strategy_period=0.2,
                        initialize_logging=False, usage_tracking=0)
        with parsl.load(config):
            assert total(3).result(timeout=180) == 6
            fut = total(1)
            assert fut.result(timeout=120) == 2
            assert hetflow.task_times(fut).executor == "mine"
        parsl.clear()
        deadline = time.time() + 30
        while True:
            # The interchange is our child; the worker pool is started through a shell
            # that detaches it, so find it (and its workers) by the run dir it logs to.
            left = _ours(tmp, before)
            if not left or time.time() > deadline:
                break
            time.sleep(0.2)
        assert not left, [" ".join(p.cmdline()) for p in left]


def test_non_hetflow_spec_is_rejected(parsl_executor):
    with pytest.raises(hetflow.ConfigError, match="not hetflow's"):
        parsl_executor.submit(print, {"num_ranks": 2})


# ----------------------------------------------------------------------------- node file
def test_node_file_lists_one_slot_per_rank(parsl_executor):
    with open(parsl_executor.nodefile) as fh:
        assert fh.read().split() == ["localhost"] * 4
    assert parsl_executor.max_ranks == 4


def test_two_two_rank_tasks_share_the_four_slots_at_once(parsl_executor):
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        first, second = rendezvous(a, b), rendezvous(b, a)
        assert first.result() == [True, True]
        assert second.result() == [True, True]


# ----------------------------------------------------------------------------- faults
def test_launch_failure_is_launch_error_with_command_and_logs(parsl_executor):
    parsl_executor.python = "/nonexistent/bin/python3"
    try:
        fut = total(1)
        with pytest.raises(hetflow.LaunchError) as info:
            fut.result(timeout=120)
    finally:
        parsl_executor.python = None
    err = info.value
    assert "/nonexistent/bin/python3" in " ".join(err.command)
    assert any(path.endswith("stderr") for path in err.logs)
    assert total(2).result(timeout=120) == 4


@pytest.fixture
def sleeping_task(parsl_executor):
    """A task asleep in its job: ``(future, launcher process, launcher file's info)``."""
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "running")
        fut = mark_and_sleep(marker, 120)
        _wait_for(marker)
        taskdir = parsl_executor._taskdirs[fut.task_record["exec_fu"]]
        with open(os.path.join(taskdir, LAUNCHER_FILE)) as fh:
            info = json.load(fh)
        yield fut, psutil.Process(info["pid"]), info


def test_killed_worker_fails_its_task_and_the_executor_recovers(sleeping_task):
    fut, launcher, _ = sleeping_task
    tree = [launcher] + launcher.children(recursive=True)
    worker = launcher.parent()
    assert "python" in " ".join(worker.cmdline())
    worker.send_signal(signal.SIGKILL)
    with pytest.raises(hetflow.TaskLost, match="worker running it was lost"):
        fut.result(timeout=120)
    # The job the dead worker started does not outlive it.
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive
    assert total(5).result(timeout=180) == 10


def _ours(run_dir, before):
    found = []
    mine = {p.pid for p in psutil.Process().children(recursive=True)} - before
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid in mine or run_dir in cmdline:
                found.append(proc)
                found += proc.children(recursive=True)
        except psutil.Error:
            continue
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_killed_manager_fails_its_task_and_leaves_no_orphans(sleeping_task):
    fut, launcher, info = sleeping_task
    manager = launcher.parent().parent()
    assert "process_worker_pool" in " ".join(manager.cmdline())
    block = [p for p in psutil.process_iter() if _pgid(p) == info["block_pgid"]]
    tree = [launcher] + launcher.children(recursive=True) + block
    manager.send_signal(signal.SIGKILL)
    # Noticed after heartbeat_threshold (8 s by default) as Parsl's ManagerLost.
    with pytest.raises(hetflow.TaskLost, match="ManagerLost"):
        fut.result(timeout=120)
    # The old pool's workers and the task's job are gone, not orphaned.
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.pid for p in alive]
    # block_error_handler=False: Parsl starts a new block and the executor carries on.
    assert total(7).result(timeout=180) == 14


def _pgid(proc):
    try:
        return os.getpgid(proc.pid)
    except OSError:
        return None
