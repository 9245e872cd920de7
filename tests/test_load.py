"""Load: hundreds of short MPI tasks of mixed sizes through each executor.

Every result must be correct, and the runtime must not leak processes, file
descriptors or task directories (the runtime's run dir is
the only place its executor writes; ``runtime()`` removes it on exit). ``HETFLOW_LOAD_TASKS`` sets the task count
(default: see ``DEFAULT_TASKS``); the count per executor is printed with its throughput.
"""
import os
import time

import psutil
import pytest

import hetflow

#: Tasks per executor. The persistent pool runs 500 in seconds; executors that launch
#: processes per task (about 0.3-1.5 s each here) run 100 in CI to keep the suite short.
#: HETFLOW_LOAD_TASKS=500 runs the full count everywhere.
DEFAULT_TASKS = {"pool": 500}


def _tasks(runtime_name):
    override = os.environ.get("HETFLOW_LOAD_TASKS")
    return int(override) if override else DEFAULT_TASKS.get(runtime_name, 100)

pytestmark = pytest.mark.timeout(900)


@hetflow.mpi_app(ranks=1)
def rank_sum(comm, i):
    return comm.allreduce(i + comm.Get_rank())


def _expected(i, ranks):
    return sum(i + r for r in range(ranks))


def _files_under(path):
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))


def _snapshot(run_dir):
    me = psutil.Process()
    return {
        "children": sorted(p.pid for p in me.children(recursive=True)),
        "fds": me.num_fds(),
        "run_dir_entries": _files_under(run_dir),
    }


def test_many_mixed_tasks_lose_nothing_and_leak_nothing(runtime_name, executor):
    tasks = _tasks(runtime_name)
    sizes = [1 + (i % 3) for i in range(tasks)]          # 1, 2, 3 ranks, interleaved
    warm = [rank_sum.options(ranks=r)(0) for r in (1, 2, 3)]
    assert [f.result() for f in warm] == [0, 1, 3]
    time.sleep(0.5)                                       # let warm-up launches wind down
    before = _snapshot(executor.run_dir)

    start = time.time()
    futures = [rank_sum.options(ranks=r)(i) for i, r in enumerate(sizes)]
    results = [f.result(timeout=600) for f in futures]
    elapsed = time.time() - start
    print(f"\n{runtime_name}: {tasks} mixed tasks in {elapsed:.1f} s "
          f"({tasks / elapsed:.1f} tasks/s)")
    assert results == [_expected(i, r) for i, r in enumerate(sizes)]

    deadline = time.time() + 30
    while True:                                           # launches end asynchronously
        after = _snapshot(executor.run_dir)
        if after == before or time.time() > deadline:
            break
        time.sleep(0.2)
    assert after["children"] == before["children"], "leaked processes"
    assert after["fds"] <= before["fds"], "leaked file descriptors"
    assert after["run_dir_entries"] <= before["run_dir_entries"], "leaked task dirs / files"
