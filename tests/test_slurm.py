"""The slurm runtime beyond the parity suite: the queue wait is its own phase, and a
launcher that does not wire the ranks into one world fails loudly.

(The parity and fault suites run on it too: ``conftest.PARITY_EXECUTORS``.)
"""
import subprocess
import time

import pytest

import hetflow

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


@hetflow.mpi_app(ranks=2, returns="all")
def sizes(comm):
    return comm.Get_size()


@hetflow.mpi_app(ranks=1)
def hostname(comm):
    import socket

    return socket.gethostname()


def test_queue_wait_is_its_own_phase(tmp_path):
    # Another user's job holds every CPU of the cluster for a while: hetflow's job waits
    # in Slurm's queue, and that wait is the task's queue phase, not its function's time.
    hold_s = 4
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=4", f"--output={tmp_path}/blocker.out",
         "--wrap", f"sleep {hold_s}"], capture_output=True, text=True, check=True)
    job = blocker.stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 60
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                             text=True).stdout.strip() != "RUNNING":
            assert time.time() < deadline, "the blocking job never started"
            time.sleep(0.1)
        with hetflow.runtime("slurm", max_ranks=4):
            fut = hostname()
            assert fut.result(timeout=120) in ("n1", "n2")
            times = hetflow.task_times(fut)
    finally:
        subprocess.run(["scancel", job])
    assert times.submitted <= times.launched <= times.started <= times.finished
    assert times.queue_s >= hold_s / 2, times       # it waited behind the blocker
    assert times.queue_s > times.function_s
    assert times.as_dict()["queue_s"] == times.queue_s


def test_srun_without_pmi_fails_loudly():
    # With MpiDefault=none, `srun --mpi=none -n 2` starts two 1-rank worlds and exits 0;
    # the rank runner sees the world is not the task's and says so.
    with hetflow.runtime("slurm", max_ranks=4, srun_args=["--mpi=none"]):
        with pytest.raises(hetflow.TaskFailed, match="world of 1 rank"):
            sizes().result(timeout=120)
    with hetflow.runtime("slurm", max_ranks=4):
        assert sizes().result(timeout=120) == [2, 2]


@hetflow.mpi_app(ranks=4, returns="all")
def where(comm):
    import socket

    return socket.gethostname()


def _job_state(job):
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState"), fields.get("NodeList")


def test_pool_started_by_the_batch_system():
    # As a user on a login node: the pool asks Slurm for its own 2-node allocation, runs
    # its world there, and gives the allocation back at shutdown.
    with hetflow.runtime("pool", slurm={"nodes": 2, "ntasks": 4, "time": "5"}) as dfk:
        pool = dfk.executors["pool"]
        job = pool.batch.job_id
        assert pool.max_ranks == 4
        assert _job_state(job) == ("RUNNING", "n[1-2]")
        assert where().result(timeout=120) == ["n1", "n1", "n2", "n2"]
    deadline = time.time() + 30
    while _job_state(job)[0] not in ("CANCELLED", "COMPLETED", None):
        assert time.time() < deadline, _job_state(job)
        time.sleep(0.2)
