"""Bad input raises the same typed error on every rank, and no rank is left in a collective."""
import importlib.util

import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import os, sys
import pyarrow as pa
from mpi4py import MPI
from hetflow import frame, errors
import mpiutil

import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("hetflow.frame").addHandler(Keep())
logging.getLogger("hetflow.frame").setLevel(logging.INFO)
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
outcomes = {}

def case(name, fn):
    try:
        fn()
        outcomes[name] = ("ok", "")
    except errors.HetflowError as exc:
        outcomes[name] = (type(exc).__name__, str(exc))
    comm.Barrier()  # a rank still inside a collective would hang here (the test times out)

good = frame.from_local(comm, pa.table({"k": pa.array([rank, 1], pa.int64()), "v": [1.0, 2.0]}))
other = frame.from_local(comm, pa.table({"k": pa.array([1], pa.int32()), "w": [3]}))
# rank 1 (only) has a column the others lack
odd = frame.from_local(comm, pa.table({"k": [rank], "x" if rank == 1 else "v": [1]}))
# every rank but 0 typed its key differently (e.g. an empty partition built without a schema)
mixed = frame.from_local(comm, pa.table({"k": pa.array([], pa.int64() if rank == 0 else pa.null())}))

case("join unknown key", lambda: frame.join(good, good, on="nope"))
case("join unknown right key", lambda: frame.join(good, good, left_on="k", right_on="nope"))
case("join key types differ", lambda: frame.join(good, other, on="k"))
case("join bad how", lambda: frame.join(good, good, on="k", how="cross"))
case("join schemas differ across ranks", lambda: frame.join(odd, good, on="k"))
case("sort unknown key", lambda: frame.sort(good, ["k", "nope"]))
case("sort schemas differ across ranks", lambda: frame.sort(odd, "k"))
case("sort empty partitions typed differently", lambda: frame.sort(mixed, "k"))
case("sort bad ascending", lambda: frame.sort(good, ["k", "v"], ascending=[True]))
case("shuffle unknown key", lambda: frame.shuffle(good, "nope"))
case("groupby unknown key", lambda: good.groupby("nope").agg({"v": "sum"}))
case("groupby unknown agg", lambda: good.groupby("k").agg({"v": "mode"}))
case("groupby unknown value column", lambda: good.groupby("k").agg({"nope": "sum"}))
words = frame.from_local(comm, pa.table({"k": [rank], "s": ["x"]}))
case("groupby median of strings", lambda: words.groupby("k").agg({"s": ["count", "median"]}))
case("groupby quantile without q", lambda: good.groupby("k").agg({"v": "quantile"}))
case("unique schemas differ", lambda: frame.unique(odd))
case("gather schemas differ", lambda: odd.gather())
case("read_parquet missing on one rank", lambda: frame.read_parquet(
    comm, sys.argv[1] if rank == 0 else os.path.join(sys.argv[1], "missing.parquet")))
case("force cupy without GPU", lambda: frame.sort(good, "k", backend="cupy"))
case("force pycylon without pycylon", lambda: frame.join(good, good, on="k", backend="pycylon"))
case("unknown backend", lambda: frame.sort(good, "k", backend="tpu"))
# the row-level and row-wise operations (before any data moves; a value failing on one rank
# only fails every rank)
import pyarrow.compute as pc
nested = frame.from_local(comm, pa.table({"k": [rank], "l": pa.array([[1]], pa.list_(pa.int64()))}))
text = frame.from_local(comm, pa.table({"k": pa.array([rank], pa.int64()), "s": ["x"]}))
last_overflows = frame.from_local(comm, pa.table({"k": [1000 if rank == size - 1 else 1]}))
case("head bad n", lambda: good.head("3"))
case("slice bad start", lambda: good.slice(1.5, 3))
case("rebalance rows per rank", lambda: good.rebalance([1]))
case("rebalance rows sum", lambda: good.rebalance([5] * size))
case("concat schemas differ", lambda: frame.concat([good, other]))
case("concat not a list", lambda: frame.concat(good))
case("union schemas differ", lambda: good.union(other))
case("union schemas differ across ranks", lambda: odd.union(odd))
case("intersect nested column", lambda: nested.intersect(nested))
case("describe unknown column", lambda: good.describe("nope"))
case("describe string column", lambda: text.describe(["k", "s"]))
case("describe bad percentile", lambda: good.describe(percentiles=[2]))
case("filter unknown column", lambda: good.filter(pc.field("nope") > 1))
case("filter not boolean", lambda: good.filter(pc.field("v") + 1))
case("filter not an expression", lambda: good.filter("v > 1"))
case("select unknown column", lambda: good.select(["k", "nope"]))
case("drop unknown column", lambda: good.drop("nope"))
case("rename collides", lambda: good.rename({"k": "v"}))
case("with_columns wrong length", lambda: good.with_columns(n=lambda local: pa.array([1, 2, 3])))
case("with_columns function fails on the last rank", lambda: good.with_columns(
    n=lambda local: pa.array([1 / (size - 1 - rank)] * local.num_rows)))
