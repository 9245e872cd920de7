"""Runtime-level behaviour: Parsl monitoring of MPI apps, run-dir clean-up."""
import os
import sqlite3

import pytest

import hetflow

pytestmark = pytest.mark.timeout(180)


@hetflow.mpi_app(ranks=2)
def counted(comm, x):
    return comm.allreduce(x)


@hetflow.mpi_app(ranks=1)
def noop(comm):
    return None


def test_parsl_monitoring_records_mpi_apps(tmp_path):
    from parsl.monitoring import MonitoringHub

    db = tmp_path / "monitoring.db"
    hub = MonitoringHub(logging_endpoint=f"sqlite:///{db}", resource_monitoring_enabled=False)
    with hetflow.runtime("mpirun", max_ranks=4, monitoring=hub):
        assert counted.options(ranks=1)(5).result() == 5
        assert noop().result() is None
    with sqlite3.connect(db) as con:
        names = sorted(r[0] for r in con.execute("SELECT task_func_name FROM task"))
        states = {r[0] for r in con.execute("SELECT task_status_name FROM status")}
        workflows = [r[0] for r in con.execute("SELECT workflow_name FROM workflow")]
    assert names == ["counted", "noop"]
    assert workflows == [os.path.basename(__file__)]     # the user's script, not hetflow's
    assert "exec_done" in states


def test_runtime_removes_its_temp_run_dir():
    with hetflow.runtime("mpirun", max_ranks=2) as dfk:
        run_dir = dfk.executors["mpirun"].run_dir
        assert noop().result() is None
        assert os.path.isdir(run_dir)
    assert not os.path.exists(run_dir)
    assert not os.path.exists(os.path.dirname(run_dir))


def _lines(path):
    return len(open(path).readlines()) if os.path.exists(path) else 0


def test_checkpoint_accepts_arguments_parsl_cannot_hash(tmp_path):
    # A checkpointed runtime memoizes every MPI app: a NumPy argument must be keyed, not fail.
    np = pytest.importorskip("numpy")
    log = str(tmp_path / "log")
    for _ in range(2):
        with hetflow.runtime("mpirun", max_ranks=2, checkpoint=str(tmp_path / "ckpt")):
            assert array_sum(log, np.arange(4)).result(timeout=120) == 6
            assert array_sum(log, np.arange(5)).result(timeout=120) == 10
    assert _lines(log) == 2                   # the second runtime ran nothing


@hetflow.mpi_app(ranks=1)
def array_sum(comm, log, values):
    with open(log, "a") as fh:
        fh.write("ran\n")
    return int(values.sum())
