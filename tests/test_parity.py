"""The executor-parity suite: one MPI app, unchanged, on every runtime.

Every test runs once per executor in ``conftest.PARITY_EXECUTORS``. Each executor
must give the same result or the same hetflow error type. Where a runtime truly
cannot do a thing it lists the feature in ``executor.unsupported`` (feature ->
reason) and must raise :class:`hetflow.NotSupported` naming it instead.
"""
import os
import tempfile
import time

import pytest

import hetflow
from bounds import RECOVERY_S
from meet import meet

# On radical a test's first task may wait for a new RAPTOR worker (see RECOVERY_S).
pytestmark = pytest.mark.timeout(RECOVERY_S + 120)


# ----------------------------------------------------------------------------- apps
@hetflow.mpi_app(ranks=2)
def add(comm, a, b):
    return comm.allreduce(a + b)


@hetflow.mpi_app(ranks=2, returns="all")
def who(comm, tag):
    return (comm.Get_rank(), comm.Get_size(), tag)


@hetflow.mpi_app(ranks=1, returns="all")
def rendezvous(comm, mine, theirs, timeout=60.0):
    """Touch ``mine``, wait for ``theirs``: both tasks were running at the same time."""
    met = meet(comm, mine, theirs, timeout)
    return (comm.Get_rank(), comm.Get_size(), met)


