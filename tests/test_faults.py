"""Faults beyond the parity suite, on every executor: outside kills, a killed client,
bad input files.

(tests/test_parity.py already covers a rank that raises, calls ``os._exit``,
aborts, overruns its walltime, deadlocks in a collective, or is cancelled.)
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import hetflow
from bounds import RECOVERY_S
from conftest import EXECUTOR_OPTIONS, PARITY_EXECUTORS
from hetflow._guardian import marked_processes
from hetflow.executors._mpishm import KILLED_TREE_SHM, mapped_mpi_shm

# Above two waits of RECOVERY_S (the kill test waits for its task, then for the next one),
# with room for the test's own steps.
pytestmark = pytest.mark.timeout(2 * RECOVERY_S + 120)


@hetflow.mpi_app(ranks=2)
def report_pid_and_wait(comm, directory, seconds):
    """Publish each rank's pid, then wait. A second run (an executor that re-runs the
    task instead of failing it) returns at once, so the test fails fast, not by timeout."""
    rank = comm.Get_rank()
    final = os.path.join(directory, f"pid-{rank}")
    if os.path.exists(final):
        return "ran again"
    with open(final + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(final + ".tmp", final)
    time.sleep(seconds)
    comm.Barrier()
    return "survived"


@hetflow.mpi_app(ranks=2)
def echo(comm, value):
    return comm.bcast(value, root=0)


@hetflow.mpi_app(ranks=2)
def read_rows(comm, paths):
    from hetflow import frame

    return frame.read_parquet(comm, paths).num_rows()


@hetflow.mpi_app(ranks=2, retries=3)
def join_rows(comm, left_path, right_path, on):
    from hetflow import frame

    left = frame.read_parquet(comm, [left_path])
    right = frame.read_parquet(comm, [right_path])
    return frame.join(left, right, on=on).num_rows()


def _wait_for(path, timeout=RECOVERY_S):
    # (in ci-21 a 180 s wait here ended before the runtime replaced a worker that never
    # came up)
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    with open(path) as fh:
        return int(fh.read())


def test_rank_killed_from_outside_is_task_lost(runtime_name, tmp_path):
    fut = report_pid_and_wait(str(tmp_path), 60)
    pid = _wait_for(tmp_path / "pid-1")
    start = time.time()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(hetflow.TaskLost) as info:
        fut.result(timeout=90)
    assert time.time() - start < 90
    err = info.value
    assert err.rank == 1, str(err)
    # (radical: a RAPTOR worker rank's status comes from RP's launch script, see
    # RadicalExecutor._start_worker)
    assert "signal 9" in str(err), str(err)
    assert err.signal == 9
    # the runtime runs the next task (on radical, on a new RAPTOR worker)
    assert echo("next").result(timeout=RECOVERY_S) == "next"


@pytest.fixture
def parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"key": list(range(100)), "value": list(range(100))}), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"key": [str(i) for i in range(10)], "value": list(range(10))}),
                   other)
    return {"good": str(good), "truncated": str(truncated), "other": str(other),
            "missing": str(tmp_path / "missing.parquet"), "dir": tmp_path}


def _input_error(fut):
    with pytest.raises(hetflow.TaskFailed) as info:
        fut.result(timeout=120)
    err = info.value
    assert isinstance(err.exception, hetflow.InputError), (
        f"expected an InputError on the rank, got {err.exception_type}: {err}")
    return err


def test_missing_parquet_file(runtime_name, parquet_files):
    err = _input_error(read_rows([parquet_files["missing"]]))
    assert "missing.parquet" in str(err)


def test_truncated_parquet_file(runtime_name, parquet_files):
    err = _input_error(read_rows([parquet_files["truncated"]]))
    assert "Parquet" in str(err)
    # the runtime runs the next task
    assert read_rows([parquet_files["good"]]).result(timeout=120) == 100


def test_truncated_parquet_error_names_the_file(runtime_name, parquet_files):
    err = _input_error(read_rows([parquet_files["good"], parquet_files["truncated"]]))
    assert "truncated.parquet" in str(err)


def test_tables_with_mismatched_schemas(runtime_name, parquet_files):
    # the same column with different types in two files of one dataset
    err = _input_error(read_rows([parquet_files["good"], parquet_files["other"]]))
    assert "schema" in str(err).lower()


def test_mismatched_key_types_fail_once_without_retry(runtime_name, parquet_files):
    # join_rows has retries=3: bad input must not be retried (one attempt, one error).
    fut = join_rows(parquet_files["good"], parquet_files["other"], "key")
    _input_error(fut)
    assert fut.task_record["fail_count"] == 1
    assert read_rows([parquet_files["good"]]).result(timeout=120) == 100


# ----------------------------------------------------------------------------- killed client
#: A client running a checkpointed campaign of 8 tasks, one at a time, SIGKILLed by the
#: test below. It prints its runtime's token, then a line per finished task. Task 3 is a
#: 2-rank task that holds (after marking each rank) until ``release`` exists, so the kill
#: lands while an MPI task is running; the resumed client finds ``release`` and goes on.
CLIENT = textwrap.dedent('''
    import json, os, sys, time
    import hetflow

    name, options, work = sys.argv[1:4]
    marks = os.path.join(work, "marks")

    @hetflow.mpi_app(ranks=1)
    def step(comm, i):
        open(os.path.join(marks, f"ran-{i}-{os.getpid()}"), "w").close()
        time.sleep(0.3)
        return i * i

    @hetflow.mpi_app(ranks=2)
    def gate(comm, i):
        open(os.path.join(marks, f"rank-{comm.Get_rank()}-{os.getpid()}"), "w").close()
        if comm.Get_rank() == 0:
            open(os.path.join(marks, f"ran-{i}-{os.getpid()}"), "w").close()
        while not os.path.exists(os.path.join(work, "release")):
            time.sleep(0.05)
        comm.Barrier()
        return i * i

    with hetflow.runtime(name, checkpoint=os.path.join(work, "ckpt"),
                         **json.loads(options)) as dfk:
        print("token", dfk.hetflow_token, flush=True)
        for i in range(8):
            print("done", i, (gate if i == 3 else step)(i).result(), flush=True)
''')

#: Seconds a killed client's runtime may take to die (the guardian reacts at once;
#: SIGKILLed processes take a moment to be reaped on a loaded machine).
DIE_WITHIN_S = 15
#: Pilot start (~15-40 s on 2 busy cores, more beside another pilot) is most of a radical
#: client's life: its two clients get more time.
CLIENT_TIMEOUT = {"radical": 300}
#: The executors with the test timeouts the killed-client test needs.
KILLED_CLIENT_EXECUTORS = [pytest.param(n, marks=pytest.mark.timeout(2 * CLIENT_TIMEOUT[n] + 60))
                           if n in CLIENT_TIMEOUT else n for n in PARITY_EXECUTORS]


def _start_client(tmp_path, name):
    """The client script running in its own session, with a private TMPDIR."""
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    (tmp_path / "marks").mkdir(exist_ok=True)
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    options = json.dumps({**EXECUTOR_OPTIONS[name], "max_ranks": 2})
    args = [sys.executable, str(script), name, options, str(tmp_path)]
    return args, subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True, env={**os.environ, "TMPDIR": str(tmp)})


def _kill_client(client, token):
    """SIGKILL the client alone; return what it had started (its tree, and token holders)
    and the named shared memory those mapped: Python multiprocessing's semaphores (a Parsl
    worker pool's) and MPI segments whose names were still linked (Open MPI's)."""
    started = psutil.Process(client.pid).children(recursive=True)
    started += [psutil.Process(pid) for pid in marked_processes(token)
                if psutil.pid_exists(pid)]
    named_shm = set().union(*(mapped_mpi_shm(p.pid, KILLED_TREE_SHM) for p in started))
    os.kill(client.pid, signal.SIGKILL)
    client.wait()
    return started, named_shm


def _assert_runtime_died(name, token, started, client):
    """Everything the killed client's runtime started ends within DIE_WITHIN_S."""
    _, alive = psutil.wait_procs(started, timeout=DIE_WITHIN_S)
    deadline = time.time() + DIE_WITHIN_S
    while (left := marked_processes(token)) and time.time() < deadline:
        time.sleep(0.1)
    stderr = client.stderr.read()
    client.stderr.close()
    assert not alive, f"{name}: processes outlived the killed client: {alive}\n{stderr[-2000:]}"
    assert not left, (f"{name}: processes carrying the runtime's token outlived the killed "
                      f"client: {[psutil.Process(p).cmdline() for p in left]}")
    assert "its guardian killed" in stderr, stderr[-2000:]


