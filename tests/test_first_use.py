"""What a new user meets first (issue 43), through real runtimes (pool and mpirun): a failure
upstream ends with its root cause, group-by names follow from the call, a string feature
column and DDP without a process group say what to do, and Ctrl-C on a hung task shows the
hung ranks' stacks and leaves nothing running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest

import hetflow
from hetflow._guardian import marked_processes

#: Each training task imports torch on its ranks: ~3 s idle, 40 s at load 20 on 2 cores.
pytestmark = pytest.mark.timeout(900)
RUNTIMES = ["pool", "mpirun"]


def features(comm, legacy=False):
    """A data scientist's features task: a group-by with two functions on one column, one on
    another; the names it gave, and the warnings the ranks saw."""
    import warnings

    import numpy as np
    import pyarrow as pa

    from hetflow import frame

    rng = np.random.default_rng(comm.Get_rank())
    events = frame.DistributedTable(comm, pa.table({
        "user": rng.integers(0, 10, 50), "amount": rng.normal(size=50),
        "age": rng.integers(18, 80, 50).astype(np.float64)}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = events.groupby("user").agg({"amount": ["mean", "std"], "age": "first"},
                                         legacy_names=legacy)
    if legacy:
        return out.column_names, [f"{w.category.__name__}: {w.message}" for w in seen]
    return out


def read(comm, table, column):
    """A downstream task reading one column of the features table."""
    return comm.allreduce(len(table.local.column(column)))


def train(comm, table, columns, habit=None):
    """DDP as its tutorials write it; ``habit`` None: inside hetflow.torch.process_group()."""
    import torch

    import hetflow.torch as ht

    model = torch.nn.Linear(len(columns), 1)
    if habit == "init":
        torch.distributed.init_process_group("gloo")
    if habit is not None:
        torch.nn.parallel.DistributedDataParallel(model)
    with ht.process_group():
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        for x, _y in ht.batches(table, columns, "amount_mean"):
            ddp(x).sum().backward()
    return True


def _last_printed_line(error: BaseException) -> str:
    return "".join(traceback.format_exception(error)).rstrip().splitlines()[-1]


@pytest.mark.parametrize("name", RUNTIMES)
def test_chained_failures_names_and_torch_hints(name, tmp_path):
    make = hetflow.mpi_app(features, ranks=2)
    reader = hetflow.mpi_app(read, ranks=2)
    trainer = hetflow.mpi_app(train, ranks=2)
    with hetflow.runtime(name, max_ranks=2, run_dir=str(tmp_path / "run"), output="off"):
        table = make()
        # names a user predicts from the call alone: <column>_<function>, every one
        assert table.result(timeout=300).schema.names == [
            "user", "amount_mean", "amount_std", "age_first"]
        names, warned = make(legacy=True).result(timeout=300)
        assert names == ["user", "amount_mean", "amount_std", "age"]
        assert any(w.startswith("FutureWarning: groupby.agg(legacy_names=True) is deprecated")
                   for w in warned), warned
        assert reader(table, "age_first").result(timeout=300) == table.result().num_rows

        # a failure two tasks upstream: the root cause is the last thing printed
        failed = reader(table, "age")                    # the 0.1 name: KeyError on a rank
        after = reader(failed, "x")
        last = reader(after, "y")
        with pytest.raises(hetflow.TaskFailed) as caught:
            failed.result(timeout=300)
        root_line = _last_printed_line(caught.value)
        assert "age" in root_line and "KeyError" in root_line, root_line
        for future, chain in ((after, "it depends on task"),
                              (last, "which depends on task")):
            with pytest.raises(hetflow.DependencyFailed) as dependent:
                future.result(timeout=300)
            error = dependent.value
            from parsl.dataflow.errors import DependencyError

            assert isinstance(error, DependencyError) and isinstance(error, hetflow.TaskFailed)
            assert chain in str(error) and "did not run" in str(error)
            assert _last_printed_line(error) == root_line
            assert "hetflow.DependencyFailed: task" in "".join(traceback.format_exception(error))
            printed = "".join(traceback.format_exception(error))
            assert "Dependency failure for task" not in printed
            assert printed.count("Remote traceback") == 1   # the root once, at the end
            assert error.rank == caught.value.rank and error.exception_type == "KeyError"

        # a string feature column: hetflow's InputError naming it and its Arrow type
        def with_city(comm):
            import numpy as np
            import pyarrow as pa

            from hetflow import frame
            return frame.DistributedTable(comm, pa.table({
                "city": ["paris", "rome"] * 5, "amount_mean": np.zeros(10)}))

        cities = hetflow.mpi_app(with_city, ranks=2)()
        with pytest.raises(hetflow.TaskFailed) as caught:
            trainer(cities, ["city"]).result(timeout=300)
        assert isinstance(caught.value.exception, hetflow.InputError), caught.value
        assert "column 'city' has Arrow type string" in str(caught.value)

        # DDP habits without hetflow's process group: a hint naming process_group()
        for habit, says in (("ddp", "Default process group has not been initialized"),
                            ("init", "environment variable RANK expected")):
            with pytest.raises(hetflow.TaskFailed) as caught:
                trainer(table, ["amount_std", "age_first"], habit=habit).result(timeout=300)
            printed = "".join(traceback.format_exception(caught.value))
            assert says in printed
            assert "hetflow.torch.process_group()" in printed.rstrip().splitlines()[-1]


HUNG = textwrap.dedent('''
    import faulthandler
    import signal
    import sys
    import hetflow

    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the test's look, if it hangs

    @hetflow.mpi_app(ranks=2)
    def hung(comm):
        if comm.Get_rank() == 0:
            return comm.allreduce(1)     # rank 1 never joins it
        return None

    with hetflow.runtime(sys.argv[1], max_ranks=2, hang_warning_s=0.5) as dfk:
        print("token", dfk.hetflow_token, dfk.run_dir, flush=True)
        hung().result()                  # no walltime: waits until Ctrl-C
''')


@pytest.mark.parametrize("name", RUNTIMES)
def test_ctrl_c_on_a_hung_task_shows_its_stacks_and_leaves_nothing_running(name, tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    # SIGINT as a terminal gives it: a shell without job control starts background jobs
    # with SIGINT ignored, and a Python started so never raises KeyboardInterrupt (a CI
    # run under `nohup bash -c '... &'` hung here for 120 s).
    proc = subprocess.Popen([sys.executable, str(script), name], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("still running" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)                 # what Ctrl-C sends
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)            # every thread's stack, into its output
            time.sleep(2)
            proc.kill()
            proc.wait()
            reader.join(timeout=10)
            pytest.fail("the client did not end within 120 s of Ctrl-C:\n" + "".join(lines))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    token, run_dir = next(line.split()[1:3] for line in lines if line.startswith("token "))
    assert proc.returncode != 0
    tail = out[out.index("KeyboardInterrupt"):]
    assert "hetflow: interrupted while 1 task(s) ran" in tail, out
    assert "rank(s) [1] returned" in tail and "rank(s) [0] were still running" in tail, out
    assert "Python stack of rank 0 when the task was stopped" in tail, out
    assert "in hung" in tail and "comm.allreduce(1)" in tail, out
    assert not marked_processes(token), out        # nothing it started outlives it
    assert not os.path.exists(os.path.dirname(run_dir)), out
