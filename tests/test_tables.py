"""Tables handed between tasks: the typed errors, files across runs and runtimes, and the
pool's resident tables at its edges (a failing neighbour, a released handle, a wrong size).

The hand-over on every runtime is in test_parity.py; the debug runtime's in test_debug.py.
"""
import os
import time

import pyarrow as pa
import pytest

import hetflow
from hetflow.frame._table import synthetic_partition

pytestmark = pytest.mark.timeout(240)


def whole(rows, ranks=2, seed=7):
    return pa.concat_tables([synthetic_partition(r, ranks, rows, seed=seed)
                             for r in range(ranks)])


@hetflow.mpi_app(ranks=2)
def make_table(comm, rows):
    from hetflow import frame

    return frame.generate(comm, rows, seed=7)


@hetflow.mpi_app(ranks=2)
def table_on_rank_zero_only(comm):
    from hetflow import frame

    table = frame.generate(comm, 10, seed=7)
    return table if comm.Get_rank() == 0 else None


@hetflow.mpi_app(ranks=2)
def table_on_a_split(comm):
    from hetflow import frame

    return frame.generate(comm.Split(comm.Get_rank(), 0), 10, seed=7)


@hetflow.mpi_app(ranks=2)
def table_in_a_tuple(comm):
    from hetflow import frame

    return frame.generate(comm, 10, seed=7), "and more"


@hetflow.mpi_app(ranks=3, returns="all")
def local_parts(comm, table):
    return table.local


def test_a_table_that_cannot_be_handed_over_is_a_typed_error():
    with hetflow.runtime("mpirun", max_ranks=2):
        with pytest.raises(hetflow.TableHandoffError, match=r"rank\(s\) \[1\] returned NoneType"):
            table_on_rank_zero_only().result()
        for app, why in ((table_on_a_split, "communicator of 1 rank"),
                         (table_in_a_tuple, "cannot be pickled")):
            with pytest.raises(hetflow.TaskFailed) as info:
                app().result()
            assert isinstance(info.value.exception, hetflow.TableHandoffError)
            assert why in str(info.value)
        handle = make_table(10).result()
        assert handle.to_pandas()["key"].tolist() == whole(10)["key"].to_pylist()
    with pytest.raises(hetflow.TableHandoffError, match="removed with its run dir"):
        handle.to_arrow()                     # the run's temp dir, and the files, are gone


@hetflow.mpi_app(ranks=2, executors=["pool"])
def keep_part(comm, rows):
    import pyarrow as pa

    return hetflow.keep(pa.table({"n": [comm.Get_rank()] * rows}))


@hetflow.mpi_app(ranks=2, returns="all", executors=["pool"])
def part_rows(comm, part):
    return part.num_rows


@hetflow.mpi_app(ranks=2)
def fail_beside_a_waiting_peer(comm, go):
    while not os.path.exists(go):
        time.sleep(0.01)
    if comm.Get_rank() == 1:
        raise ValueError("rank 1 fails")
    comm.Barrier()                      # rank 0 waits here for good: the pool must stop it


@hetflow.mpi_app(ranks=2, returns="all")
def key_sums(comm, table):
    return int(table.local.column("key").to_numpy().sum())


def test_pool_tables_outlive_a_task_that_failed_on_other_ranks(tmp_path):
    go = str(tmp_path / "go")
    with hetflow.runtime("pool", max_ranks=4) as dfk:
        executor = dfk.executors["pool"]
        failing = fail_beside_a_waiting_peer(go)
        handle = make_table(100).result()   # on the two ranks the failing task leaves free
        busy = {s.id for s in executor._slots.values() if s.task is not None}
        assert len(busy) == 2 and not busy & set(handle.slots), (busy, handle.slots)
        open(go, "w").close()
        with pytest.raises(hetflow.TaskFailed, match="rank 1 fails"):
            failing.result()
        deadline = time.time() + 60
        while not any("still waited" in e for e in executor.events):
            assert time.time() < deadline, executor.events
            time.sleep(0.05)
        time.sleep(1)                       # what a SIGKILLed rank's world did: end it all
        expected = [int(synthetic_partition(r, 2, 100, seed=7)["key"].to_numpy().sum())
                    for r in range(2)]
        assert key_sums(handle).result() == expected, executor.events
        assert not any("exited" in e for e in executor.events), executor.events


@hetflow.mpi_app(ranks=2, executors="pool")          # one label, or a list
def table_on_the_pool(comm, rows):
    from hetflow import frame

    return frame.generate(comm, rows, seed=7)


@hetflow.mpi_app(ranks=3, returns="all", executors=["mpirun"])
def parts_on_mpirun(comm, table):
    return table.local


def test_tables_cross_runtimes_and_the_pool_s_handles_fail_clearly(tmp_path):
    """Two runtimes in one Parsl config: an mpirun table (files) reaches a pool task, a
    pool's table (inline, through the client) an mpirun task; then the pool's edges."""
    import parsl

    from hetflow.executors.mpirun import MpirunExecutor
    from hetflow.executors.pool import PoolExecutor
    from hetflow.resident import ResidentMissing, release

    config = parsl.Config(executors=[MpirunExecutor(max_ranks=3), PoolExecutor(max_ranks=3)],
                          run_dir=str(tmp_path), strategy="none")
    with parsl.load(config) as dfk:
        pool_dir = os.path.join(dfk.executors["pool"].run_root, "tables")
        on_mpirun = hetflow.mpi_app(make_table.fn, ranks=2, executors=["mpirun"])
        on_pool = hetflow.mpi_app(local_parts.fn, ranks=3, returns="all", executors=["pool"])
        files = on_mpirun(300).result(timeout=120)
        assert os.stat(os.path.dirname(files.paths[0])).st_mode & 0o777 == 0o700
        parts = on_pool(files).result(timeout=120)
        assert [p.num_rows for p in parts] == [200, 200, 200]
        assert pa.concat_tables(parts).equals(whole(300))
        release(files)
        assert not any(os.path.exists(p) for p in files.paths)

        handle = table_on_the_pool(200).result(timeout=120)
        assert handle.pool == dfk.executors["pool"].uid
        parts = parts_on_mpirun(handle).result(timeout=120)
        assert [p.num_rows for p in parts] == [133, 133, 134]
        assert pa.concat_tables(parts).equals(whole(200))
        assert not os.path.exists(pool_dir)                 # the pool wrote no file

        # Resident data given to a task of another size: refused at the call.
        kept = keep_part(5).result(timeout=120)
        with pytest.raises(hetflow.ConfigError, match="lives on 2 rank"):
            part_rows.options(ranks=3)(kept)
        assert part_rows(kept).result(timeout=120) == [5, 5]
        # A released handle: the error says so.
        release(kept)
        with pytest.raises(hetflow.TaskFailed) as info:
            part_rows(kept).result(timeout=120)
        assert isinstance(info.value.exception, ResidentMissing)
        assert "was released" in str(info.value), str(info.value)
