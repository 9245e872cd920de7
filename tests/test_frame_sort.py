"""Distributed sort == polars' stable sort of the concatenated input (mpiexec -n 1, 2, 3)."""
import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import math
import sys
import numpy as np
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
from frame_cases import random_part
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures, checked, balance = [], 0, []
MODE = sys.argv[1]
if MODE != "batched":
    # the path of partitions above BATCH_BYTES (one column at a time, integer keys narrowed
    # to 32 bits), on these small cases; "searched": a splitter search as beyond 9 ranks;
    # "mixed": rank 0's partitions count as large, the others' as small (ranks whose
    # partitions lie on both sides of the bound must still take one path together)
    from hetflow.frame import _exchange, _prepare, _sort
    if MODE != "mixed" or rank == 0:
        _prepare.BATCH_BYTES = -1
    if MODE == "searched":
        _exchange._SCAN_PARTS = 0
    if MODE in ("searched", "mixed"):
        # as many splitter samples as a rank has rows (every rank alike: the samples' gather
        # has one size everywhere), ordered by the radix argsort as large sample sets are
        _sort.ROWS_PER_SAMPLE, _sort.RADIX_SAMPLES = 1, 0
EVERY_ROW_SAMPLED = MODE in ("searched", "mixed")

def check(label, make, by, ascending=True, balance_bound=None):
    global checked
    part = make(rank)
    out = frame.sort(frame.from_local(comm, part), by, ascending)
    rows = comm.allgather(out.local_rows)
    got = out.gather()
    if rank == 0:
        whole = pa.concat_tables([make(r) for r in range(size)])
        names = [by] if isinstance(by, str) else list(by)
        asc = [ascending] * len(names) if isinstance(ascending, bool) else list(ascending)
        exp = pl.from_arrow(whole).sort(names, descending=[not a for a in asc], nulls_last=True,
                                        maintain_order=True).to_arrow()
        if got.to_pylist() != exp.to_pylist():
            g, e = got.to_pylist(), exp.to_pylist()
            first = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
            failures.append(f"{label}: differs from polars at row {first} of {len(e)}: "
                            f"got {g[first:first + 2]}, expected {e[first:first + 2]}")
        if out.backend != "cpu":
            failures.append(f"{label}: backend {out.backend!r}")
        if balance_bound is not None and max(rows) > balance_bound(sum(rows)):
            failures.append(f"{label}: unbalanced {rows}")
        balance.append((label, rows))
        checked += 1

def ints(seed, n, high, nulls=0.0):
    return lambda r: random_part(seed, r, rows=n, key_range=high, null_rate=nulls)

for seed in range(3):
    # numeric fast path (no nulls), both directions, with duplicates and an empty rank
    check(f"int asc {seed}", ints(seed, 200, 50), "k", True)
    check(f"int desc {seed}", ints(seed, 200, 50), "k", False)
    check(f"float desc {seed}", ints(seed, 150, 50), "f", False)
    check(f"empty rank 0 {seed}", lambda r, s=seed: random_part(s, r, rows=100, null_rate=0,
                                                               empty_ranks=(0,)), "k")
    # general path: nulls, strings, multi-key, mixed directions, temporal, bool
    check(f"int nulls {seed}", ints(seed, 120, 30, 0.2), "k", True)
    check(f"int nulls desc {seed}", ints(seed, 120, 30, 0.2), "k", False)
    check(f"strings {seed}", lambda r, s=seed: random_part(s, r, extra=True), "s")
    check(f"multi mixed {seed}", lambda r, s=seed: random_part(s, r, extra=True),
          ["s", "k", "f"], [False, True, False])
    check(f"large_string+ts {seed}", lambda r, s=seed: random_part(s, r, extra=True),
          ["ls", "ts"], [True, False])
    check(f"bool+int {seed}", lambda r, s=seed: random_part(s, r, extra=True, null_rate=0),
          ["b", "v"], [False, True])
    check(f"timestamp no nulls {seed}",
          lambda r, s=seed: random_part(s, r, extra=True, null_rate=0), "ts", False)

# heavy skew: one key on 90% of the rows must still be spread over the ranks
def skewed(r, n=3000):
    rng = np.random.default_rng([7, r])
    k = np.where(rng.random(n) < 0.9, 42, rng.integers(0, 1000, n))
    return pa.table({"k": k, "v": np.arange(n) + r * n})
