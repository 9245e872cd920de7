"""What a launch-per-task rank and ``from hetflow import frame`` import, in a fresh interpreter.

Every rank of every task pays for each module the rank runner imports, so the runner must
not pull in the client's stack (Parsl, psutil, zmq) nor the data stack (numpy, pandas,
pyarrow). Checked by module name, never by time.
"""
import json
import subprocess
import sys

import pytest

FORBIDDEN_ON_RANKS = ("parsl", "psutil", "zmq", "numpy", "pandas", "pyarrow", "cloudpickle",
                      "concurrent", "logging", "dataclasses", "typing", "socket")


def modules_after(statement: str, tmp_path) -> set:
    """Every module a fresh interpreter has after running ``statement``."""
    probe = f"import sys\n{statement}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True, cwd=tmp_path, timeout=120).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def imported_by(statement: str, tmp_path) -> set:
    """Top-level names of the modules a fresh interpreter has after running ``statement``."""
    return {name.split(".")[0] for name in modules_after(statement, tmp_path)}


@pytest.mark.timeout(150)
def test_rank_runner_imports_nothing_a_noop_task_does_not_need(tmp_path):
    found = imported_by("import hetflow.executors._rank", tmp_path)
    assert {"hetflow"} <= found
    assert not found & set(FORBIDDEN_ON_RANKS), sorted(found & set(FORBIDDEN_ON_RANKS))


@pytest.mark.timeout(150)
def test_unpickling_a_payload_by_reference_needs_no_cloudpickle(tmp_path):
    # What a rank does with a payload whose function pickles by reference: plain pickle.
    made = subprocess.run([sys.executable, "-c", (
        "import sys, os\n"
        "from hetflow.executors.payload import TaskPayload\n"
        "from hetflow.spec import Resources\n"
        "sys.stdout.buffer.write(TaskPayload(task_id=1, func=os.getpid, args=(), kwargs={},"
        " resources=Resources(ranks=2)).dumps())")], check=True, capture_output=True,
        cwd=tmp_path, timeout=120).stdout
    (tmp_path / "task.pkl").write_bytes(made)
    found = modules_after(
        "import pickle, hetflow.executors._rank\n"
        "p = pickle.loads(open('task.pkl', 'rb').read())\n"
        "assert p.task_id == 1 and p.args == () and p.kwargs == {}\n"
        "from hetflow.executors.payload import dumps\n"
        "assert pickle.loads(dumps(None)) is None", tmp_path)
    top = {name.split(".")[0] for name in found}
    assert not top & set(FORBIDDEN_ON_RANKS), sorted(top & set(FORBIDDEN_ON_RANKS))
    assert "hetflow.spec" not in found   # resources stay a dict until asked for


@pytest.mark.timeout(150)
def test_radical_start_probe_runs_without_the_client_stack(tmp_path):
    # Every rank of every new RAPTOR worker runs the runtime's start-up probe: its function
    # must come from a module the ranks import anyway, not from the executor's (which pulls
    # in Parsl through the executor kernel: ~1 CPU-s a rank, on a start that is timed).
    made = subprocess.run([sys.executable, "-c", (
        "import sys\n"
        "from hetflow.executors import radical\n"
        "sys.stdout.buffer.write(radical.probe_payload(2))")], check=True,
        capture_output=True, cwd=tmp_path, timeout=120).stdout
    (tmp_path / "probe.pkl").write_bytes(made)
    found = imported_by(
        "import pickle, hetflow.executors.radical.rank\n"
        "p = pickle.loads(open('probe.pkl', 'rb').read())\n"
        "assert p.func() is None", tmp_path)
    assert not found & set(FORBIDDEN_ON_RANKS), sorted(found & set(FORBIDDEN_ON_RANKS))


def test_payload_round_trip_keeps_resources():
    import pickle

    from hetflow.executors.payload import TaskPayload
    from hetflow.spec import Resources

    resources = Resources(ranks=3, walltime=5.0, returns="all")
    payload = pickle.loads(TaskPayload(task_id=7, func=len, args=("ab",), kwargs={"k": 1},
                                       resources=resources).dumps())
    assert (payload.task_id, payload.func, payload.args, payload.kwargs) == (7, len, ("ab",),
                                                                              {"k": 1})
    assert payload.resources == resources


@pytest.mark.timeout(150)
def test_frame_import_does_not_import_pandas(tmp_path):
    found = imported_by("from hetflow import frame", tmp_path)
    assert {"numpy", "pyarrow"} <= found
    assert "pandas" not in found
    assert not found & {"parsl", "psutil", "zmq"}, sorted(found & {"parsl", "psutil", "zmq"})


@pytest.mark.timeout(150)
def test_importing_the_engine_does_not_initialise_mpi(tmp_path):
    # Importing mpi4py.MPI initialises MPI. A client that imports the engine beside its apps
    # must not become an MPI singleton: every process it forks would leave MPICH's segment in
    # /dev/shm. The engine imports it when a rank first calls it.
    modules = modules_after("from hetflow import frame\nimport hetflow.frame._join", tmp_path)
    assert "hetflow.frame._exchange" in modules
    assert "mpi4py.MPI" not in modules


@pytest.mark.timeout(150)
def test_import_hetflow_keeps_its_public_names_and_submodules(tmp_path):
    found = imported_by(
        "import hetflow\n"
        "assert hetflow.TaskLost.__module__ == 'hetflow.errors'\n"
        "assert hetflow.errors.ConfigError is hetflow.ConfigError\n"
        "from hetflow import Resources, WalltimeExceeded, errors\n"
        "assert Resources(ranks=2).ranks == 2 and issubclass(WalltimeExceeded, errors.TaskFailed)\n"
        "assert set(hetflow.__all__) <= set(dir(hetflow))", tmp_path)
    assert "parsl" not in found
