"""An error raised on some ranks after data has moved fails every rank with the same
PartitionFailed, and no rank is left waiting (hetflow.frame._agreement)."""
import pytest

from mpiutil import run_mpi

# A rank's own work fails by a fault injected into the kernel the operation runs on the rows
# it received (the exchange before it is real); the other ranks' kernels run as they are.
SCRIPT = r"""
import pickle
import pyarrow as pa
from mpi4py import MPI
from hetflow import frame
from hetflow.frame import (_aggregate, _engine, _intmatch, _localjoin, _localsort, _prepare,
                           _strmatch)
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
table = frame.from_local(comm, pa.table({"k": pa.array([i % 7 for i in range(50)], pa.int64()),
                                         "v": pa.array([float(rank * 50 + i) for i in range(50)])}))


def failing(module, name, ranks, after=0):
    # module.name raising on ranks from its call after + 1 on
    real = getattr(module, name)
    calls = [0]

    def fault(*args, **kwargs):
        calls[0] += 1
        if rank in ranks and calls[0] > after:
            raise MemoryError(f"injected into {name} on rank {rank}")
        return real(*args, **kwargs)
    setattr(module, name, fault)
    return lambda: setattr(module, name, real)


outcomes = {}


def case(label, module, name, ranks, fn, after=0):
    restore = failing(module, name, ranks, after)
    try:
        fn()
        outcomes[label] = {"kind": "ok"}
    except Exception as exc:
        cause = exc.__cause__
        outcomes[label] = {"kind": type(exc).__name__, "message": str(exc),
                           "ranks": getattr(exc, "ranks", None),
                           "errors": getattr(exc, "errors", None),
                           "cause": type(cause).__name__ if cause is not None else None,
                           "pickled": type(pickle.loads(pickle.dumps(exc))).__name__,
                           "traceback": getattr(exc, "remote_tracebacks", {})}
    finally:
        restore()
    # a rank that raised alone would meet the others' next collective here (or never)
    comm.Barrier()


last, middle = {size - 1}, {1}
case("groupby sum: finishing fails on the last rank", _aggregate, "finish", last,
     lambda: table.groupby("k").agg({"v": "sum"}).local.num_rows)
case("groupby median: aggregating fails on rank 1", _aggregate, "finish", middle,
     lambda: table.groupby("k").agg({"v": "median"}).local.num_rows)
case("groupby mean: finishing fails on every other rank", _aggregate, "finish",
     set(range(0, size, 2)), lambda: table.groupby("k").agg({"v": "mean"}).local.num_rows)
# joins: the streamed integer-key match, the string key's match by hash, the general local
# join (two keys), the broadcast join's local join (a right side of one row per rank)
words = frame.from_local(comm, table.local.append_column(
    "s", pa.array([f"w{i % 5}" for i in range(50)])))
tiny = frame.from_local(comm, pa.table({"k": pa.array([rank], pa.int64()), "w": [1.5]}))
case("join: matching fails on the last rank", _intmatch, "match", last,
     lambda: table.join(table, on="k").local.num_rows)
case("join: matching by hash fails on rank 1", _strmatch, "match_by_hash", middle,
     lambda: words.join(words, on="s").local.num_rows)
case("join: the local join fails on the last rank", _localjoin, "join", last,
     lambda: table.join(table, on=["k", "v"]).local.num_rows)
case("join: the broadcast join fails on rank 1", _localjoin, "join", middle,
     lambda: table.join(tiny, on="k").local.num_rows)
# the streamed joins' output: the key column's take is call 1, then each payload column is
# exchanged when the output gathers it (no batching: BATCH_BYTES -1) and taken; a rank fails
# after a payload column moved, while the other ranks go on to the next column's exchange,
# which the failed rank still serves
_prepare.BATCH_BYTES, batch_bytes = -1, _prepare.BATCH_BYTES
wide = frame.from_local(comm, table.local.append_column("u", pa.array(range(50), pa.int32()))
                        .append_column("s", words.local.column("s")))
case("join: the output's second column fails on the last rank", _localjoin, "take", last,
     lambda: wide.join(wide, on="k").local.num_rows, after=2)
case("join: the string key's output fails on rank 1", _localjoin, "take", middle,
     lambda: wide.join(wide, on="s").local.num_rows, after=1)
_prepare.BATCH_BYTES = batch_bytes
case("sort: the local sort fails on the last rank", _localsort, "sort_order", last,
     lambda: table.sort("v").local.num_rows)
case("unique: first rows fail on rank 1", _engine, "first_rows", middle,
     lambda: table.unique("k").local.num_rows)
case("intersect: first rows fail on the last rank", _engine, "first_rows", last,
     lambda: table.intersect(table).local.num_rows)
# one rank has no peer to wait for, yet raises the same type as with more
from hetflow.frame import _agreement
try:
    with _agreement.step(MPI.COMM_SELF, "step"):
        raise ValueError("bad")
except Exception as exc:
    outcomes["alone"] = {"kind": type(exc).__name__, "message": str(exc),
                         "cause": type(exc.__cause__).__name__}
# afterwards the communicator still works: every rank meets the next operation's collectives
sums = table.groupby("k").agg({"v": "sum"}).gather()
mpiutil.report({"outcomes": outcomes,
                "sums": None if sums is None else dict(zip(sums.column("k").to_pylist(),
                                                           sums.column("v_sum").to_pylist()))})
"""


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.timeout(240)
def test_error_after_data_moved_fails_every_rank(ranks):
    reports = run_mpi(SCRIPT, ranks, timeout=150).values(ranks)
    last = [ranks - 1]
    failing = {"groupby sum: finishing fails on the last rank": ("finish", last),
               "groupby median: aggregating fails on rank 1": ("finish", [1]),
               "groupby mean: finishing fails on every other rank": ("finish",
                                                                     list(range(0, ranks, 2))),
               "join: matching fails on the last rank": ("match", last),
               "join: matching by hash fails on rank 1": ("match_by_hash", [1]),
               "join: the local join fails on the last rank": ("join", last),
               "join: the broadcast join fails on rank 1": ("join", [1]),
               "join: the output's second column fails on the last rank": ("take", last),
               "join: the string key's output fails on rank 1": ("take", [1]),
               "sort: the local sort fails on the last rank": ("sort_order", last),
               "unique: first rows fail on rank 1": ("first_rows", [1]),
               "intersect: first rows fail on the last rank": ("first_rows", last)}
    for label, (kernel, bad) in failing.items():
        seen = [r["outcomes"][label] for r in reports]
        assert all(o["kind"] == "PartitionFailed" for o in seen), (label, seen)
        assert len({o["message"] for o in seen}) == 1, (label, seen)
        for rank, o in enumerate(seen):
            assert o["ranks"] == tuple(bad)
            assert sorted(o["errors"]) == bad
            assert all(f"injected into {kernel} on rank {r}" in o["errors"][r] for r in bad)
            assert all("MemoryError" in o["traceback"][r] for r in bad)
            # the original is chained where it was raised
            assert o["cause"] == ("MemoryError" if rank in bad else None)
            assert o["pickled"] == "PartitionFailed"
        message = seen[0]["message"]
        assert message.startswith(label.split(":")[0].split()[0] + ": ") and f"of {ranks}" in message
        assert all(f"rank {r}: MemoryError" in message for r in bad)
    for r in reports:
        assert r["outcomes"]["alone"] == {
            "kind": "PartitionFailed", "cause": "ValueError",
            "message": "step failed on rank 0 of 1 after the data moved (rank 0: ValueError: "
                       "bad); every rank of the operation raises this error"}
    # the sums of 0..50*ranks-1 by value mod 50 mod 7, on rank 0
    want = {}
    for r in range(ranks):
        for i in range(50):
            want[i % 7] = want.get(i % 7, 0.0) + float(r * 50 + i)
    assert reports[0]["sums"] == want

