"""hetflow.torch: tables to tensors (batches) and the training process group, under real
mpiexec and in this process (COMM_SELF). The runtimes' cases are in test_parity.py (DDP
parity, a killed rank), the rogue-peer case in test_security.py.

Cost: ``import torch`` is the bulk (~3 s a process on an idle 2-core host, 10-20 s at load
25): this module imports it once in the test process and runs one 3-rank mpiexec.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np        # noqa: E402 - after the skip
import pyarrow as pa      # noqa: E402
from mpi4py import MPI    # noqa: E402

import hetflow            # noqa: E402
import hetflow.torch as ht  # noqa: E402
from hetflow.frame import DistributedTable  # noqa: E402
from mpiutil import run_mpi  # noqa: E402


def _table(**columns):
    return DistributedTable(MPI.COMM_SELF, pa.table(columns))


def _address(table: DistributedTable, name: str) -> int:
    chunk = table.local.column(name).chunk(0)
    return chunk.buffers()[1].address + chunk.offset * chunk.type.bit_width // 8


def test_single_column_reaches_torch_without_a_copy():
    table = _table(x=np.arange(1000, dtype=np.float32), y=np.arange(1000, dtype=np.int64))
    data = ht.batches(table, "x", "y", batch_size=100, shuffle=False)
    assert data.copied_bytes == 0
    # the tensors are the Arrow buffers themselves, and an unshuffled batch a view of them
    assert data.features.data_ptr() == _address(table, "x")
    assert data.label.data_ptr() == _address(table, "y")
    x, y = next(iter(data))
    assert x.data_ptr() == _address(table, "x") and y.data_ptr() == _address(table, "y")
    x, y = list(data)[3]
    assert x.data_ptr() == _address(table, "x") + 300 * 4
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (100,)
    # a one-name list: (rows, 1), still a view
    one = ht.batches(table, ["x"], batch_size=10, shuffle=False)
    assert one.features.shape == (1000, 1) and one.features.data_ptr() == _address(table, "x")
    # a sliced table (an offset into its buffer) too
    sliced = DistributedTable(MPI.COMM_SELF, table.local.slice(10, 50))
    view = ht.batches(sliced, "x", batch_size=10, shuffle=False)
    assert view.copied_bytes == 0 and view.features.data_ptr() == _address(table, "x") + 40
    assert view.features[0].item() == 10.0


def test_stacking_columns_costs_one_copy():
    n = 500
    table = _table(a=np.arange(n, dtype=np.float64), b=-np.arange(n, dtype=np.float64),
                   c=np.ones(n, dtype=np.float32), y=np.zeros(n, dtype=np.float32))
    data = ht.batches(table, ["a", "b", "c"], "y", batch_size=64, shuffle=False)
    assert data.copied_bytes == n * 3 * 8        # the (rows, 3) float64 matrix, written once
    assert data.features.dtype == torch.float64 and data.features.shape == (n, 3)
    assert data.features[7].tolist() == [7.0, -7.0, 1.0]
    assert data.label.data_ptr() == _address(table, "y")
    cast = ht.batches(table, ["a", "b", "c"], batch_size=64, dtype=torch.float32)
    assert cast.copied_bytes == n * 3 * 4        # the cast happens in that same copy


def test_nulls_raise_naming_the_column_unless_filled():
    table = DistributedTable(MPI.COMM_SELF, pa.table({
        "x": pa.array([1.0, None, 3.0]), "y": pa.array([1, 2, 3])}))
    with pytest.raises(hetflow.errors.NullValues, match="'x' has 1 null"):
        ht.batches(table, ["x"], "y", batch_size=2)
    assert issubclass(ht.NullValues, hetflow.InputError)
    filled = ht.batches(table, "x", "y", batch_size=3, fill=0.0, shuffle=False)
    assert next(iter(filled))[0].tolist() == [1.0, 0.0, 3.0]
    per_column = ht.batches(table, "x", "y", batch_size=3, fill={"x": -1.0}, shuffle=False)
    assert next(iter(per_column))[0].tolist() == [1.0, -1.0, 3.0]
    with pytest.raises(hetflow.errors.KeyColumnError, match="'nope'"):
        ht.batches(table, ["nope"], batch_size=2)


def test_a_column_no_tensor_holds_is_named_with_its_arrow_type():
    table = DistributedTable(MPI.COMM_SELF, pa.table({
        "x": [1.0, 2.0], "city": ["paris", "rome"], "ok": [True, False],
        "code": pa.array(["a", "b"]).dictionary_encode(), "y": [1, 2]}))
    for features, label, kind in ((["x", "city"], "y", "string"),
                                  ("code", None, "dictionary<values=string, indices=int32"),
                                  (["x"], "city", "string")):
        name = "code" if kind.startswith("dictionary") else "city"
        with pytest.raises(hetflow.InputError) as caught:
            ht.batches(table, features, label)
        assert f"batches: column {name!r} has Arrow type {kind}" in str(caught.value)
    data = ht.batches(table, ["x", "ok"], "y", shuffle=False)   # booleans are fine
    assert next(iter(data))[0].tolist() == [[1.0, 1.0], [2.0, 0.0]]


def test_shuffle_is_seeded_per_epoch():
    table = _table(x=np.arange(64, dtype=np.int64))
    data = ht.batches(table, "x", batch_size=16, seed=5)
    first = torch.cat(list(data))
    again = torch.cat(list(data))
    data.set_epoch(1)
    other = torch.cat(list(data))
    assert first.tolist() == again.tolist() and first.tolist() != other.tolist()
    assert sorted(first.tolist()) == sorted(other.tolist()) == list(range(64))
    assert len(data) == 4 and len(ht.batches(table, "x", batch_size=15, drop_last=True)) == 4
    assert len(ht.batches(table, "x", batch_size=15)) == 5


def test_process_group_outside_a_task_says_so():
    with pytest.raises(hetflow.HetflowError, match="outside a hetflow task"):
        with ht.process_group():
            pass


_RANKS = """
import os
import numpy as np, pyarrow as pa, torch, torch.distributed as dist
from mpi4py import MPI
import hetflow, hetflow.torch as ht
from hetflow.frame import DistributedTable
import mpiutil

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
got = {}
# uneven partitions: 10, 7 and 0 rows
rows = {0: 10, 1: 7, 2: 0}[rank]
start = {0: 0, 1: 10, 2: 17}[rank]
table = DistributedTable(comm, pa.table({"x": np.arange(start, start + rows, dtype=np.int64)}))
even = ht.batches(table, "x", batch_size=4, shuffle=False)
got["rebalanced"] = (even.local_rows, len(even), [b.tolist() for b in even])
dropped = ht.batches(table, "x", batch_size=4, shuffle=False, even="drop")
got["drop"] = (dropped.rank_counts, len(dropped), len(list(dropped)))
# a null on rank 1 only: every rank raises the same error
x = pa.array([1.0, None] if rank == 1 else [1.0, 2.0])
try:
    ht.batches(DistributedTable(comm, pa.table({"x": x})), "x", batch_size=1)
    got["null"] = None
