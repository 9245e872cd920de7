"""The debug runtime: in-process, one rank, written only against the executor protocol.

It is the proof that the protocol (``executors/kernel.py``) is all a runtime needs:
these are the parity suite's checks that apply to a one-rank, in-process runtime.
"""
import os
import time

import pytest

import hetflow
from hetflow.executors.kernel import Executor, Runtime

pytestmark = pytest.mark.timeout(60)


@hetflow.mpi_app(ranks=1, returns="all")
def where(comm, tag):
    return (comm.Get_rank(), comm.Get_size(), os.getpid(), tag)


@hetflow.mpi_app(ranks=1)
def fails(comm):
    raise KeyError("missing in the app")


@hetflow.mpi_app(ranks=1)
def plus(comm, a, b):
    return a + b


@hetflow.mpi_app(ranks=1)
def wait_for(comm, path):
    """Return once ``path`` exists (at most 30 s)."""
    import time

    deadline = time.time() + 30
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.01)
    return os.path.exists(path)


@pytest.fixture(scope="module")
def dfk():
    with hetflow.runtime("debug") as dfk:
        yield dfk


def test_runs_in_the_client_process_on_comm_self(dfk):
    assert where("x").result() == [(0, 1, os.getpid(), "x")]


def test_is_a_kernel_runtime(dfk):
    executor = dfk.executors["debug"]
    assert isinstance(executor, Executor) and isinstance(executor, Runtime)


def test_exception_keeps_its_real_traceback(dfk):
    with pytest.raises(hetflow.TaskFailed) as info:
        fails().result()
    original = info.value.exception
    assert isinstance(original, KeyError) and info.value.rank == 0
    # The original object, not a copy: its traceback reaches into the app's own frame.
    frames = []
    tb = original.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "fails"


def test_futures_as_dependencies_and_times(dfk):
    second = plus(plus(1, 2), 3)
    assert second.result() == 6
    times = hetflow.task_times(second)
    assert times.executor == "debug" and times.ranks == 1
    assert times.submitted <= times.launched <= times.started <= times.finished <= times.delivered
    assert hetflow.task_state(second) == hetflow.TaskState.DONE == "DONE"


def test_more_than_one_rank_is_unavailable(dfk):
    with pytest.raises(hetflow.ResourcesUnavailable, match="max_ranks=1"):
        where.options(ranks=2)("big")


def test_walltime_is_refused_by_name(dfk):
    with pytest.raises(hetflow.NotSupported, match="walltime"):
        where.options(walltime=5)("w")


def test_cancel_queued_task_and_refuse_running(dfk, tmp_path):
    go = str(tmp_path / "go")
    first = wait_for(go)
    second = plus(1, 1)           # queued behind the running task: one slot
    while hetflow.task_state(first) != "EXECUTING":
        time.sleep(0.01)
    # Parsl hands a ready task to its executor from a launch thread, not in the call: `second`
    # is NEW until then, however long `first` has been running.
    deadline = time.monotonic() + 60
    while hetflow.task_state(second) == "NEW":
        assert time.monotonic() < deadline, "Parsl never handed the second task to the executor"
        time.sleep(0.01)
    assert hetflow.task_state(second) == "SCHEDULING"
    assert hetflow.cancel(second) is True
    with pytest.raises(hetflow.TaskCancelled, match="before it started"):
        second.result(timeout=10)
    with pytest.raises(hetflow.NotSupported, match="cancel"):
        hetflow.cancel(first)
    open(go, "w").close()
    assert first.result(timeout=10) is True
    assert hetflow.task_state(second) == "CANCELED"


def test_docs_show_the_debug_runtime_as_it_is():
    """docs/architecture.md's "A complete runtime" example is this runtime's code, verbatim."""
    import inspect
    import re

    from hetflow.executors.debug import DebugExecutor

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "architecture.md")).read()
    section = page[page.index("## A complete runtime"):]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S)
              if b.startswith("class DebugExecutor")]
    assert len(blocks) == 1 and blocks[0].rstrip() == inspect.getsource(DebugExecutor).rstrip()


@hetflow.mpi_app(ranks=1)
def table_of(comm, rows):
    from hetflow import frame

    return frame.generate(comm, rows, seed=5)


@hetflow.mpi_app(ranks=1)
def column_sum(comm, table):
    return table.num_rows(), int(table.local.column("key").to_numpy().sum())


def test_a_returned_table_is_handed_over(dfk):
    from hetflow.frame._table import synthetic_partition

    handle = table_of(100).result()
    expected = synthetic_partition(0, 1, 100, seed=5)
    assert column_sum(handle).result() == (100, int(expected.column("key").to_numpy().sum()))
    assert handle.to_arrow().equals(expected)