bound = lambda total: math.ceil(total / size) + total // (8 * size) + 1
check("heavy skew", skewed, "k", True, balance_bound=bound)
check("single key everywhere", lambda r: pa.table({"k": np.zeros(2000, np.int64),
                                                    "v": np.arange(2000)}), "k",
      balance_bound=bound)
check("skew strings", lambda r: pa.table({"s": ["same"] * 900 + ["x%d" % i for i in range(100)],
                                          "v": np.arange(1000)}), "s", balance_bound=bound)
check("uniform balance", lambda r: random_part(5, r, rows=4000, key_range=10**9, null_rate=0),
      "k", balance_bound=bound)
check("all ranks empty", lambda r: random_part(0, r, empty_ranks=range(size)), "k")
if EVERY_ROW_SAMPLED:
    # every row a sample (the ranks hold as many rows as the average one): the splitters are
    # the exact quantiles (ties placed by origin), no rank holds more than an even share
    exact = lambda total: math.ceil(total / size)
    check("exact balance", lambda r: random_part(6, r, rows=3000, key_range=10**6,
                                                 null_rate=0), "k", balance_bound=exact)
    check("exact balance, heavy skew", skewed, "k", balance_bound=exact)

def extremes(typ, low, high, n=300):
    # key columns of every width, the type's extremes included, rank 1 empty
    def make(r):
        rng = np.random.default_rng([7, r])
        rows = 0 if r == 1 else n
        k = rng.integers(low, high, rows, endpoint=True,
                         dtype=np.uint64 if low >= 0 else np.int64)
        k[:2] = [low, high][:rows]
        return pa.table({"k": pa.array(k, typ), "v": pa.array(np.arange(rows) + 1000 * r)})
    return make

def floats(r):
    rng = np.random.default_rng([8, r])
    f = rng.normal(size=200)
    f[:4] = [np.inf, -np.inf, 1e308, -1e-308]
    return pa.table({"f": f, "v": np.arange(200) + 1000 * r})

for asc in (True, False):
    check(f"int8 extremes asc={asc}", extremes(pa.int8(), -128, 127), "k", asc)
    check(f"int64 extremes asc={asc}", extremes(pa.int64(), -2**63, 2**63 - 1), "k", asc)
    check(f"uint64 beyond int64 asc={asc}", extremes(pa.uint64(), 0, 2**64 - 1), "k", asc)
    check(f"floats with infinities asc={asc}", floats, "f", asc)
    # integer keys whose span is just within, at and beyond 2**32 (narrowed to uint32 or not)
    for span in (2**32 - 1, 2**32):
        check(f"int64 span {span} asc={asc}", extremes(pa.int64(), -2**31 - 7, span - 2**31 - 7),
              "k", asc)
    check(f"int32 asc={asc}", extremes(pa.int32(), -2**31, 2**31 - 1), "k", asc)
    check(f"uint32 asc={asc}", extremes(pa.uint32(), 0, 2**32 - 1), "k", asc)
    check(f"date32 asc={asc}", lambda r: pa.table({
        "d": pa.array(np.random.default_rng([9, r]).integers(-1000, 30000, 250), pa.int32())
               .cast(pa.date32()),
        "v": np.arange(250) + 1000 * r}), "d", asc)
mpiutil.report({"failures": failures, "checked": checked, "balance": balance})
"""


@pytest.mark.parametrize("ranks,mode", [(1, "batched"), (2, "batched"), (3, "batched"),
                                        (2, "streamed"), (3, "streamed"), (3, "searched"),
                                        (2, "mixed")])
def test_sort_matches_polars(ranks, mode):
    run = run_mpi(SCRIPT, ranks, timeout=240, args=[mode])
    reports = run.values(ranks)
    assert "Warning" not in run.stderr, run.stderr
    assert reports[0]["checked"] == 3 * 11 + 5 + 2 * 9 + (2 if mode in ("searched", "mixed") else 0)
    assert reports[0]["failures"] == [], "\n".join(reports[0]["failures"][:10])


def test_larger_partitions_take_more_splitter_samples_within_a_bound():
    from hetflow.frame._sort import _samples_per_rank
    assert _samples_per_rank(2, 200_000) == 1024          # the weak experiment: as before
    assert _samples_per_rank(2, 4_000_000) == 7812        # 2M rows per rank: one per 256
    assert _samples_per_rank(1024, 10**12) == 256         # all samples of all ranks: 2**18
    for size in (2, 3, 64, 256, 4096):
        for rows in (0, 10**5, 10**7, 10**12):
            s = _samples_per_rank(size, rows)
            assert s >= 256 and (s <= 1024 or s * size <= 1 << 18), (size, rows, s)
