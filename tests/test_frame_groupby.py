"""groupby(...).agg(...) under mpiexec -n 1, 2, 3: every aggregation equal to polars on the
concatenated input, over string, integer, float, temporal and boolean keys with nulls, a heavy
key, and an empty partition; every way of distributing (Arrow's partials, the kernels'
partials and merge of the combining ones, shuffled values)."""
import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import math
import numpy as np
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
from hetflow.frame import Agg
from frame_cases import random_part
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures, checked = [], 0


def part(r, seed, skew, empty):
    t = random_part(seed, r, extra=True, key_range=6, empty_ranks=empty)
    n = t.num_rows
    rng = np.random.default_rng([seed, r, 7])
    # a float key with -0.0 beside 0.0, NaN and nulls; a heavy integer key on demand
    fk = np.round(rng.normal(size=n))
    fk[rng.random(n) < 0.1] = np.nan
    t = t.append_column("fk", pa.array(fk, pa.float64(), mask=rng.random(n) < 0.1))
    if skew:
        k = np.where(rng.random(n) < 0.9, 0, rng.integers(0, 50, n))
        t = t.set_column(0, "k", pa.array(k, pa.int64(), mask=rng.random(n) < 0.05))
    return t


def whole(seed, skew, empty):
    return pl.from_arrow(pa.concat_tables([part(r, seed, skew, empty) for r in range(size)]))


def canonical(table):
    # floats to 9 significant digits (summation order differs between engines), NaN as a
    # word (NaN != NaN would fail any comparison of rows), lists as lists
    def fix(v):
        if isinstance(v, float):
            return "NaN" if math.isnan(v) else float(f"{v + 0.0:.9g}")   # -0.0 is 0.0
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v
    return sorted((tuple(fix(v) for v in row.values()) for row in table.to_pylist()), key=repr)


def expected(W, by, spec):
    exprs = []
    for col, funcs in spec.items():
        for f in funcs:
            name = f if isinstance(f, str) else f.name
            x = pl.col(col)
            e = {"sum": lambda: pl.when(x.count() > 0).then(x.sum()),
                 "count": x.count, "mean": x.mean, "min": x.min, "max": x.max, "size": pl.len,
                 "first": x.first, "last": x.last, "median": x.median, "nunique": x.n_unique,
                 "var": lambda: x.var(ddof=1 if isinstance(f, str) else f.ddof),
                 "std": lambda: x.std(ddof=1 if isinstance(f, str) else f.ddof),
                 "quantile": lambda: x.quantile(f.q, interpolation=f.interpolation or "nearest"),
                 "nlargest": lambda: x.drop_nulls().top_k(f.n).sort(descending=True),
                 "nsmallest": lambda: x.drop_nulls().bottom_k(f.n).sort()}[name]()
            label = f if isinstance(f, str) else Agg(**{k: v for k, v in vars(f).items()
                                                         if v is not None}).label
            exprs.append(e.alias(f"{col}_{label}"))
    return W.group_by(by).agg(exprs).to_arrow()


COMBINING = {"v": ["sum", "count", "mean", "min", "max", "size", "first", "last", "var",
                   Agg("std", ddof=0), Agg("nlargest", n=3), Agg("nsmallest", n=2)],
             "f": ["sum", "mean", "first", "last", "std", "count"],
             "s": ["min", "max", "first", "last", "count"],
             "ts": ["min", "last", Agg("nlargest", n=2)]}
EVERYTHING = {"v": ["median", Agg("quantile", q=0.3), "sum", "var", "first"],
              "f": ["median", Agg("quantile", q=0.75, interpolation="linear"),
                    Agg("quantile", q=0.5, interpolation="lower"),
                    Agg("quantile", q=0.5, interpolation="higher"),
                    Agg("quantile", q=0.1, interpolation="midpoint"), "nunique", "mean",
                    Agg("nlargest", n=2)],
              "s": ["nunique", "last"], "ts": ["nunique", "first"], "b": ["nunique", "count"]}
# Arrow's own hash aggregation by the keys, partials and merge
ARROW = {"v": ["sum", "count", "mean", "min", "max", "size"], "f": ["sum", "mean", "max"],
         "s": ["min", "max", "count"], "ts": ["min", "max"], "b": "count"}