except hetflow.errors.NullValues as exc:
    got["null"] = str(exc)
# process groups: three in turn on the same ranks; one whose body raises is destroyed
with ht.process_group(comm) as group:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    got["group"] = (group.rank, group.size, group.local_rank, group.local_size, group.backend,
                    str(group.device), t.item())
try:
    with ht.process_group(comm):
        raise ValueError("in the body")
except ValueError:
    got["after_raise"] = dist.is_initialized()
with ht.process_group(comm, backend="gloo") as group:
    t = torch.ones(3)
    dist.all_reduce(t)
    got["again"] = t.tolist()
# Gloo fails to build the group on rank 2 (its store, failing once, before it publishes
# its address): the others' wait for it ends at the timeout, and every rank says so
import datetime
from hetflow.torch._store import MPIStore
real_set = MPIStore.set
def failing_set(self, key, value):
    MPIStore.set = real_set
    raise dist.DistStoreError("injected by the test")
if rank == 2:
    MPIStore.set = failing_set
try:
    with ht.process_group(comm, timeout=datetime.timedelta(seconds=2)):
        got["unbuilt"] = None
except hetflow.HetflowError as exc:
    got["unbuilt"] = (type(exc).__name__, str(exc), dist.is_initialized())
try:
    with ht.process_group(comm, backend="nccl"):
        pass
except hetflow.ConfigError as exc:
    got["nccl"] = str(exc)
