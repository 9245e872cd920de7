"""Row-wise operations on the distributed table (filter, select, drop, rename, with_columns,
cast, fill_null) and the pandas/polars conversions == polars on the concatenated input, row for
row and in order, under mpiexec -n 1, 2, 3."""
import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import pyarrow as pa
import pyarrow.compute as pc
import polars as pl
from mpi4py import MPI
from hetflow import frame
from frame_cases import random_part
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures, checked = [], 0

def in_order(label, got, exp):
    global checked
    if rank == 0:
        exp = exp.to_arrow() if isinstance(exp, pl.DataFrame) else exp
        if got.column_names != exp.column_names or got.to_pylist() != exp.to_pylist():
            failures.append(f"{label}: got {got.column_names} {got.to_pylist()[:3]}, expected "
                            f"{exp.column_names} {exp.to_pylist()[:3]}")
        checked += 1

# nulls and string columns in every case; one rank holding most rows; empty partitions
CASES = [lambda r: random_part(seed=1, rank=r, extra=True),
         lambda r: random_part(seed=2, rank=r, extra=True, rows=120 if r == 0 else 2),
         lambda r: random_part(seed=3, rank=r, extra=True, empty_ranks=(0, size - 1)),
         lambda r: random_part(seed=4, rank=r, extra=True, empty_ranks=range(size))]

for i, make in enumerate(CASES):
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
def test_local_operations_match_polars(ranks):
    run = run_mpi(SCRIPT, ranks, timeout=240)
    reports = run.values(ranks)
    assert "Warning" not in run.stderr, run.stderr
    for r in reports:
        assert r["failures"] == [], "\n".join(r["failures"][:10])
    assert reports[0]["checked"] == 4 * 13