case("cast unsupported", lambda: good.cast({"v": pa.list_(pa.int64())}))
case("cast overflows on the last rank", lambda: last_overflows.cast({"k": pa.int8()}))
case("fill_null no value", lambda: good.fill_null())
# afterwards the communicator is still healthy
joined = frame.join(good, good, on="k")
ok = joined.num_rows()
mpiutil.report({"outcomes": outcomes, "rows": ok, "log": records, "backend": joined.backend})
"""

EXPECTED = {
    "join unknown key": "KeyColumnError",
    "join unknown right key": "KeyColumnError",
    "join key types differ": "SchemaMismatch",
    "join bad how": "ConfigError",
    "join schemas differ across ranks": "SchemaMismatch",
    "sort unknown key": "KeyColumnError",
    "sort schemas differ across ranks": "SchemaMismatch",
    "sort empty partitions typed differently": "SchemaMismatch",
    "sort bad ascending": "ConfigError",
    "shuffle unknown key": "KeyColumnError",
    "groupby unknown key": "KeyColumnError",
    "groupby unknown agg": "ConfigError",
    "groupby unknown value column": "KeyColumnError",
    "groupby median of strings": "InputError",
    "groupby quantile without q": "ConfigError",
    "unique schemas differ": "SchemaMismatch",
    "gather schemas differ": "SchemaMismatch",
    "read_parquet missing on one rank": "InputError",
    "force cupy without GPU": "BackendUnavailable",
    "force pycylon without pycylon": "BackendUnavailable",
    "unknown backend": "ConfigError",
    "head bad n": "ConfigError",
    "slice bad start": "ConfigError",
    "rebalance rows per rank": "ConfigError",
    "rebalance rows sum": "ConfigError",
    "concat schemas differ": "SchemaMismatch",
    "concat not a list": "ConfigError",
    "union schemas differ": "SchemaMismatch",
    "union schemas differ across ranks": "SchemaMismatch",
    "intersect nested column": "NotSupported",
    "describe unknown column": "KeyColumnError",
    "describe string column": "NotSupported",
    "describe bad percentile": "ConfigError",
    "filter unknown column": "KeyColumnError",
    "filter not boolean": "InputError",
    "filter not an expression": "ConfigError",
    "select unknown column": "KeyColumnError",
    "drop unknown column": "KeyColumnError",
    "rename collides": "InputError",
    "with_columns wrong length": "InputError",
    "with_columns function fails on the last rank": "InputError",
    "cast unsupported": "NotSupported",
    "cast overflows on the last rank": "InputError",
    "fill_null no value": "ConfigError",
}
if importlib.util.find_spec("pycylon") is not None:
    # in an environment with pycylon (docs/engine.md) the forced pycylon join runs
    EXPECTED["force pycylon without pycylon"] = "ok"
SINGLE_RANK_OK = {"join schemas differ across ranks", "sort schemas differ across ranks",
                  "sort empty partitions typed differently", "unique schemas differ",
                  "gather schemas differ", "read_parquet missing on one rank",
                  "union schemas differ across ranks"}


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_bad_input_raises_same_error_everywhere(ranks, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"k": [1]}), tmp_path / "ok.parquet")
    reports = run_mpi(SCRIPT, ranks, timeout=180, args=[tmp_path]).values(ranks)
    for name, want in EXPECTED.items():
        got = {r["outcomes"][name] for r in reports}
        assert len(got) == 1, f"{name}: ranks disagree: {got}"
        kind, message = got.pop()
        if ranks == 1 and name in SINGLE_RANK_OK:
            continue  # one rank cannot disagree with itself
        assert kind == want, f"{name}: {kind}: {message}"
        assert message or want == "ok"
    r0 = reports[0]["outcomes"]
    assert "'nope'" in r0["join unknown key"][1] and "left" in r0["join unknown key"][1]
    assert "int64" in r0["join key types differ"][1] and "int32" in r0["join key types differ"][1]
    assert "cupy" in r0["force cupy without GPU"][1]
    assert "'nope'" in r0["select unknown column"][1] and "'nope'" in r0["describe unknown column"][1]
    assert "nope" in r0["filter unknown column"][1]
    assert "'s' (string)" in r0["describe string column"][1]
    assert "1000" in r0["cast overflows on the last rank"][1] or "overflow" in r0[
        "cast overflows on the last rank"][1].lower()
    assert "median" in r0["groupby median of strings"][1] and "'s'" in r0[
        "groupby median of strings"][1]
    if ranks > 1:
        assert "rank 1" in r0["join schemas differ across ranks"][1]
        assert "missing.parquet" in r0["read_parquet missing on one rank"][1]
        assert f"rank {ranks - 1}" in r0["cast overflows on the last rank"][1]
        assert "ZeroDivisionError" in r0["with_columns function fails on the last rank"][1]
    assert all(r["rows"] == reports[0]["rows"] > 0 for r in reports)
    # without cupy/GPU the CPU path ran, and says so (log line + attribute)
    for r in reports:
        assert r["backend"] == "cpu"
        assert any("CPU (NumPy/Arrow)" in line and "cupy" in line for line in r["log"]), r["log"]
