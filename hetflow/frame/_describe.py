"""Summary statistics of the numeric columns, as polars' ``describe`` gives them.

Count, nulls, minimum and maximum combine exactly from each rank's own; the mean and the
standard deviation (``ddof=1``, pandas' and polars' default) from each rank's count, mean and
sum of squared deviations (Chan's pairwise formula); the percentiles are exact: each column's
non-null values are sorted by the distributed sort (only that column moves), and the value at
position ``floor(q * (n - 1) + 0.5)`` of the ``n`` sorted values is read from the rank that
holds it (polars' ``interpolation="nearest"``, its describe's default).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError, NotSupported
from hetflow.frame import _arrays, _check, _mpi
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._sort import sort
from hetflow.frame._table import DistributedTable


def _numeric(t: pa.DataType) -> bool:
    return (pa.types.is_integer(t) or pa.types.is_floating(t)) and not pa.types.is_float16(t)


def describe(table: DistributedTable, columns=None, *,
             percentiles: Sequence[float] = (0.25, 0.5, 0.75)) -> pa.Table:
    """A small ``pyarrow.Table``, the same on every rank: a ``statistic`` column (``count``,
    ``null_count``, ``mean``, ``std``, ``min``, the percentiles as ``25%``..., ``max``) and
    one float64 column per numeric column (default: every integer and float column; name
    others in ``columns`` and a ``NotSupported`` says which). Collective."""
    table = require_table(table, "describe: table")
    qs = list(percentiles) if percentiles is not None else []
    if not all(isinstance(q, (int, float)) and not isinstance(q, bool) and 0 <= q <= 1
               for q in qs):
        raise ConfigError(f"describe: percentiles must be numbers in [0, 1], got {percentiles!r}")
    schema = table.local.schema
    names = ([f.name for f in schema if _numeric(f.type)] if columns is None
             else _check.key_names(columns, "describe"))

    def numeric_only():
        bad = [f"{n!r} ({schema.field(n).type})" for n in names
               if not _numeric(schema.field(n).type)]
        if bad:
            raise NotSupported(f"describe: column {', '.join(bad)} is not numeric; describe "
                               "summarises integer and float columns")

    prep = prepare("describe", [table], [names], check=numeric_only)
    comm, size = prep.comm, prep.comm.Get_size()
    # per column and rank: non-null count, nulls, mean, sum of squared deviations, min, max
    mine = np.zeros((len(names), 6), np.float64)
    local = []
    for i, name in enumerate(names):
        col = table.local.column(name)
        values = _arrays.to_numpy(pc.drop_null(col).cast(pa.float64())) if len(col) else \
            np.zeros(0, np.float64)
        local.append(values)
        n = len(values)
        mean = values.mean() if n else 0.0
        mine[i] = [n, col.null_count, mean, ((values - mean) ** 2).sum() if n else 0.0,
                   values.min() if n else np.inf, values.max() if n else -np.inf]
    every = np.empty((size,) + mine.shape, np.float64)
    if size > 1:
        _mpi.wait_all([comm.Iallgather(mine, every)])
    else:
        every[0] = mine
    stats = {name: _combine(every[:, i]) for i, name in enumerate(names)}
    for i, name in enumerate(names):
        stats[name] += _percentiles(comm, local[i], int(every[:, i, 0].sum()), qs)
    labels = ["count", "null_count", "mean", "std", "min"] + [f"{q * 100:g}%" for q in qs] + ["max"]
    out = {"statistic": pa.array(labels, pa.string())}
    for name in names:
        count, nulls, mean, std, lo, hi = stats[name][:6]
        out[name] = pa.array([count, nulls, mean, std, lo] + stats[name][6:] + [hi], pa.float64())
    return pa.table(out)


def _combine(rows: np.ndarray) -> list:
    """Every rank's (count, nulls, mean, M2, min, max) of one column -> count, nulls, mean,
    std (ddof=1), min, max over all (None where undefined)."""
    counts = rows[:, 0]
    n = counts.sum()
    nulls = float(rows[:, 1].sum())
    if not n:
        return [0.0, nulls, None, None, None, None]
    mean = float((counts * rows[:, 2]).sum() / n)
    m2 = float(rows[:, 3].sum() + (counts * (rows[:, 2] - mean) ** 2).sum())
    std = float(np.sqrt(m2 / (n - 1))) if n > 1 else None
    return [float(n), nulls, mean, std, float(rows[:, 4].min()), float(rows[:, 5].max())]


def _percentiles(comm, values: np.ndarray, total: int, qs) -> list:
    """The values at ``floor(q * (total - 1) + 0.5)`` of all ranks' ``values`` sorted
    (collective: a distributed sort of this column alone, then one small allreduce)."""
    if not qs or not total:
        return [None] * len(qs)
    ordered = sort(DistributedTable(comm, pa.table({"v": _arrays.arrow_of(values)})), "v")
    rows = ordered.local.num_rows
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = np.full(size, rows, np.int64)
    if size > 1:
        _mpi.wait_all([comm.Iallgather(np.array([rows], np.int64), counts)])
    first = int(counts[:rank].sum())
    # each value comes from the one rank that holds its position; the others add 0
    got = np.zeros(len(qs), np.float64)
    mine = _arrays.to_numpy(ordered.local.column(0)) if rows else np.zeros(0)
    for j, q in enumerate(qs):
        pos = int(np.floor(q * (total - 1) + 0.5)) - first
        if 0 <= pos < rows:
            got[j] = mine[pos]
    if size > 1:
        every = np.empty_like(got)
        _mpi.wait_all([comm.Iallreduce(got, every, op=_mpi.MPI.SUM)])
        got = every
    return [float(v) for v in got]

