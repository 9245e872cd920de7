"""The compiled local engine (hetflow/frame/_engine.py): its thread count follows the task's
cores per rank, and the group-by kernels on it keep Arrow's result types and SQL's null rule
for every integer width, float32/64, string, large_string, dictionary and binary column, with
and without nulls, at 1 and 2 ranks (values against polars on the concatenated input)."""
import os
import subprocess
import sys

import pytest

from mpiutil import run_mpi

THREADS = r"""
import sys
import pyarrow as pa
from mpi4py import MPI
from hetflow import frame
from hetflow.frame import _engine
import mpiutil
if sys.argv[1] == "table":   # a rank's first table sets its share of the cores
    frame.from_local(MPI.COMM_WORLD, pa.table({"a": [1]}))
mpiutil.report(_engine.polars().thread_pool_size())
"""


def test_polars_threads_follow_the_ranks_cores():
    # a bare mpiexec: OMP_NUM_THREADS (what a runtime sets to cores_per_rank) sizes the pool
    # (POLARS_MAX_THREADS cleared: a frame operation run earlier in this test process sets it,
    # and the ranks would inherit it; seen in a fresh-clone CI run)
    env = {"OMP_NUM_THREADS": "1", "POLARS_MAX_THREADS": ""}
    assert run_mpi(THREADS, 2, args=["omp"], env=env).values(2) == [1, 1]
    # else a rank's first table: its share of the node's cores, as Arrow's pool
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    env = {"OMP_NUM_THREADS": "", "POLARS_MAX_THREADS": ""}
    assert run_mpi(THREADS, 2, args=["table"], env=env).values(2) == [share, share]
    # a runtime's rank: bind_rank_environment sets POLARS_MAX_THREADS before user code runs
    code = ("import os; from hetflow.executors._rank import bind_rank_environment; "
            "bind_rank_environment({'cores_per_rank': 3, 'gpus_per_rank': 0}, 0); "
            "print(os.environ['POLARS_MAX_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"


WIDTHS = r"""
import math
import numpy as np
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def part(r, nulls):
    rng = np.random.default_rng([11, r])
    n = 300
    mask = (lambda: rng.random(n) < 0.2) if nulls else (lambda: None)
    cols = {"k": pa.array(rng.integers(0, 5, n), pa.int64())}
    for t in INTS:
        cols[t] = pa.array(rng.integers(0, 100, n).astype(t), mask=mask())
    for t in ("float32", "float64"):
        cols[t] = pa.array(rng.normal(size=n).astype(t), mask=mask())
    # a group with no value at all: its sum, min and max are null
    cols["int32"] = pa.array(np.where(cols["k"].to_numpy() == 4, 0, rng.integers(0, 9, n))
                             .astype(np.int32), mask=(cols["k"].to_numpy() == 4))
    words = pa.array([["a", "bb", "", "Ü"][i] for i in rng.integers(0, 4, n)], mask=mask())
    cols["string"], cols["large_string"] = words, words.cast(pa.large_string())
    cols["dict"], cols["binary"] = words.dictionary_encode(), words.cast(pa.binary())
    return pa.table(cols)


failures = []
for nulls in (False, True):
    t = frame.from_local(comm, part(rank, nulls))
    whole = pl.from_arrow(pa.concat_tables([part(r, nulls) for r in range(size)]))
    for c in INTS + ["float32", "float64"]:
        got = t.groupby("k").agg({c: ["sum", "min", "max", "mean", "count"]}).gather()
        if rank:
            continue
        wide = "double" if c.startswith("float") else "uint64" if c.startswith("u") else "int64"
        types = [str(f.type) for f in got.schema][1:]
        own = str(part(0, nulls).schema.field(c).type)
        if types != [wide, own, own, "double", "int64"]:
            failures.append(f"{c} nulls={nulls}: types {types}")
        x = pl.col(c).cast(pl.Float64) if c.startswith("float") else pl.col(c)  # float32 sums at 64
        e = whole.group_by("k").agg(pl.when(x.count() > 0).then(x.sum()).alias("s"),
                                    x.min().alias("lo"), x.max().alias("hi"),
                                    x.mean().alias("m"), x.count().alias("n")).sort("k")
        g = got.sort_by("k").to_pydict()
        for (name, col) in zip(["s", "lo", "hi", "m", "n"], got.column_names[1:]):
            a, b = g[col], e[name].to_list()
            if not all((x is None and y is None) or (x is not None and y is not None
                       and math.isclose(x, y, rel_tol=1e-6)) for x, y in zip(a, b)):
                failures.append(f"{c} nulls={nulls} {name}: {a} != {b}")
    for c in ("string", "large_string", "dict", "binary"):
        got = t.groupby(c).agg({"int64": "sum", "k": ["min", "first"]}).gather()
        if rank:
            continue
        if got.schema.field(c).type != part(0, nulls).schema.field(c).type:
            failures.append(f"key {c}: {got.schema.field(c).type}")
        key = whole[c].cast(pl.String) if c == "dict" else whole[c]
        e = whole.with_columns(key).group_by(c).agg(pl.col("int64").sum(), pl.col("k").min())
        a = sorted(zip(got.column(c).cast(pa.binary() if c == "binary" else pa.string())
                       .to_pylist(), got.column("int64_sum").to_pylist()), key=repr)
        b = sorted(zip(e[c].to_list(), e["int64"].to_list()), key=repr)
        if a != b:
            failures.append(f"key {c}: {a} != {b}")
mpiutil.report(failures)
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_groupby_types_and_nulls_every_width(ranks):
    for failures in run_mpi(WIDTHS, ranks, timeout=240).values(ranks):
        assert failures == [], "\n".join(failures[:8])


def test_integer_keys_packed_into_one_code_give_the_same_bits():
    # Several null-free integer keys of a holistic group-by are grouped by one int64 code
    # (_engine.grouped): the same groups and every result to the bit as grouped by the keys
    # themselves, keys read back in their own types; a null key, a range product of 2**62 or
    # more, a uint64 beyond int64 or no holistic aggregation leave the keys as they are.
    import numpy as np
    import polars as pl
    import pyarrow as pa

    from hetflow.frame import _aggregate, _engine

    rng = np.random.default_rng(41)
    n = 50_000
    t = pa.table({"a": pa.array(rng.integers(-50, 50, n).astype(np.int32)),
                  "b": pa.array(rng.integers(-2**40, 2**40, n) % 977 - 2**40, pa.int64()),
                  "u": pa.array(rng.integers(0, 7, n).astype(np.uint8)),
                  "w": pa.array(rng.integers(0, 2**62, n) * 2, pa.int64()),
                  "big": pa.array(rng.integers(0, 3, n).astype(np.uint64) + np.uint64(2**63)),
                  "n": pa.array(rng.integers(0, 5, n), pa.int64(), mask=rng.random(n) < 0.1),
                  "v": rng.random(n), "i": pa.array(rng.integers(0, 9, n).astype(np.int32))})
    spec = {"v": ["median", "std", "sum", "mean", "first", "last", "min"],
            "i": ["sum", "count", "max", "nunique"]}
    packs = []
    real = _engine._key_spans
    seen = lambda keys: packs.append(real(keys) is not None) or real(keys)  # noqa: E731
    _engine._key_spans = seen
    try:
        for by in (["a", "b", "u"], ["a", "u"], ["a", "w"], ["a", "big"], ["a", "n"]):
            planned = _aggregate.plan(spec)
            packed = pl.from_arrow(_aggregate.whole(t, by, planned)).sort(by)
            _engine._key_spans = lambda keys: None
            plain = pl.from_arrow(_aggregate.whole(t, by, planned)).sort(by)
            _engine._key_spans = seen
            assert packed.schema == plain.schema and packed.equals(plain), by
            assert packed.height == t.select(by).group_by(by).aggregate([]).num_rows, by
    finally:
        _engine._key_spans = real
    assert packs == [True, True, False, False, False]