# every column numeric
CODES = {"v": ["sum", "count", "mean", "min", "max", "size"],
         "f": ["sum", "mean", "count", "min", "max"]}
KEYS = [["s"], ["k"], ["fk"], ["ts"], ["b"], ["s", "b"], ["k", "ts", "fk"]]

cases = [dict(seed=0, skew=False, empty=()), dict(seed=1, skew=True, empty=(1,)),
         dict(seed=2, skew=False, empty=tuple(range(size)))]
for case in cases:
    t = frame.from_local(comm, part(rank, **case))
    W = whole(**case) if rank == 0 else None
    for by in KEYS if case["empty"] != tuple(range(size)) else KEYS[:2]:
        for label, spec in (("arrow", ARROW), ("codes", CODES), ("combining", COMBINING),
                            ("everything", EVERYTHING)):
            spec = {c: [fs] if isinstance(fs, str) else fs for c, fs in spec.items()
                    if c not in by}
            got = t.groupby(by).agg(spec)
            g = got.gather()
            if rank == 0:
                checked += 1
                e = expected(W, by, spec)
                if g.column_names != e.column_names:
                    failures.append(f"{case} {by} {label}: columns {g.column_names} != "
                                    f"{e.column_names}")
                    continue
                a, b = canonical(g), canonical(e)
                if a != b:
                    failures.append(f"{case} {by} {label}: {len(a)} rows, expected {len(b)}; "
                                    f"unexpected {[r for r in a if r not in b][:2]}, missing "
                                    f"{[r for r in b if r not in a][:2]}")
            if got.backend != ("cpu" if size == 1 else frame._backend.resolve(None)):
                failures.append(f"backend {got.backend}")
mpiutil.report({"failures": failures, "checked": checked})
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_aggregation_matches_polars(ranks):
    reports = run_mpi(SCRIPT, ranks, timeout=300).values(ranks)
    for r in reports:
        assert r["failures"] == [], "\n".join(r["failures"][:6])
    assert reports[0]["checked"] == (7 + 7 + 2) * 4


BIG_MEAN = r"""
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
import mpiutil

comm = MPI.COMM_WORLD
# group 1's int64 sum (2**63 - 7) is beyond float64's exact integers, on rank 0 only
rows = {"k": [1, 1, 2], "v": [2**62, 2**62 - 7, 5]} if comm.Get_rank() == 0 else {"k": [2], "v": [7]}
local = pa.table({"k": pa.array(rows["k"], pa.int64()), "v": pa.array(rows["v"], pa.int64())})
out = frame.groupby(frame.DistributedTable(comm, local), "k").agg({"v": ["mean", "sum"]})
whole = frame.gather(out)
every = pa.concat_tables(comm.allgather(local))
expected = pl.from_arrow(every).group_by("k").agg(pl.col("v").mean().alias("v_mean"),
                                                  pl.col("v").sum().alias("v_sum")).sort("k")
mpiutil.report(None if whole is None else
               (whole.sort_by("k").to_pydict(), expected.to_dict(as_series=False)))
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_integer_mean_of_a_sum_beyond_2_53_is_a_float(ranks):
    # The exact int64 partial sum is cast to float64 for the mean: a checked cast raised an
    # untyped ArrowInvalid on the ranks holding such a group (the others waited).
    got, expected = run_mpi(BIG_MEAN, ranks, timeout=120).values(ranks)[0]
    assert got["k"] == expected["k"] and got["v_sum"] == expected["v_sum"]
    assert got["v_mean"] == pytest.approx(expected["v_mean"], rel=1e-15)


MANY_GROUPS = r"""
import numpy as np
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
from hetflow.frame import Agg, _groupby
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
n = 4 * _groupby.SAMPLE_ROWS + 1000


def part(r, groups):
    rng = np.random.default_rng([5, r])
    k = rng.integers(0, groups, n)
    return pa.table({"k": pa.array(k, pa.int64(), mask=rng.random(n) < 0.01),
                     "s": pa.array([f"s{x % 7}" for x in k], mask=rng.random(n) < 0.01),
                     "v": pa.array(rng.integers(-1000, 1000, n), pa.int64(),
                                   mask=rng.random(n) < 0.05),
                     "f": pa.array(rng.normal(size=n))})