@hetflow.mpi_app(ranks=1, returns="all")
def devices_while_met(comm, directory, tag, expected=0, after=(), timeout=60.0):
    """This rank's CUDA_VISIBLE_DEVICES, left in ``directory`` as ``tag-RANK``, once
    ``expected`` ranks left theirs (so the tasks meant to overlap all ran at once), whether
    one of the tasks named in ``after`` had ended (``NAME.done``) when it started, and its
    host (a device id names a GPU of one node)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    waited = any(os.path.exists(os.path.join(directory, f"{name}.done")) for name in after)
    mine = os.path.join(directory, f"{tag}-{comm.Get_rank()}")
    with open(mine + ".tmp", "w") as fh:
        fh.write(repr(seen))
    os.replace(mine + ".tmp", mine)
    deadline = time.monotonic() + timeout
    met = True
    while len([n for n in os.listdir(directory) if "." not in n]) < expected:
        if time.monotonic() > deadline:
            met = False
            break
        time.sleep(0.01)
    met = comm.allreduce(met, op=__import__("mpi4py").MPI.LAND)
    if comm.Get_rank() == 0:
        open(os.path.join(directory, f"{tag}.done"), "w").close()
    return (seen, waited, met, __import__("socket").gethostname())


@hetflow.mpi_app(ranks=2, returns="all")
def environment_variable(comm, name):
    return os.environ.get(name, "")


@hetflow.mpi_app(ranks=2)
def raise_on_rank_one(comm):
    if comm.Get_rank() == 1:
        raise KeyError("missing on rank one")
    comm.Barrier()
    return "unreachable"


@hetflow.mpi_app(ranks=3)
def exit_on_rank_one(comm):
    if comm.Get_rank() == 1:
        os._exit(3)
    comm.Barrier()
    return "unreachable"


@hetflow.mpi_app(ranks=2)
def abort_on_rank_zero(comm):
    if comm.Get_rank() == 0:
        os.abort()
    comm.Barrier()
    return "unreachable"


@hetflow.mpi_app(ranks=1, walltime=2)
def sleeper(comm, seconds):
    time.sleep(seconds)
    return "slept"


@hetflow.mpi_app(ranks=2, walltime=3)
def collective_deadlock(comm):
    if comm.Get_rank() == 0:
        comm.Barrier()          # rank 1 never enters it
    else:
        comm.recv(source=0)     # rank 0 never sends
    return "unreachable"


@hetflow.mpi_app(ranks=2, walltime=5)
def collective_on_rank_zero_alone(comm):
    if comm.Get_rank() == 0:
        comm.allreduce(1)       # the natural mistake: a collective inside ``if rank == 0``
    return "rank 1 returns at once"


@hetflow.mpi_app(ranks=2, returns="all")
def chatty(comm, lines):
    import logging
    import sys

    rank = comm.Get_rank()
    for i in range(lines):
        sys.stdout.write(f"line {i} of rank {rank}, ")   # one line in two writes
        sys.stdout.flush()
        print("whole")
    logging.getLogger("a-task").warning("logged by rank %d", rank)
    return rank


@hetflow.mpi_app(ranks=1)
def mark_and_sleep(comm, path, seconds):
    open(path, "w").close()
    time.sleep(seconds)
    return "finished"


def _expect_unsupported(executor, feature):
    """True if the executor declares ``feature`` unsupported (then it must say so)."""
    return feature in getattr(executor, "unsupported", {})


# ----------------------------------------------------------------------------- results
def test_root_result(runtime_name):
    assert add(1, 2).result() == 6


def test_ranks_ask_malloc_for_huge_pages(runtime_name):
    # Every runtime starts its ranks with glibc's malloc asking for transparent huge pages
    # (executors/launch.py, with_malloc_thp; its effect: test_mpirun.py).
    for tunables in environment_variable("GLIBC_TUNABLES").result():
        assert "glibc.malloc.hugetlb=1" in tunables.split(":"), tunables


@hetflow.mpi_app(ranks=2, returns="all")
def threads_seen(comm):
    import polars

    return (os.environ.get("OMP_NUM_THREADS"), os.environ.get("POLARS_MAX_THREADS"),
            polars.thread_pool_size())


def test_ranks_threads_are_sized_by_cores_per_rank(runtime_name):
    # cores_per_rank (1 by default) sizes the ranks' BLAS/OpenMP threads on every runtime,
    # and polars' pool when a rank first imports it: a rank that outlives its tasks (pool,
    # radical) keeps the size of the first task that imported polars, an earlier test's
    # here. RAPTOR's ranks once had neither set, and ran polars on every core.
    for omp, polars_threads, pool_size in threads_seen().result():
        assert omp == "1" and polars_threads is not None
        assert pool_size == int(polars_threads), (polars_threads, pool_size)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_returns_all_has_requested_size(runtime_name, ranks):
    got = who.options(ranks=ranks)(ranks).result()
    assert got == [(r, ranks, ranks) for r in range(ranks)]


def test_heterogeneous_tasks_run_at_once_on_their_own_sizes(runtime_name):
    with tempfile.TemporaryDirectory() as tmp:
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        one = rendezvous.options(ranks=1)(a, b)
        two = rendezvous.options(ranks=2)(b, a)
        assert one.result() == [(0, 1, True)]
        assert two.result() == [(0, 2, True), (1, 2, True)]


def test_gpu_tasks_get_disjoint_devices_and_wait_for_free_ones(runtime_name, executor):
    from conftest import DECLARED_GPUS

    if runtime_name == "slurm":     # Slurm schedules and binds GPUs (gres: 2 per node)
        return _slurm_gpu_tasks(executor)
    assert executor.gpu_ids == DECLARED_GPUS
    gpu = devices_while_met.options(gpus_per_rank=1)
    with tempfile.TemporaryDirectory() as tmp:
        # Two GPU tasks and a CPU task run at once (each waits for the other two) ...
        a, b = gpu(tmp, "a", 3), gpu(tmp, "b", 3)
        cpu = devices_while_met(tmp, "c", 3)
        # ... and a third GPU task, with a slot free but no device, waits for one of them.
        late = gpu(tmp, "d", after=("a", "b"))
        (got_a,), (got_b,), (got_cpu,), (got_late,) = (f.result() for f in (a, b, cpu, late))
        assert got_a[2] and got_b[2] and got_cpu[2]         # they overlapped
        assert sorted([got_a[0], got_b[0]]) == sorted(DECLARED_GPUS)
        assert got_cpu[0] == ""                              # a CPU task sees no GPU
        assert got_late[1] and got_late[0] in DECLARED_GPUS  # it started after a GPU task ended
        # two ranks of one task: one device each
        both = gpu.options(ranks=2)(tmp, "e").result()
        assert sorted(r[0] for r in both) == sorted(DECLARED_GPUS)


def _slurm_gpu_tasks(executor):
    # The test cluster's nodes (.ci/slurm) have 2 CPUs and 2 GPUs ("0", "1") each.
    assert executor.gpus == 4
    both_gpus = devices_while_met.options(gpus_per_rank=2)
    with tempfile.TemporaryDirectory() as tmp:
        # Two tasks of 2 GPUs each need a node each, and a CPU task runs beside them ...
        a, b = both_gpus(tmp, "a", 3), both_gpus(tmp, "b", 3)
        cpu = devices_while_met(tmp, "c", 3)
        # ... and a third, with a CPU free but no node's GPUs, waits for one of them. Slurm
        # takes jobs in the order they come, not hetflow's: submitted with the others, it
        # could take a node's GPUs before "a" did.
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(tmp, f"{t}-0")) for t in "abc"):
            assert time.monotonic() < deadline, os.listdir(tmp)
            time.sleep(0.05)
        late = both_gpus(tmp, "d", after=("a", "b"))
        (got_a,), (got_b,), (got_cpu,), (got_late,) = (f.result() for f in (a, b, cpu, late))
        assert got_a[2] and got_b[2] and got_cpu[2]          # they overlapped
        assert got_a[0] == got_b[0] == "0,1" and got_a[3] != got_b[3]
        assert got_cpu[0] == ""                               # a CPU task sees no GPU
        assert got_late[1] and got_late[0] == "0,1"           # it started after one ended
        # two ranks of one task: one device each, as Slurm binds them (per task)
        both = devices_while_met.options(ranks=2, gpus_per_rank=1)(tmp, "e").result()
        assert [r[0] in ("0", "1") for r in both] == [True, True]
        assert len({(r[3], r[0]) for r in both}) == 2


def test_future_as_dependency(runtime_name):
    first = add(1, 2)                            # 2 ranks: 6
    second = add.options(ranks=3)(first, 1)      # 3 ranks: 21
    assert second.result() == 21


def test_per_call_resource_override(runtime_name):
    got = who("x", hetflow_resources={"ranks": 3})
    assert [size for _, size, _ in got.result()] == [3, 3, 3]


def test_task_times_common_schema(runtime_name):
    fut = who("t")
    fut.result()
    times = hetflow.task_times(fut)
    assert times is not None and times.executor == runtime_name and times.ranks == 2
    assert times.submitted <= times.launched <= times.started <= times.finished <= times.delivered
    assert times.overhead_s >= 0


# ----------------------------------------------------------------------------- failures
def test_exception_on_rank_one(runtime_name):
    with pytest.raises(hetflow.TaskFailed) as info:
        raise_on_rank_one().result()
    err = info.value
    assert not isinstance(err, hetflow.TaskLost)
    assert err.rank == 1
    assert isinstance(err.exception, KeyError)
    assert "missing on rank one" in err.remote_traceback


def test_exit_code_on_one_rank_is_task_lost(runtime_name):
    with pytest.raises(hetflow.TaskLost) as info:
        exit_on_rank_one().result()
    assert info.value.rank == 1
    assert "os._exit(3)" in str(info.value)


def test_abort_signal_is_task_lost(runtime_name):
    with pytest.raises(hetflow.TaskLost) as info:
        abort_on_rank_zero().result()
    assert info.value.rank == 0


def test_walltime_exceeded(runtime_name, executor):
    if _expect_unsupported(executor, "walltime"):
        with pytest.raises(hetflow.NotSupported, match="walltime"):
            sleeper(60).result()
        return
    start = time.time()
    with pytest.raises(hetflow.WalltimeExceeded):
        sleeper(60).result()
    assert time.time() - start < 45


def test_collective_deadlock_ended_by_walltime(runtime_name, executor):
    if _expect_unsupported(executor, "walltime"):
        pytest.skip(executor.unsupported["walltime"])
    with pytest.raises(hetflow.WalltimeExceeded):
        collective_deadlock().result()


def test_rank_zero_alone_in_a_collective_is_explained(runtime_name, executor, caplog,
                                                      monkeypatch):
    # While it hangs, a warning names the rank that returned; when the walltime stops it,
    # the error carries rank 0's stack at the collective (issue 34).
    if _expect_unsupported(executor, "walltime"):
        pytest.skip(executor.unsupported["walltime"])
    monkeypatch.setattr(executor, "hang_warning_s", 0.2)
    caplog.set_level("WARNING", logger="hetflow.tasks")
    fut = collective_on_rank_zero_alone()
    with pytest.raises(hetflow.WalltimeExceeded) as info:
        fut.result()
    error = info.value
    assert set(error.stacks) == {0}, str(error)
    assert "comm.allreduce(1)" in error.stacks[0] and "allreduce" in str(error)
    assert "rank(s) [1] returned" in str(error)
    times = hetflow.task_times(fut)
    assert list(times.returned) == [1]
    warned = [r for r in caplog.records if r.name == "hetflow.tasks"
              and f"task {error.task_id} " in r.getMessage()]
    assert len(warned) == 1 and "rank(s) [1] returned" in warned[0].getMessage(), \
        [r.getMessage() for r in caplog.records]
    assert "rank(s) [0] were still running" in warned[0].getMessage()
    assert warned[0].created < times.delivered


def test_rank_output_reaches_the_client_prefixed(runtime_name, capsys):
    fut = chatty(3)
    assert fut.result() == [0, 1]
    task = fut.task_record["exec_fu"].hetflow_task.id
    printed = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        prefix = f"[task {task} rank {rank}] "
        mine = [line[len(prefix):] for line in printed if line.startswith(prefix)]
        assert mine[:3] == [f"line {i} of rank {rank}, whole" for i in range(3)], printed
        assert mine[3:] == [f"logged by rank {rank}"], printed
    assert f"[task {task} rank 1] line 2 of rank 1, whole\n" in hetflow.task_output(fut)


def test_cancel_running_task(runtime_name, executor):
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "running")
        fut = mark_and_sleep(marker, 60)
        # the task may first wait for a new RAPTOR worker (see RECOVERY_S)
        deadline = time.time() + RECOVERY_S
        while not os.path.exists(marker):
            assert time.time() < deadline, "task never started"
            time.sleep(0.05)
        if _expect_unsupported(executor, "cancel_running"):
            with pytest.raises(hetflow.NotSupported, match="cancel"):
                hetflow.cancel(fut)
            return
        start = time.time()
        assert hetflow.cancel(fut) is True
        with pytest.raises(hetflow.TaskCancelled) as info:
            fut.result(timeout=45)
        assert time.time() - start < 45
        # in the app from its marker on (maybe still closing the marker, not yet asleep)
        assert " in mark_and_sleep" in info.value.stacks[0], str(info.value)


# ----------------------------------------------------------------------------- tables handed over
@hetflow.mpi_app(ranks=2)
def make_table(comm, rows):
    from hetflow import frame

    return frame.generate(comm, rows, seed=7)


@hetflow.mpi_app(ranks=3, returns="all")
def local_parts(comm, table):
    assert table.comm.Get_size() == comm.Get_size()
    return table.local, table.num_rows()


def test_returned_table_is_handed_whole_to_a_3_rank_task_and_the_client(runtime_name,
                                                                         executor):
    import pyarrow as pa

    from hetflow.frame._table import synthetic_partition

    whole = pa.concat_tables([synthetic_partition(r, 2, 500, seed=7) for r in range(2)])
    handle = make_table(500).result()
    assert isinstance(handle, hetflow.TableHandle)
    assert handle.ranks == 2 and handle.rows == (500, 500)
    same = local_parts.options(ranks=2)(handle).result()          # kept as it was
    assert [t.equals(synthetic_partition(r, 2, 500, seed=7)) for r, (t, _) in enumerate(same)] \
        == [True, True]
    assert handle.to_arrow().equals(whole)
    # Last: on a pool whose ranks earlier tests replaced, a 3-rank task restarts it as one
    # world, and what the old ranks kept goes with them (docs/runtimes/pool.md).
    parts = local_parts(handle).result()                 # re-partitioned over 3 ranks
    assert [n for _, n in parts] == [1000] * 3
    assert [t.num_rows for t, _ in parts] == [333, 333, 334]
    assert pa.concat_tables([t for t, _ in parts]).equals(whole)   # rows, values and order
    tables_dir = os.path.join(executor.run_root, "tables")
    if runtime_name == "pool":
        assert handle.pool == executor.uid and not handle.paths
        assert not os.path.exists(tables_dir)            # kept in the ranks: no file written
        from hetflow.resident import release

        release(handle)
    else:
        assert all(p.startswith(tables_dir + os.sep) for p in handle.paths)
        assert {os.stat(p).st_mode & 0o777 for p in handle.paths} == {0o600}


def test_more_ranks_than_the_runtime_has(runtime_name, executor):
    too_many = executor.max_ranks + 1
    with pytest.raises(hetflow.ResourcesUnavailable):
        who.options(ranks=too_many)("big").result(timeout=30)


def test_runtime_still_works_after_failures(runtime_name):
    failures = [raise_on_rank_one(), exit_on_rank_one()]
    good = [add(i, i) for i in range(4)]
    assert [f.result() for f in good] == [0, 4, 8, 12]
    for f in failures:
        with pytest.raises(hetflow.TaskFailed):
            f.result()


# ----------------------------------------------------------------------------- training
# hetflow.torch on every runtime (CPU, Gloo), in one test of three tasks per runtime: the ranks
# import torch (~3 s a fresh rank on an idle 2-core host, 10-20 s at load 20; the pool's and
# RAPTOR's ranks keep it).
def _need_torch():
    """Skip without torch, found without importing it (the client never needs it)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch extra)")


