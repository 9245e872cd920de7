"""The table operations beyond join/sort/group-by == polars on the concatenated input, under
mpiexec -n 1, 2, 3 (one launch each): rebalance, head/tail/slice, concat, repartition, set
operations and describe; row-wise filter, select, drop, rename, with_columns, cast and
fill_null, row for row in order; to_pandas/to_polars/from_pandas."""
import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import pyarrow as pa
import pyarrow.compute as pc
import polars as pl
from mpi4py import MPI
from hetflow import frame
from frame_cases import random_part, same_rows
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures, checked = [], 0

def fail(label, problem):
    failures.append(f"{label}: {problem}")

def in_order(label, got, exp):
    # the gathered table, row for row and in order, against polars' answer
    global checked
    if rank == 0:
        exp = exp.to_arrow() if isinstance(exp, pl.DataFrame) else exp
        if got.column_names != exp.column_names or got.to_pylist() != exp.to_pylist():
            fail(label, f"got {got.num_rows} rows, expected {exp.num_rows}: "
                        f"{got.to_pylist()[:3]} vs {exp.to_pylist()[:3]}")
        checked += 1

def as_set(label, got, exp):
    global checked
    if rank == 0:
        problem = same_rows(got, exp.to_arrow() if isinstance(exp, pl.DataFrame) else exp)
        if problem:
            fail(label, problem)
        checked += 1

# the cases: random sizes with nulls and string keys; one rank holding most rows (skew);
# empty partitions (the last rank's, or all)
CASES = [dict(seed=1, extra=True),
         dict(seed=2, extra=True, rows=None, empty_ranks=(size - 1,)),
         dict(seed=3, extra=True, key_range=4),
         dict(seed=4, extra=True, empty_ranks=range(size))]

def skewed(r, seed):
    return random_part(seed=seed, rank=r, extra=True, rows=150 if r == 0 else 3, key_range=5)

def case_parts(i, c):
    make = (lambda r: skewed(r, 9)) if i == 2 else (lambda r: random_part(rank=r, **c))
    return make

for i, c in enumerate(CASES):
    make = case_parts(i, c)
    t = frame.from_local(comm, make(rank))
    W = pl.from_arrow(pa.concat_tables([make(r) for r in range(size)]))
    total = W.height
    # rebalance: same rows, same order, equal shares to within one
    b = t.rebalance()
    shares = comm.allgather(b.local_rows)
    if max(shares) - min(shares) > 1 or sum(shares) != total:
        fail(f"rebalance case {i}", f"shares {shares} of {total}")
    in_order(f"rebalance case {i}", b.gather(), W)
    wanted = [total] + [0] * (size - 1) if i % 2 else [0] * (size - 1) + [total]
    b = t.rebalance(rows=wanted)
    if comm.allgather(b.local_rows) != wanted:
        fail(f"rebalance rows= case {i}", comm.allgather(b.local_rows))
    in_order(f"rebalance rows= case {i}", b.gather(), W)
    # head / tail / slice by global position, Python's and polars' semantics
    for n in (0, 3, 17, -4, 10**6):
        in_order(f"head({n}) case {i}", t.head(n).gather(), W.head(n))
        in_order(f"tail({n}) case {i}", t.tail(n).gather(), W.tail(n))
    for a, z in ((2, 19), (-10, None), (None, -3), (7, 2), (None, None), (40, 10**6)):
        exp = pa.Table.from_pylist(W.to_arrow().to_pylist()[a:z], schema=W.to_arrow().schema)
        in_order(f"slice({a}, {z}) case {i}", t.slice(a, z).gather(), exp)
    # concat: the tables one after another, order kept, spread evenly
    other = lambda r: random_part(seed=50 + i, rank=r, extra=True, empty_ranks=(0,))
    u = frame.from_local(comm, other(rank))
    U = pl.from_arrow(pa.concat_tables([other(r) for r in range(size)]))
    cat = frame.concat([t, u, t])
    shares = comm.allgather(cat.local_rows)
    if max(shares) - min(shares) > 1:
        fail(f"concat case {i}", f"shares {shares}")
    in_order(f"concat case {i}", cat.gather(), pl.concat([W, U, W]))
    # repartition(on): every row kept, equal keys on one rank
    rp = t.repartition(["s", "k"])
    mine = set(zip(rp.local.column("s").to_pylist(), rp.local.column("k").to_pylist()))
    everyone = comm.allgather(mine)
    if any(everyone[p] & everyone[q] for p in range(size) for q in range(p + 1, size)):
        fail(f"repartition case {i}", "a key on two ranks")
    as_set(f"repartition case {i}", rp.gather(), W)

    # set operations on whole rows (nulls equal), against polars on the whole tables; the
    # right side shares rows with the left (its first half) and brings its own
    right = lambda r: pa.concat_tables([make((r + 1) % size).slice(0, 10),
                                        random_part(seed=70 + i, rank=r, extra=True, key_range=4)])
    rt = frame.from_local(comm, right(rank))
    R = pl.from_arrow(pa.concat_tables([right(r) for r in range(size)]))
    as_set(f"union case {i}", t.union(rt).gather(), pl.concat([W, R]).unique())
    as_set(f"intersect case {i}", frame.intersect(t, rt).gather(),
           W.unique().join(R, on=W.columns, how="semi", nulls_equal=True))
    as_set(f"difference case {i}", t.difference(rt).gather(),
           W.unique().join(R, on=W.columns, how="anti", nulls_equal=True))
    # describe: every numeric column, exact percentiles (polars' "nearest")
    got = t.describe(percentiles=(0.1, 0.25, 0.5, 0.75, 0.9))
    exp = W.select("k", "f", "v").describe(percentiles=(0.1, 0.25, 0.5, 0.75, 0.9)).to_arrow()
    def close(a, b):
        return (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-9 * max(1, abs(b)))
    same = (got.column_names == exp.column_names
            and got.column(0).to_pylist() == exp.column(0).to_pylist()
            and all(close(a, b) for c in exp.column_names[1:]
                    for a, b in zip(got.column(c).to_pylist(), exp.column(c).to_pylist())))
    if not same:
        fail(f"describe case {i} rank {rank}", f"{got.to_pydict()} vs {exp.to_pydict()}")
    checked += rank == 0

