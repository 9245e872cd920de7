"""A pool task that captures no output gets no files dir, and keeps what the dir gave it.

With ``output="off"`` and no sampling, a pool task's ranks write nothing per task: each rank
keeps one stack file for its life (``_rankio.keep_stacks``, in the client's node root) and the
broker marks a rank returned when its outcome arrives. The hang watch (a warning naming the
rank that returned) and a stopped task's stacks must work all the same.
"""
import logging
import os
import shutil
import tempfile
import threading

import pytest

import hetflow

pytestmark = pytest.mark.timeout(120)


@hetflow.mpi_app(ranks=2, walltime=5)
def collective_on_rank_zero_alone(comm):
    if comm.Get_rank() == 0:
        comm.allreduce(1)       # a collective only rank 0 calls: it waits forever
    return "rank 1 returns at once"


@hetflow.mpi_app(ranks=2)
def hold(comm, path):
    import time

    while not os.path.exists(path):
        time.sleep(0.01)
    return comm.Get_rank()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_an_output_off_hang_is_warned_and_explained_without_a_files_dir(tmp_path):
    run_dir = tempfile.mkdtemp(prefix="hetflow-test-stacks-")
    records = _Records()
    logger = logging.getLogger("hetflow.tasks")
    logger.addHandler(records)
    try:
        with hetflow.runtime("pool", max_ranks=2, output="off", run_dir=run_dir,
                             progress=False, hang_warning_s=0.2) as dfk:
            executor = dfk.executors["pool"]
            release = str(tmp_path / "go")
            held = hold(release)
            started = threading.Event()
            for _ in range(1000):           # until both ranks run it
                task = getattr(held.task_record["exec_fu"], "hetflow_task", None)
                if task is not None and len(executor._mpi.busy_for(task.id, task.slots)) == 2:
                    started.set()
                    break
                started.wait(0.01)
            assert started.is_set()
            where = executor._follower.directories(task.id)
            assert not any(os.path.exists(d) for d in where), where   # no dir made for it
            open(release, "w").close()
            assert held.result(timeout=60) == 0

            fut = collective_on_rank_zero_alone()
            with pytest.raises(hetflow.WalltimeExceeded) as info:
                fut.result(timeout=60)
        error = info.value
        assert set(error.stacks) == {0}, str(error)
        assert "comm.allreduce(1)" in error.stacks[0]
        assert "rank(s) [1] returned" in str(error)
        assert list(hetflow.task_times(fut).returned) == [1]
        warned = [m for m in records.messages if f"task {error.task_id} " in m]
        assert len(warned) == 1 and "rank(s) [0] were still running" in warned[0], \
            records.messages
    finally:
        logger.removeHandler(records)
        shutil.rmtree(run_dir, ignore_errors=True)