def _ranks_holding(marks) -> int:
    return len([n for n in os.listdir(marks) if n.startswith("rank-")])


@pytest.mark.parametrize("name", KILLED_CLIENT_EXECUTORS)
def test_killed_client_takes_its_runtime_with_it_and_the_campaign_resumes(tmp_path, name):
    # A client SIGKILLed while a 2-rank task runs: the guardian takes everything its
    # runtime started with it (ranks, launchers, daemonised pilot processes) and removes
    # the runtime's temp run dir. The journal lives in the client's DataFlowKernel, so a
    # second client resumes the campaign the same way on every runtime.
    timeout = CLIENT_TIMEOUT.get(name, 120)
    marks = tmp_path / "marks"
    args, first = _start_client(tmp_path, name)
    token, done_before_kill = None, set()
    try:
        deadline = time.time() + timeout
        for line in first.stdout:
            if line.startswith("token"):
                token = line.split()[1]
            if line.startswith("done"):
                done_before_kill.add(int(line.split()[1]))
            if len(done_before_kill) == 3:
                break
        while _ranks_holding(marks) < 2 and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)                       # both ranks of task 3 are running
        held = _ranks_holding(marks)
    finally:
        started, named_shm = _kill_client(first, token) if token else ([], set())
        if first.poll() is None:
            first.kill()
            first.wait()
        first.stdout.close()
    assert done_before_kill == {0, 1, 2} and held == 2, first.stderr.read()[-3000:]
    _assert_runtime_died(name, token, started, first)
    # ... and the names of the semaphores they held (multiprocessing's resource tracker,
    # which would have removed them, died with them), and of the MPI segments (Open MPI's: a
    # pool rank that finds its client gone exits on its own, without MPI_Finalize)
    assert name != "parsl" or [p for p in named_shm if p.startswith("/dev/shm/sem.mp-")]
    assert not [path for path in named_shm if os.path.exists(path)]
    # the guardian also removed the runtime's temp run dir
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("hetflow-")]

    (tmp_path / "release").touch()
    second = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert second.returncode == 0, second.stderr[-3000:]
    results = {int(line.split()[1]): int(line.split()[2]) for line in second.stdout.splitlines()
               if line.startswith("done")}
    assert results == {i: i * i for i in range(8)}

    runs = {i: 0 for i in range(8)}
    for mark in os.listdir(marks):
        if mark.startswith("ran-"):
            runs[int(mark.split("-")[1])] += 1
    # the three tasks journaled before the kill did not run again; only the one the kill
    # interrupted did
    assert runs == {**{i: 1 for i in range(8)}, 3: 2}, runs