# row-wise operations on each partition and the pandas/polars conversions, in order
# (nulls and string columns in every case; one rank holding most rows; empty partitions)
LOCAL_CASES = [lambda r: random_part(seed=1, rank=r, extra=True),
         lambda r: random_part(seed=2, rank=r, extra=True, rows=120 if r == 0 else 2),
         lambda r: random_part(seed=3, rank=r, extra=True, empty_ranks=(0, size - 1)),
         lambda r: random_part(seed=4, rank=r, extra=True, empty_ranks=range(size))]

for i, make in enumerate(LOCAL_CASES):
    t = frame.from_local(comm, make(rank))
    W = pl.from_arrow(pa.concat_tables([make(r) for r in range(size)]))
    in_order(f"filter case {i}", t.filter(pc.field("k") > 5).gather(), W.filter(pl.col("k") > 5))
    in_order(f"filter kleene case {i}",
             frame.filter(t, (pc.field("s") == "a") | pc.field("b")).gather(),
             W.filter((pl.col("s") == "a") | pl.col("b")))
    in_order(f"select case {i}", t.select(["s", "k"]).gather(), W.select("s", "k"))
    in_order(f"drop case {i}", t.drop(["f", "ts"]).gather(), W.drop("f", "ts"))
    in_order(f"rename case {i}", t.rename({"k": "key", "s": "name"}).gather(),
             W.rename({"k": "key", "s": "name"}))
    got = t.with_columns(k2=pc.field("k") * 2, v=pc.field("v") + 1, one=7,
                         n=lambda local: pc.utf8_length(local.column("s"))).gather()
    in_order(f"with_columns case {i}", got, W.with_columns(
        (pl.col("k") * 2).alias("k2"), (pl.col("v") + 1).alias("v"), pl.lit(7).alias("one"),
        pl.col("s").str.len_chars().alias("n")))
    in_order(f"cast case {i}", t.cast({"k": pa.float64(), "v": pa.int32()}).gather(),
             W.with_columns(pl.col("k").cast(pl.Float64), pl.col("v").cast(pl.Int32)))
    for value in (0, 1.5, "x", True):
        in_order(f"fill_null({value!r}) case {i}", t.fill_null(value).gather(), W.fill_null(value))
    in_order(f"fill_null columns= case {i}",
             t.fill_null(columns={"k": -1, "s": "?"}).gather(),
             W.with_columns(pl.col("k").fill_null(-1), pl.col("s").fill_null("?")))
    # conversions: to_pandas/to_polars of the gathered table, from_pandas of each partition
    pdf, pldf = t.to_pandas(), frame.to_polars(t, root=size - 1)
    if (pdf is not None) != (rank == 0) or (pldf is not None) != (rank == size - 1):
        failures.append(f"conversions case {i}: rank {rank} got {pdf is not None}, {pldf is not None}")
    if rank == size - 1 and not pldf.equals(W):
        failures.append(f"to_polars case {i}")
    if rank == 0 and not pdf.equals(W.to_arrow().to_pandas()):
        failures.append(f"to_pandas case {i}")
    back = frame.from_pandas(comm, t.local.to_pandas(), schema=t.schema)
    in_order(f"from_pandas case {i}", back.gather(), W)

mpiutil.report({"failures": failures, "checked": checked})
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_table_operations_match_polars(ranks):
    run = run_mpi(SCRIPT, ranks, timeout=240)
    reports = run.values(ranks)
    assert "Warning" not in run.stderr, run.stderr
    for r in reports:   # describe is checked on every rank (each holds the whole summary)
        assert r["failures"] == [], "\n".join(r["failures"][:10])
    assert reports[0]["checked"] == 4 * (2 + 10 + 6 + 1 + 1 + 3 + 1) + 4 * 13
