"""MPI apps on Parsl's machinery, on every executor: memoization, retries, checkpoint/restart,
and validation at the API edge (bad calls fail at call time, not later on a rank)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import hetflow
from conftest import EXECUTOR_OPTIONS, PARITY_EXECUTORS

pytestmark = pytest.mark.timeout(180)


@hetflow.mpi_app(ranks=2, cache=True)
def counted(comm, log, x):
    if comm.Get_rank() == 0:
        with open(log, "a") as fh:
            fh.write("ran\n")
    return comm.allreduce(x)


@hetflow.mpi_app(ranks=2, retries=2)
def flaky(comm, log, fail_times):
    attempt = None
    if comm.Get_rank() == 0:
        with open(log, "a") as fh:
            fh.write("attempt\n")
        with open(log) as fh:
            attempt = len(fh.readlines())
    attempt = comm.bcast(attempt, root=0)
    if attempt <= fail_times:
        raise RuntimeError(f"attempt {attempt} fails")
    return attempt


@hetflow.mpi_app(ranks=2, retries=3)
def bad_input(comm, log):
    if comm.Get_rank() == 0:
        with open(log, "a") as fh:
            fh.write("attempt\n")
    raise hetflow.InputError("column 'key' is missing")


@hetflow.mpi_app(ranks=1)
def noop(comm, *args):
    return None


def _lines(path):
    return len(open(path).readlines()) if os.path.exists(path) else 0


def test_cache_true_memoizes(runtime_name, tmp_path):
    log = str(tmp_path / "log")
    assert counted(log, 3).result() == 6
    assert counted(log, 3).result() == 6      # memoized: does not run again
    assert counted(log, 4).result() == 8      # other arguments: runs
    assert _lines(log) == 2


def test_retries_rerun_a_failed_task(runtime_name, tmp_path):
    log = str(tmp_path / "log")
    assert flaky(log, 2).result() == 3
    assert _lines(log) == 3


def test_retries_are_bounded(runtime_name, tmp_path):
    log = str(tmp_path / "log")
    with pytest.raises(hetflow.TaskFailed, match="attempt 3 fails"):
        flaky(log, 10).result()
    assert _lines(log) == 3                   # 1 try + 2 retries


def test_bad_input_is_never_retried(runtime_name, tmp_path):
    log = str(tmp_path / "log")
    with pytest.raises(hetflow.TaskFailed) as info:
        bad_input(log).result()
    assert isinstance(info.value.exception, hetflow.InputError)
    assert _lines(log) == 1


@pytest.mark.parametrize("exc", [hetflow.ConfigError("bad option"),
                                 hetflow.ResourcesUnavailable("no GPUs"),
                                 hetflow.InputError("bad file"),
                                 hetflow.NotSupported("walltime"),
                                 hetflow.TaskCancelled("cancelled")])
def test_retry_policy_refuses_final_errors(exc):
    from hetflow.runtime import retryable

    assert not retryable(exc)
    assert not retryable(hetflow.TaskFailed("wrapped", exception=exc))
    assert retryable(hetflow.TaskFailed("wrapped", exception=RuntimeError("flaky")))
    assert retryable(hetflow.TaskLost("rank died"))


# ----------------------------------------------------------------------------- call-time checks
def test_more_ranks_than_the_runtime_can_give_fails_at_call_time(runtime_name):
    with pytest.raises(hetflow.ResourcesUnavailable, match="4"):
        noop.options(ranks=5)()               # raised by the call itself, no future
    with pytest.raises(hetflow.ResourcesUnavailable, match="GPU"):
        noop.options(gpus_per_rank=1)()
    assert noop().result() is None


@pytest.mark.parametrize("bad", [{"ranks": 0}, {"ranks": -2}, {"ranks": 1.5},
                                 {"cores_per_rank": 0}, {"walltime": -1},
                                 {"returns": "some"}, {"nodes": 2}])
def test_bad_resources_fail_at_call_time(runtime_name, bad):
    with pytest.raises(hetflow.ConfigError):
        noop(hetflow_resources=bad)
    with pytest.raises(hetflow.ConfigError):
        noop.options(**bad)


def test_unpicklable_argument_fails_at_call_time(runtime_name):
    with pytest.raises(hetflow.ConfigError, match="cannot be pickled"):
        noop(threading.Lock())


# ----------------------------------------------------------------------------- checkpoint
CAMPAIGN = textwrap.dedent('''
    import json, os, sys, time
    import hetflow

    checkpoint, marks, run_dir, name, options = sys.argv[1:6]

    @hetflow.mpi_app(ranks=1)
    def step(comm, i, marks):
        open(os.path.join(marks, f"ran-{i}-{os.getpid()}"), "w").close()
        time.sleep(0.3)
        return i * i

    with hetflow.runtime(name, checkpoint=checkpoint, run_dir=run_dir, **json.loads(options)):
        for i in range(8):
            print("done", i, step(i, marks).result(), flush=True)
''')


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# The journal lives in the client's DataFlowKernel, so resuming works the same on every
# runtime; these two also show that nothing the killed client started outlives it. Parsl's
# interchange and RADICAL-Pilot's components do outlive a SIGKILLed client (seen here; a known
# gap written down in the README), so they are not in this list.
@pytest.mark.parametrize("name", [n for n in PARITY_EXECUTORS if n in ("mpirun", "pool")])
def test_checkpoint_resumes_a_killed_campaign(tmp_path, name):
    script = tmp_path / "campaign.py"
    script.write_text(CAMPAIGN)
    marks = tmp_path / "marks"
    marks.mkdir()
    options = json.dumps({**EXECUTOR_OPTIONS[name], "max_ranks": 1})   # one task at a time
    args = [sys.executable, str(script), str(tmp_path / "ckpt"), str(marks), str(tmp_path / "run"),
            name, options]

    first = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    done_before_kill = set()
    try:
        for line in first.stdout:
            if line.startswith("done"):
                done_before_kill.add(int(line.split()[1]))
            if len(done_before_kill) == 3:
                break
        orphans = _descendants(first.pid)      # launchers, ranks, workers of the client
    finally:
        os.kill(first.pid, signal.SIGKILL)     # only the client dies, mid-campaign
        first.wait()
    assert len(done_before_kill) == 3
    # Whatever the client had started must end by itself (no orphans left running).
    gone, alive = psutil.wait_procs(orphans, timeout=60)
    assert not alive, f"{name}: processes outlived the killed client: {alive}"

    second = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    results = {int(l.split()[1]): int(l.split()[2]) for l in second.stdout.splitlines()
               if l.startswith("done")}
    assert results == {i: i * i for i in range(8)}

    runs = {i: 0 for i in range(8)}
    for name in os.listdir(marks):
        runs[int(name.split("-")[1])] += 1
    for i in done_before_kill:
        assert runs[i] == 1, f"task {i} finished before the kill but ran {runs[i]} times"
    assert all(n >= 1 for n in runs.values())
    assert sum(runs.values()) <= 9             # at most the task in flight at the kill reran


def test_checkpoint_journal_skips_unreadable_records(tmp_path):
    from hetflow.journal import Journal

    journal = Journal(str(tmp_path))
    (tmp_path / "abc.result").write_bytes(b"\x80\x04 not a whole pickle")
    (tmp_path / ".tmp-123").write_bytes(b"partial")
    os.makedirs(tmp_path, exist_ok=True)
    assert journal.load() == {}
