"""Seeded random partitions for the frame tests, and row-level comparison helpers.

Every rank can rebuild every other rank's partition from (case seed, rank), so rank 0 computes
the expected answer with polars on the concatenated input without extra communication.
"""
from __future__ import annotations

import datetime
import math

import numpy as np
import pyarrow as pa

WORDS = ["", "a", "b", "ab", "zebra", "Ünïcode", "x" * 40, "a b", "B", "aa"]


def _with_nulls(rng, values, null_rate, typ):
    mask = rng.random(len(values)) < null_rate
    return pa.array(values, type=typ, mask=mask if null_rate else None)


def random_part(seed: int, rank: int, *, rows=None, key_range=20, null_rate=0.1,
                empty_ranks=(), extra=False) -> pa.Table:
    """One rank's partition: int key ``k``, string key ``s``, float ``f``, int ``v``
    (and with ``extra``: a large_string, a timestamp and a bool column)."""
    rng = np.random.default_rng([seed, rank])
    n = 0 if rank in empty_ranks else int(rng.integers(0, 60) if rows is None else rows)
    cols = {
        "k": _with_nulls(rng, rng.integers(0, key_range, n), null_rate, pa.int64()),
        "s": _with_nulls(rng, [WORDS[i] for i in rng.integers(0, len(WORDS), n)], null_rate,
                         pa.string()),
        "f": _with_nulls(rng, np.round(rng.normal(size=n), 1), null_rate, pa.float64()),
        "v": pa.array(rng.integers(-1000, 1000, n), pa.int64()),
    }
    if extra:
        base = datetime.datetime(2024, 1, 1)
        cols["ls"] = _with_nulls(rng, [WORDS[i] * 2 for i in rng.integers(0, len(WORDS), n)],
                                 null_rate, pa.large_string())
        cols["ts"] = _with_nulls(rng, [base + datetime.timedelta(hours=int(h))
                                       for h in rng.integers(0, 30, n)], null_rate,
                                 pa.timestamp("us"))
        cols["b"] = _with_nulls(rng, rng.integers(0, 2, n).astype(bool), null_rate, pa.bool_())
    return pa.table(cols)


def all_parts(size: int, **kw):
    return [random_part(rank=r, **kw) for r in range(size)]


def _sort_key(row):
    return tuple((v is None, repr(type(v)), v if v is not None else 0) for v in row)


def canonical_rows(table: pa.Table, columns=None):
    """The table's rows as a sorted list of tuples, over ``columns`` (default: all, in order)."""
    columns = list(columns or table.column_names)
    data = [table.column(c).to_pylist() for c in columns]
    rows = list(zip(*data)) if data else []
    return sorted(rows, key=_sort_key)


def same_rows(got: pa.Table, expected: pa.Table, rel: float = 0.0):
    """None if ``got`` and ``expected`` hold the same multiset of rows (columns matched by
    name), else a short description of the difference. ``rel``: floats equal within that
    relative tolerance (a float aggregation's last bits depend on the order polars' threads
    summed in: not reproducible from run to run, see docs/engine.md)."""
    if sorted(got.column_names) != sorted(expected.column_names):
        return f"columns differ: got {got.column_names}, expected {expected.column_names}"
    a = canonical_rows(got, got.column_names)
    b = canonical_rows(expected, got.column_names)
    if a != b and rel and len(a) == len(b) and all(map(lambda x, y: _close_rows(x, y, rel), a, b)):
        return None
    if a != b:
        extra = [r for r in a if r not in b][:3]
        missing = [r for r in b if r not in a][:3]
        return (f"rows differ: got {len(a)}, expected {len(b)}; unexpected {extra}; "
                f"missing {missing}")
    return None


def _close_rows(x: tuple, y: tuple, rel: float) -> bool:
    return all(u == v or (isinstance(u, float) and isinstance(v, float)
                          and math.isclose(u, v, rel_tol=rel)) for u, v in zip(x, y))


#: hetflow's join types by polars' names.
PL_HOW = {"inner": "inner", "left": "left", "right": "right", "outer": "full"}


def join_against_polars(comm, left_parts, right_parts, on, how: str):
    """Join this rank's own ``left_parts``/``right_parts`` (every rank's partition, by rank)
    with hetflow and gather; on rank 0, the difference from polars' join of the whole inputs
    (see :func:`same_rows`), or None. None on the other ranks."""
    import polars as pl

    from hetflow import frame

    rank = comm.Get_rank()
    got = frame.join(frame.from_local(comm, left_parts[rank]),
                     frame.from_local(comm, right_parts[rank]),
                     on=on, how=how, suffixes=("", "_right")).gather()
    if rank != 0:
        return None
    expected = pl.from_arrow(pa.concat_tables(left_parts)).join(
        pl.from_arrow(pa.concat_tables(right_parts)), on=on, how=PL_HOW[how], coalesce=True,
        suffix="_right").to_arrow()
    return same_rows(got, expected)
