"""The dense-code group-by kernel (hetflow/frame/_dense.py): the route a many-group string-key
group-by takes, every scatter of one dtype (NumPy's fast path; counted, not timed), and its
results against polars on the concatenated input at 1 and 2 ranks: every integer width,
float32/64, nulls, NaN, -0.0, infinities, a group with no value or only NaN, sums beyond
2**53, null, string, integer and timestamp keys."""
import numpy as np
import pytest

from mpiutil import run_mpi

CASES = r"""
import datetime
import math
import numpy as np
import pyarrow as pa
import polars as pl

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FUNCS = ["sum", "mean", "count", "min", "max", "size"]


def part(r, n=20000, groups=6000):
    rng = np.random.default_rng([43, r])
    mask = lambda: rng.random(n) < 0.1
    k = rng.integers(0, groups, n)
    cols = {"s": pa.array([f"g{x}" for x in k], mask=rng.random(n) < 0.01),
            "k": pa.array(k % 7, pa.int64()),
            "ts": pa.array(k % 3 * 3600_000_000, pa.timestamp("us")),
            "b": pa.array(k % 2 == 0)}
    # a float key of many values: -0.0 beside 0.0, NaN and nulls
    fk = (rng.integers(-groups // 2, groups // 2, n) * 0.5)
    fk[fk == 0] = np.where(rng.random(int((fk == 0).sum())) < 0.5, -0.0, 0.0)
    fk[rng.random(n) < 0.02] = np.nan
    cols["fk"] = pa.array(fk, mask=rng.random(n) < 0.02)
    for t in INTS:
        info = np.iinfo(t)
        cols[t] = pa.array(rng.integers(max(info.min, -100), min(info.max, 100), n).astype(t),
                           mask=mask())
    for t in ("float32", "float64"):
        v = rng.normal(size=n).astype(t)
        v[rng.random(n) < 0.02] = np.nan
        v[rng.random(n) < 0.02] = -0.0
        v[rng.random(n) < 0.01] = np.inf
        cols[t] = pa.array(v, mask=mask())
    # group g0: no value of i32n; group g1: only NaN in nan; sums beyond 2**53 in big/ubig
    cols["i32n"] = pa.array(k.astype(np.int32), mask=(k == 0) | (rng.random(n) < 0.1))
    cols["nan"] = pa.array(np.where(k == 1, np.nan, rng.normal(size=n)))
    cols["big"] = pa.array(rng.integers(2**49, 2**50, n) * np.where(k % 2, 1, -1))
    cols["ubig"] = pa.array(rng.integers(2**49, 2**50, n).astype(np.uint64))
    return pa.table(cols)


VALUES = INTS + ["float32", "float64", "i32n", "nan", "big", "ubig"]
SPEC = {c: FUNCS for c in VALUES}


def expected(whole, by):
    exprs = []
    for c in VALUES:
        x = pl.col(c).cast(pl.Float64) if c == "float32" else pl.col(c)
        exprs += [pl.when(x.count() > 0).then(x.sum()).alias(f"{c}_sum"),
                  x.mean().alias(f"{c}_mean"), x.count().alias(f"{c}_count"),
                  pl.col(c).min().alias(f"{c}_min"), pl.col(c).max().alias(f"{c}_max"),
                  pl.len().alias(f"{c}_size")]
    return pl.from_arrow(whole).group_by(by).agg(exprs)


def differences(got, want, by):
    # ints exactly, floats to 12 digits or 1e-12 (summation order; sums near 0 cancel), NaN
    # equal to NaN, -0.0 to 0.0
    got, want = pl.from_arrow(got).sort(by), want.sort(by)
    if got.height != want.height or got.columns != want.columns:
        return [f"shape {got.shape} {got.columns[:4]} != {want.shape}"]
    out = []
    for c in got.columns:
        for a, b in zip(got[c].to_list(), want[c].to_list()):
            same = (a == b or (a is not None and b is not None and isinstance(a, float) and
                    (math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) or math.isnan(a) and math.isnan(b))))
            if not same:
                out.append(f"{c}: {a} != {b}")
                break
    return out
"""

IN_MPI = CASES + r"""
from mpi4py import MPI
from hetflow import frame
from hetflow.frame import _aggregate, _dense
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
local = part(rank)
failures = []
for by in (["s"], ["s", "k"], ["k", "b"], ["fk"], ["ts", "s"]):
    routes = comm.allgather(_dense.route(local, by, _aggregate.plan(SPEC)))
    got = frame.from_local(comm, local).groupby(by).agg(SPEC).gather()
    if rank == 0:
        if set(routes) != {"dense"}:
            failures.append(f"{by}: routes {routes}")
        whole = pa.concat_tables([part(r) for r in range(size)])
        failures += [f"{by} {d}" for d in differences(got, expected(whole, by), by)]
        types = {f.name: str(f.type) for f in got.schema}
        if (types["int32_sum"], types["uint16_sum"], types["float32_sum"], types["int8_min"],
                types["float32_max"]) != ("int64", "uint64", "double", "int8", "float"):
            failures.append(f"{by}: types {types}")
mpiutil.report(failures)
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_dense_kernel_matches_polars_every_width_and_edge(ranks):
    for failures in run_mpi(IN_MPI, ranks, timeout=240).values(ranks):
        assert failures == [], "\n".join(failures[:8])


class _Counted:
    """A ufunc whose ``at`` records (name, accumulator dtype, values dtype)."""

    def __init__(self, ufunc, calls):
        self.ufunc, self.calls = ufunc, calls

    def at(self, acc, idx, values):
        self.calls.append((self.ufunc.__name__, acc.dtype, np.asarray(values).dtype))
        return self.ufunc.at(acc, idx, values)

    def __call__(self, *a, **kw):
        return self.ufunc(*a, **kw)


class _CountingNumPy:
    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, name):
        got = getattr(np, name)
        if isinstance(got, np.ufunc):
            return _Counted(got, self.calls)
        if name == "bincount":
            return lambda *a, **kw: self.calls.append(("bincount", None, None)) or got(*a, **kw)
        return got


def test_many_group_string_key_aggregations_take_the_dense_path_one_dtype_per_scatter():
    # The cliff: np.add.at of int32 values into an int64 accumulator left NumPy's fast
    # path (25x). A many-group string-key group-by takes the dense route, and every ufunc.at
    # there adds or compares one dtype into the same dtype: counted, per column, 2 scatters
    # (min, max) plus 1 for a sum beyond float64's exact integers; counts and the other sums
    # are bincounts (one per column with nulls for its count, one per sum).
    import polars as pl  # noqa: F401 - the expected values' engine, loaded before counting
    from hetflow.frame import _aggregate, _dense

    ns = {}
    exec(CASES, ns)
    table = ns["part"](0, n=40_000, groups=20_000)
    planned = _aggregate.plan(ns["SPEC"])
    assert _dense.route(table, ["s"], planned) == "dense"
    calls = []
    real = _dense.np
    _dense.np = _CountingNumPy(calls)
    try:
        got = _aggregate.whole(table, ["s"], planned)
    finally:
        _dense.np = real
    scatters = [c for c in calls if c[0] != "bincount"]
    assert all(acc == values for _, acc, values in scatters), scatters
    values = ns["VALUES"]
    with_nulls = sum(table.column(c).null_count > 0 for c in values)
    assert len(scatters) == 2 * len(values) + 2      # big and ubig's sums: 2**49 * 40k rows
    assert sum(c[0] == "bincount" for c in calls) == 1 + with_nulls + len(values) - 2
    assert ns["differences"](got, ns["expected"](table, ["s"]), ["s"]) == []
