"""MPI apps on Parsl's machinery, on every executor: memoization, retries, the checkpoint journal,
and validation at the API edge (bad calls fail at call time, not later on a rank)."""
import os
import threading

import pytest

import hetflow

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
    # Every rank raises once the attempt is logged: a task fails with its first rank that
    # raises (the pool delivers that at once; its peers may be stuck in a collective), and
    # rank 1 raising at once could fail the task before rank 0 had written its line.
    comm.Barrier()
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
        noop.options(gpus_per_rank=5)()       # 2 declared GPUs (conftest), 4 on Slurm (gres)
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
# (resuming a campaign whose client was SIGKILLed: tests/test_faults.py)
def test_checkpoint_journal_skips_unreadable_records(tmp_path):
    from hetflow.journal import Journal

    journal = Journal(str(tmp_path))
    (tmp_path / "abc.result").write_bytes(b"\x80\x04 not a whole pickle")
    (tmp_path / ".tmp-123").write_bytes(b"partial")
    os.makedirs(tmp_path, exist_ok=True)
    assert journal.load() == {}