# the rendezvous store itself: counters, compare-and-set and timeouts served by rank 0
store = MPIStore(comm.Dup(), datetime.timedelta(seconds=30))
store.add("n", rank + 1)
comm.Barrier()
won = store.compare_set("k", b"", b"r%d" % rank) == b"r%d" % rank
comm.Barrier()
got["store"] = (int(store.get("n")), won, store.get("k"), store.check(["n", "k"]))
try:
    store.wait(["never"], datetime.timedelta(seconds=0.3))
    got["store_timeout"] = None
except dist.DistStoreError as exc:
    got["store_timeout"] = str(exc)
store.close()
mpiutil.report(got)
"""


def test_three_ranks_batches_and_groups():
    got = run_mpi(_RANKS, 3, timeout=240).values(3)
    # 17 rows rebalanced 6, 6, 5 in global order; 2 batches of 4 rows at most everywhere
    assert [g["rebalanced"][0] for g in got] == [6, 6, 5]
    assert [g["rebalanced"][1] for g in got] == [2, 2, 2]
    assert got[0]["rebalanced"][2] == [[0, 1, 2, 3], [4, 5]]
    assert got[2]["rebalanced"][2] == [[12, 13, 14, 15], [16]]
    # without moving rows: the fewest batches any rank has (rank 2's none)
    assert all(g["drop"] == ([3, 2, 0], 0, 0) for g in got)
    assert all("'x' has 1 null" in g["null"] and "rank 1" in g["null"] for g in got), got
    assert [g["group"] for g in got] == [(r, 3, r, 3, "gloo", "cpu", 3.0) for r in range(3)]
    assert all(g["after_raise"] is False for g in got)
    assert all(g["again"] == [3.0, 3.0, 3.0] for g in got)
    assert all(g["unbuilt"][0] == "HetflowError" and "could not be built on rank(s) [0, 1, 2]"
               in g["unbuilt"][1] and g["unbuilt"][2] is False for g in got), got
    assert all("CUDA device on every rank" in g["nccl"] for g in got)
    assert [g["store"][0] for g in got] == [6, 6, 6]
    assert sum(g["store"][1] for g in got) == 1, "compare_set let more than one rank win"
    assert len({g["store"][2] for g in got}) == 1 and all(g["store"][3] for g in got)
    assert all("timed out" in g["store_timeout"] for g in got), got


def test_handoff_benchmark_counts_the_copies():
    # experiments/torch_bench.py's hand-off part, small: what it reports as copied is
    # what the paths copy (its figures come from `python -m hetflow.experiments.torch_bench`)
    from hetflow.experiments.torch_bench import handoff_compare

    threads = torch.get_num_threads()
    try:
        got = handoff_compare(1, 1000)
    finally:
        torch.set_num_threads(threads)
    column = 1000 * 4                      # one float32 column's bytes
    one, four = got["one column"]["bytes_copied"], got["four columns"]["bytes_copied"]
    assert one["hetflow"] == 0                     # one column: a view of Arrow's buffer
    assert four["hetflow"] == 4 * column           # four: the stack, and nothing else
    # Deep RC's path always makes its float32 features and labels (features + 1 columns); what
    # Arrow -> pandas -> NumPy copies besides (up to the frame's columns and the feature
    # matrix again) is the installed pandas/pyarrow's choice: 4 columns on one release, 5
    # on pandas 2.2-2.3 with pyarrow 25-26 (one column). Counted whole columns, in that range.
    for copied, features in ((one["pandas"], 1), (four["pandas"], 4)):
        assert copied % column == 0, copied
        assert (features + 1) * column <= copied <= (2 * features + 1 + features + 1) * column


@hetflow.mpi_app(ranks=1)
def _one_rank_training(comm, raise_inside):
    import torch.distributed as dist

    with ht.process_group() as group:
        if raise_inside:
            raise ValueError("inside the group")
        t = torch.ones(2)
        dist.all_reduce(t)
        return group.size, group.backend, t.tolist(), dist.is_initialized()


def test_debug_runtime_one_rank_group_and_a_raising_body():
    # the debug runtime runs the task in this process: the group must be gone after each
    with hetflow.runtime("debug"):
        with pytest.raises(hetflow.TaskFailed, match="inside the group"):
            _one_rank_training(True).result()
        assert _one_rank_training(False).result() == (1, "gloo", [1.0, 1.0], True)
    assert not torch.distributed.is_initialized()