def test_torch_training_faults_then_parity_side_by_side(runtime_name, tmp_path):
    """A rank killed mid-training fails its task with TaskLost; the runtime's next tasks, a
    2-rank DDP task whose rank 0 starts with no rows and a 1-rank one, run at the same time
    (each waits for the other with its group up) and each reaches the weights of one process
    trained on the same global batches (float64, PARITY_ATOL)."""
    _need_torch()
    from torch_apps import PARITY_ATOL, ddp_train

    with pytest.raises(hetflow.TaskLost) as info:
        ddp_train(rows=40, kill_rank=1, kill_step=2).result()
    assert info.value.rank == 1
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    two = ddp_train(rows=40, empty_rank=0, mine=a, theirs=b)
    one = ddp_train.options(ranks=1)(rows=24, mine=b, theirs=a)
    got_two, got_one = two.result(), one.result()
    assert got_two["met"] and got_one["met"], "the two training tasks did not run at once"
    assert got_two["size"] == 2 and got_two["backend"] == "gloo"
    assert got_two["rows"] == [20, 20] and got_two["steps"] == 2 * 3
    assert got_one["rows"] == [24] and got_one["steps"] == 2 * 3
    for got in (got_two, got_one):
        assert got["moved"] > 1e-3, "training did not change the weights"
        assert got["diff"] <= PARITY_ATOL, got
