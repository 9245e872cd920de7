"""Distributed join == polars on the concatenated input, under real mpiexec -n 1, 2, 3."""
import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import itertools, sys
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
from frame_cases import random_part, same_rows
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
PL_HOW = {"inner": "inner", "left": "left", "right": "right", "outer": "full"}
failures, checked = [], 0

def check(label, left_kw, right_kw, how, on=None, left_on=None, right_on=None, rename=None):
    global checked
    left = frame.from_local(comm, random_part(rank=rank, **left_kw))
    rpart = random_part(rank=rank, **right_kw)
    if rename:
        rpart = rpart.rename_columns([rename.get(c, c) for c in rpart.column_names])
    right = frame.from_local(comm, rpart)
    out = frame.join(left, right, on, how=how, left_on=left_on, right_on=right_on,
                     suffixes=("", "_right"))
    got = out.gather()
    assert out.backend == "cpu"
    if rank == 0:
        L = pa.concat_tables([random_part(rank=r, **left_kw) for r in range(size)])
        R = pa.concat_tables([random_part(rank=r, **right_kw) for r in range(size)])
        if rename:
            R = R.rename_columns([rename.get(c, c) for c in R.column_names])
        exp = pl.from_arrow(L).join(pl.from_arrow(R), on=on, left_on=left_on, right_on=right_on,
                                    how=PL_HOW[how], coalesce=True, suffix="_right").to_arrow()
        problem = same_rows(got, exp)
        if problem:
            failures.append(f"{label} how={how}: {problem}")
        checked += 1

for seed, how in itertools.product(range(4), ["inner", "left", "right", "outer"]):
    kw = dict(seed=seed, key_range=6 + seed * 5, extra=True)
    check(f"int key seed={seed}", dict(kw), dict(kw, seed=seed + 100), how, on="k")
    check(f"string key seed={seed}", dict(kw), dict(kw, seed=seed + 200), how, on="s")
    check(f"multi key seed={seed}", dict(kw), dict(kw, seed=seed + 300), how, on=["k", "s"])
    check(f"large_string+timestamp seed={seed}", dict(kw), dict(kw, seed=seed + 400), how,
          on=["ls", "ts"])
    check(f"bool+float key seed={seed}", dict(kw), dict(kw, seed=seed + 450), how, on=["b", "f"])
    check(f"left_on/right_on seed={seed}", dict(kw), dict(kw, seed=seed + 500), how,
          left_on=["k", "s"], right_on=["rk", "rs"], rename={"k": "rk", "s": "rs"})
    check(f"empty left seed={seed}", dict(kw, empty_ranks=range(size)), dict(kw, seed=seed + 600),
          how, on="k")
    check(f"empty right seed={seed}", dict(kw), dict(kw, seed=seed + 700, empty_ranks=range(size)),
          how, on="k")
    check(f"rank 0 empty, no nulls seed={seed}", dict(kw, empty_ranks=(0,), null_rate=0),
          dict(kw, seed=seed + 800, null_rate=0), how, on="k")
    check(f"int key no nulls (dense kernel) seed={seed}", dict(kw, null_rate=0, rows=50),
          dict(kw, seed=seed + 1000, null_rate=0, rows=40), how, on="k")
    check(f"sparse int key no nulls (sort-merge kernel) seed={seed}",
          dict(kw, null_rate=0, key_range=10**12), dict(kw, null_rate=0, key_range=10**12),
          how, on="k")
    check(f"timestamp key no nulls seed={seed}", dict(kw, null_rate=0),
          dict(kw, seed=seed + 1100, null_rate=0), how, on="ts")
    check(f"heavy duplicates seed={seed}", dict(kw, key_range=2, rows=40),
          dict(kw, seed=seed + 900, key_range=2, rows=30), how, on="k")

mpiutil.report({"failures": failures, "checked": checked})
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_join_matches_polars(ranks):
    run = run_mpi(SCRIPT, ranks, timeout=240)
    reports = run.values(ranks)
    assert "Warning" not in run.stderr, run.stderr
    assert reports[0]["checked"] == 4 * 4 * 13
    assert reports[0]["failures"] == [], "\n".join(reports[0]["failures"][:10])