spec = {"v": ["sum", "count", "mean", "min", "max", "first", "last", Agg("std", ddof=0),
              Agg("nlargest", n=2)], "f": ["sum", "mean", "size"]}
x, v, f = pl.col("x"), pl.col("v"), pl.col("f")
exprs = [pl.when(v.count() > 0).then(v.sum()).alias("v_sum"), v.count().alias("v_count"),
         v.mean().alias("v_mean"), v.min().alias("v_min"), v.max().alias("v_max"),
         v.first().alias("v_first"), v.last().alias("v_last"), v.std(ddof=0).alias("v_std_ddof0"),
         v.drop_nulls().top_k(2).sort(descending=True).alias("v_nlargest_2"),
         f.sum().alias("f_sum"), f.mean().alias("f_mean"), pl.len().alias("f_size")]
out = {}
for groups in (10**12, 1000):   # about one group a row; then 1000 groups (x 7 strings)
    local = part(rank, groups)
    t = frame.from_local(comm, local)
    routed = _groupby._few_repeats(comm, local, ["k", "s"])
    got = t.groupby(["k", "s"]).agg(spec).gather()
    if rank == 0:
        every = pl.from_arrow(pa.concat_tables([part(r, groups) for r in range(size)]))
        want = every.group_by(["k", "s"]).agg(exprs).sort(["k", "s"], nulls_last=True)
        got = pl.from_arrow(got).sort(["k", "s"], nulls_last=True)
        floats = ["v_mean", "v_std_ddof0", "f_sum", "f_mean"]
        exact = got.drop(floats).equals(want.select(got.columns).drop(floats))
        close = all(((got[c] - want[c]).abs() <= 1e-9 * (1 + want[c].abs())).fill_null(
            got[c].is_null() == want[c].is_null()).all() for c in floats)
        out[str(groups)] = [routed, got.height, want.height, exact, close]
mpiutil.report(out if rank == 0 else None)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_about_one_group_a_row_shuffles_the_rows_once(ranks):
    # About one group a row: the rows are shuffled and aggregated once (no partial rows that
    # keep them all); 1000 x 7 groups: partial rows, merged. Both equal to polars.
    got = run_mpi(MANY_GROUPS, ranks, timeout=300).values(ranks)[0]
    unique_rows, few = got[str(10**12)], got["1000"]
    assert unique_rows[0] is True and few[0] is False
    for _, rows, expected_rows, exact, close in (unique_rows, few):
        assert rows == expected_rows and exact and close


NARROW_SUMS = r"""
import numpy as np
import pyarrow as pa
from mpi4py import MPI
from hetflow import frame
import mpiutil

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
# int32/uint32/int16 sums beyond their own type (summed at 64 bits), and small ones (summed in
# their own type, then widened): exact either way
big = {"i32": (pa.int32(), [2**31 - 1, 2**31 - 2, -5]), "u32": (pa.uint32(), [2**32 - 1, 7, 9]),
       "i16": (pa.int16(), [-2**15, -2**15, 3]), "small": (pa.int32(), [1, 2, 3])}
local = pa.table({"k": pa.array([0, 0, 1], pa.int64()),
                  **{name: pa.array(v, t) for name, (t, v) in big.items()}})
out = frame.from_local(comm, local).groupby("k").agg({c: ["sum", "mean"] for c in big}).gather()
every = pa.concat_tables(comm.allgather(local)).to_pydict()
want = {}
for name in big:
    for key in (0, 1):
        vals = [v for k, v in zip(every["k"], every[name]) if k == key]
        want[(name, key)] = (sum(vals), sum(vals) / len(vals))
got = None if out is None else {(name, k): (s, m) for name in big for k, s, m in zip(
    out.column("k").to_pylist(), out.column(f"{name}_sum").to_pylist(),
    out.column(f"{name}_mean").to_pylist())}
mpiutil.report(None if out is None else (sorted(got.items()), sorted(want.items()),
                                         str(out.schema.field("i32_sum").type)))
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_narrow_integer_sums_are_exact_beyond_their_type(ranks):
    got, want, sum_type = run_mpi(NARROW_SUMS, ranks, timeout=120).values(ranks)[0]
    assert sum_type == "int64"
    for (key, (s, m)), (key2, (ws, wm)) in zip(got, want):
        assert key == key2 and s == ws and m == pytest.approx(wm, rel=1e-15)

