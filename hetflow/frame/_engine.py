"""The compiled local engine: polars, over a rank's Arrow partition.

Each rank's local work (a group-by's partial aggregation and its merge, ...) runs here, on
polars' Rust kernels; hetflow keeps the distributed algorithms and the MPI exchange. polars
takes Arrow arrays without copying fixed-width values (strings it converts to its own
layout) and gives Arrow arrays back.

Threads: polars sizes its thread pool once, from ``POLARS_MAX_THREADS`` when it is first
imported. A rank started by a hetflow runtime has it set to the task's cores per rank (the
rank runner sets it with ``OMP_NUM_THREADS``, before the task's code runs); elsewhere (a
program under a bare ``mpiexec``) :func:`polars` sets it from ``OMP_NUM_THREADS`` where that is
set, else polars takes every core it sees. A pool worker keeps the pool its first task sized.
"""
from __future__ import annotations

import os
from typing import Sequence

import pyarrow as pa

_polars = None

#: Name of the row-number column the kernels add (rows are read back by it with Arrow's take,
#: which keeps every column's Arrow type as it was).
ROW = "__hetflow_row"


def polars():
    """The polars module, imported with this rank's thread count (see the module docstring)."""
    global _polars
    if _polars is None:
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:
            os.environ.setdefault("POLARS_MAX_THREADS", threads)
        import polars
        _polars = polars
    return _polars


def frame(columns: Sequence[pa.Array], names: Sequence[str], row: bool = False):
    """A polars DataFrame over Arrow arrays (fixed-width values not copied); ``row``: with a
    :data:`ROW` column numbering the rows."""
    pl = polars()
    df = pl.from_arrow(pa.Table.from_arrays(list(columns), names=list(names)), rechunk=False)
    if isinstance(df, pl.Series):  # pragma: no cover - a table always gives a DataFrame
        df = df.to_frame()
    return df.with_row_index(ROW) if row else df


def arrow(df) -> pa.Table:
    """A polars DataFrame as an Arrow table, each column one chunk."""
    out = df.to_arrow()
    return out.combine_chunks() if any(c.num_chunks != 1 for c in out.columns) else out
