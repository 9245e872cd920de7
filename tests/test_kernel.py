"""The executor kernel's contract, on a minimal runtime of threads (no MPI launch).

The parity suite checks the same behaviour through every real runtime; this file
pins down what the kernel itself promises a runtime author: the kernel's verdict
(walltime, cancel, shutdown) wins over what the runtime reports, queued tasks are
cancelled without the runtime, slots are freed, a failing ``_start`` fails only
its own task.
"""
import threading
import time

import pytest

import hetflow
from hetflow._task import MPITask
from hetflow.executors._rank import run_on_rank
from hetflow.executors.kernel import Executor

pytestmark = pytest.mark.timeout(60)


class Threads(Executor):
    """Each task on its own thread, on COMM_SELF; ``_stop`` only records that it was asked."""

    def __init__(self, slots=2):
        super().__init__("threads", max_ranks=slots)
        self.stops = []

    def _start(self, task):
        if task.resources.retries == 7:       # the tests' mark for "cannot start"
            raise RuntimeError("refused to start")
        threading.Thread(target=self._run, args=(task,), daemon=True).start()

    def _run(self, task):
        from mpi4py import MPI

        self.complete(task, {0: run_on_rank(task.payload, MPI.COMM_SELF)})

    def _stop(self, task, error):
        self.stops.append((task.id, type(error).__name__))


def nap(comm, seconds, tag=None):
    time.sleep(seconds)
    return tag


@pytest.fixture
def runtime(tmp_path):
    executor = Threads()
    executor.run_dir = str(tmp_path)
    executor.start()
    yield executor
    executor.shutdown()


def submit(executor, seconds, tag=None, **resources):
    spec = hetflow.Resources(**resources).to_spec()
    return executor.submit(MPITask(nap), spec, seconds, tag)


def test_walltime_verdict_wins_over_the_late_value(runtime):
    fut = submit(runtime, 1.0, "late", walltime=0.2)
    with pytest.raises(hetflow.WalltimeExceeded, match="walltime of 0.2 s"):
        fut.result(timeout=10)
    assert runtime.stops == [(fut.parsl_executor_task_id, "WalltimeExceeded")]
    assert hetflow.task_state(fut) == "FAILED"


def test_queued_task_is_cancelled_without_the_runtime(runtime):
    running = submit(runtime, 0.5, "a", cores_per_rank=2)       # takes both slots
    queued = submit(runtime, 0.0, "b")
    assert hetflow.task_state(queued) == "SCHEDULING"
    assert runtime.cancel(queued) is True
    with pytest.raises(hetflow.TaskCancelled, match="before it started"):
        queued.result(timeout=1)
    assert runtime.stops == []
    assert running.result(timeout=10) == "a"
    assert hetflow.task_state(queued) == "CANCELED"


def test_running_task_is_stopped_through_the_hook(runtime):
    fut = submit(runtime, 0.5, "x")
    while hetflow.task_state(fut) != "EXECUTING":
        time.sleep(0.01)
    assert runtime.cancel(fut) is True
    with pytest.raises(hetflow.TaskCancelled, match="while running"):
        fut.result(timeout=10)
    assert runtime.stops == [(fut.parsl_executor_task_id, "TaskCancelled")]


def test_slots_are_freed_and_backfill_runs_small_tasks(runtime):
    first = submit(runtime, 0.3, 1)
    big = submit(runtime, 0.0, 2, cores_per_rank=2)       # waits for both slots
    small = submit(runtime, 0.0, 3)              # may pass the big one
    assert [f.result(timeout=10) for f in (first, big, small)] == [1, 2, 3]
    assert hetflow.task_times(small).launched < hetflow.task_times(big).launched


def test_failing_start_fails_only_its_task(runtime):
    bad = submit(runtime, 0.0, "bad", retries=7)
    with pytest.raises(RuntimeError, match="refused to start"):
        bad.result(timeout=10)
    assert submit(runtime, 0.0, "good", cores_per_rank=2).result(timeout=10) == "good"


def test_shutdown_fails_queued_and_running_tasks(tmp_path):
    executor = Threads(slots=1)
    executor.run_dir = str(tmp_path)
    executor.start()
    running = submit(executor, 0.5, "r")
    queued = submit(executor, 0.0, "q")
    while hetflow.task_state(running) != "EXECUTING":
        time.sleep(0.01)
    executor.shutdown()
    for fut in (running, queued):
        with pytest.raises(hetflow.ExecutorBroken, match="shut down before task"):
            fut.result(timeout=10)
    with pytest.raises(hetflow.ExecutorBroken, match="is shut down"):
        submit(executor, 0.0)


class Counted:
    """An argument that counts how often the client pickles it."""

    pickled = 0

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        Counted.pickled += 1
        return (Counted, (self.value,))


@hetflow.mpi_app
def unwrap(comm, counted, plus=0):
    return counted.value + plus


def test_a_calls_arguments_are_pickled_once_on_the_client(tmp_path):
    # mpi_app's call pickles them (which also checks them); the kernel's payload carries those
    # bytes, where it pickled them a second time.
    with hetflow.runtime("debug", run_dir=str(tmp_path)):
        Counted.pickled = 0
        assert unwrap(Counted(40), plus=2).result(timeout=30) == 42
        assert Counted.pickled == 1
        # an argument that is a Future is known only later: the rest are checked at the call
        # and pickled with it at submission
        Counted.pickled = 0
        assert unwrap(Counted(1), plus=unwrap(Counted(2))).result(timeout=30) == 3
        assert Counted.pickled == 3      # Counted(2) once; Counted(1) at the call and at submit


def _tracked_per_object(make, n=2000):
    """Objects the cyclic gc tracks per ``make()`` kept alive (the collector off meanwhile)."""
    import gc

    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        kept = [make() for _ in range(n)]
        return (len(gc.get_objects()) - before - 1) / len(kept)    # -1: the list itself
    finally:
        gc.enable()


def test_a_task_future_is_a_future_with_no_lock_of_its_own_until_a_thread_waits():
    """The executor's future of a queued task is one object for the collector (a plain
    ``Future`` is 10 on CPython 3.11: its Condition, the RLock's bound methods, a deque and
    two lists), and behaves as a ``Future``: values, errors, timeouts, callbacks (one or
    more, before or after), cancel, ``wait`` and ``as_completed``."""
    from concurrent.futures import (FIRST_COMPLETED, CancelledError, Future, InvalidStateError,
                                    TimeoutError as FutureTimeout, as_completed, wait)

    from hetflow.executors.dispatch import TaskFuture

    assert _tracked_per_object(Future) >= 8
    assert _tracked_per_object(TaskFuture) <= 1.01

    future, seen = TaskFuture(), []
    assert isinstance(future, Future) and not future.done() and not future.running()
    future.add_done_callback(seen.append)
    future.add_done_callback(lambda f: seen.append(f.result()))
    with pytest.raises(FutureTimeout):
        future.result(timeout=0.01)
    threading.Timer(0.05, future.set_result, (7,)).start()
    assert future.result(timeout=10) == 7 and seen == [future, 7]
    with pytest.raises(InvalidStateError):
        future.set_result(8)
    late = []
    future.add_done_callback(late.append)
    assert late == [future] and future.exception() is None

    pending, failing = TaskFuture(), TaskFuture()
    threading.Timer(0.05, failing.set_exception, (ValueError("no"),)).start()
    done, not_done = wait([pending, failing], timeout=10, return_when=FIRST_COMPLETED)
    assert done == {failing} and not_done == {pending}
    assert isinstance(failing.exception(), ValueError)
    with pytest.raises(ValueError, match="no"):
        failing.result()
    threading.Timer(0.05, pending.set_result, (None,)).start()
    assert list(as_completed([pending, failing], timeout=10))[-1] is pending

    cancelled = TaskFuture()
    assert cancelled.cancel() and cancelled.cancelled() and cancelled.done()
    assert not cancelled.set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        cancelled.result()
    running = TaskFuture()
    assert running.set_running_or_notify_cancel() and running.running()
    assert not running.cancel()


_SCALE = 2


@hetflow.mpi_app
def scaled(comm, x):
    return x * _SCALE


def test_a_payload_carries_its_apps_bytes_through_plain_pickle_only_while_they_hold():
    """From an app's second task on, its payload is plain pickle around the app's function
    pickled once (``_pickling.alone``), with no cloudpickle pickler per task; a global the
    function reads that changes makes new bytes (as cloudpickle would pickle it anew)."""
    import pickle

    from hetflow.executors import _pickling
    from hetflow.executors.payload import TaskPayload

    global _SCALE

    def sent(x):
        arguments = _pickling.dumps(((x,), {}))
        payload = TaskPayload(0, scaled.func, (x,), {}, hetflow.Resources(), None, None,
                              arguments)
        loaded = pickle.loads(payload.dumps())
        return loaded.func.fn(None, *loaded.args, **loaded.kwargs)

    first = sent(3)
    assert _pickling.alone(scaled.func) is not None and scaled.func in _pickling._TASKS
    assert (first, sent(3)) == (6, 6)
    try:
        _SCALE = 5
        assert sent(3) == 15
    finally:
        _SCALE = 2
    assert sent(4) == 8
