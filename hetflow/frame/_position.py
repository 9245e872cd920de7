"""Operations by global row position: head, tail, slice, rebalance, concat, gather.

A distributed table's global row order is its partitions in rank order. These operations keep
it: a slice keeps each rank's part of the range where it lies (no data moves), a rebalance or
a concatenation sends every rank one contiguous run of rows to each destination, and received
runs are laid out by source rank, which is global order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import pyarrow as pa

from hetflow.errors import ConfigError, InputError, SchemaMismatch
from hetflow.frame import _check, _exchange, _ipc
from hetflow.frame._mpi import MPI
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._table import DistributedTable


def _int(value, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _starts(rows: Sequence[int]) -> np.ndarray:
    """Each rank's first global row position, and the total after the last (len size + 1)."""
    out = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(rows, out=out[1:])
    return out


def _positions(op: str, table: DistributedTable):
    """The collective check of a positional operation; every rank's first global row and the
    total rows (one small allgather, which also agrees on the schema)."""
    prep = prepare(op, [table], facts={"rows": table.local.num_rows})
    return prep, _starts(prep.agreed.per_rank("rows"))


# -- slices: no data moves ---------------------------------------------------------------------
def slice_rows(table: DistributedTable, start: Optional[int] = None,
               stop: Optional[int] = None) -> DistributedTable:
    """Rows ``start:stop`` of the global order, with Python's slice semantics (negative
    positions count from the end; ``None`` is the start or the end). Each rank keeps its own
    rows of that range, so no data moves and ranks outside it hold empty partitions (see
    :func:`rebalance`). Unlike ``pyarrow.Table.slice(offset, length)``, the second argument
    is a position."""
    start = None if start is None else _int(start, "slice: start")
    stop = None if stop is None else _int(stop, "slice: stop")
    return _sliced("slice", table, start, stop)


def head(table: DistributedTable, n: int = 5) -> DistributedTable:
    """The first ``n`` rows of the global order (all but the last ``-n`` for negative ``n``,
    as polars' ``head``); no data moves."""
    return _sliced("head", table, 0, _int(n, "head: n"))


def _sliced(op: str, table: DistributedTable, start, stop) -> DistributedTable:
    """Rows ``start:stop`` (Python's semantics) of the global order."""
    table = require_table(table, f"{op}: table")
    prep, starts = _positions(op, table)
    lo, hi, _ = slice(start, stop).indices(int(starts[-1]))
    return _keep_range(prep, table, starts, lo, max(lo, hi))


def tail(table: DistributedTable, n: int = 5) -> DistributedTable:
    """The last ``n`` rows of the global order (all but the first ``-n`` for negative ``n``,
    as polars' ``tail``); no data moves."""
    table = require_table(table, "tail: table")
    n = _int(n, "tail: n")
    prep, starts = _positions("tail", table)
    total = int(starts[-1])
    lo = max(total - n, 0) if n >= 0 else min(-n, total)
    return _keep_range(prep, table, starts, lo, total)


def _keep_range(prep, table: DistributedTable, starts: np.ndarray, lo: int,
                hi: int) -> DistributedTable:
    first = int(starts[prep.comm.Get_rank()])
    a = min(max(lo - first, 0), table.local.num_rows)
    b = min(max(hi - first, 0), table.local.num_rows)
    return DistributedTable(prep.comm, table.local.slice(a, b - a), backend="cpu")


# -- rebalance / concat: contiguous runs to each rank ------------------------------------------
def even_shares(total: int, size: int) -> List[int]:
    """``total`` rows over ``size`` ranks, equal to within one (the first ranks take the
    remainder)."""
    base, extra = divmod(int(total), size)
    return [base + (r < extra) for r in range(size)]


def _route(local: pa.Table, first: int, bounds: np.ndarray):
    """This rank's rows (global positions ``first``...) cut into one contiguous run per
    destination whose global range is ``bounds[d]:bounds[d + 1]``: (order, offsets)."""
    n = local.num_rows
    offsets = np.clip(bounds - first, 0, n)
    order = np.arange(n, dtype=np.int32 if n < 2**31 - 1 else np.int64)
    return order, offsets


def rebalance(table: DistributedTable, rows: Optional[Sequence[int]] = None) -> DistributedTable:
    """The same rows in the same global order, rank r holding ``rows[r]`` of them (default:
    equal shares, to within one row; the first ranks take the remainder). Every rank sends
    each destination one contiguous run of its rows (one all-to-all per column); a table
    already so spread is returned as it is, with no exchange. ``rows`` (Cylon's
    ``Repartition``) must give every rank a count, summing to the table's rows."""
    table = require_table(table, "rebalance: table")
    comm = table.comm
    size = comm.Get_size()
    if rows is not None:
        if isinstance(rows, (str, bytes)) or not hasattr(rows, "__len__") or len(rows) != size:
            raise ConfigError(f"rebalance: rows must give one count per rank ({size}), got "
                              f"{rows!r}")
        rows = [_int(r, "rebalance: each of rows") for r in rows]
        if min(rows) < 0:
            raise ConfigError(f"rebalance: rows must not be negative, got {rows!r}")
    facts = {"rows": table.local.num_rows, "target": rows if rows is not None else [-1] * size}
    prep = prepare("rebalance", [table], facts=facts)
    starts = _starts(prep.agreed.per_rank("rows"))
    total = int(starts[-1])
    targets = prep.agreed.per_rank("target")
    if any(t != targets[0] for t in targets):
        raise ConfigError(f"rebalance: the ranks asked for different rows: {targets}")
    if rows is None:
        rows = even_shares(total, size)
    elif sum(rows) != total:
        raise ConfigError(f"rebalance: rows {rows} sum to {sum(rows)} but the table has "
                          f"{total} rows")
    if prep.agreed.per_rank("rows") == list(rows):  # already so (one rank, or a second call)
        return DistributedTable(comm, table.local, backend="cpu")
    bounds = _starts(rows)
    order, offsets = _route(table.local, int(starts[comm.Get_rank()]), bounds)
    out = _exchange.exchange_rows(comm, table.local, order, offsets)
    return DistributedTable(comm, out, backend="cpu")


def concat(tables: Sequence[DistributedTable]) -> DistributedTable:
    """The tables one after another (all of the first's rows, in its global order, then the
    second's, ...), spread over the ranks in equal shares to within one row, order kept.
    Every table must live on the same communicator and have the same column names and types
    (``SchemaMismatch`` otherwise, on every rank)."""
    if isinstance(tables, DistributedTable) or not isinstance(tables, (list, tuple)) or \
            not tables:
        raise ConfigError(f"concat: expected a non-empty list of DistributedTables, got "
                          f"{type(tables).__name__}")
    tables = [require_table(t, f"concat: tables[{i}]") for i, t in enumerate(tables)]
    comm = tables[0].comm
    for t in tables[1:]:
        if MPI.Comm.Compare(comm, t.comm) not in (MPI.IDENT, MPI.CONGRUENT):
            raise InputError("concat: the tables live on different communicators")
    schema = tables[0].local.schema

    def same_schema():
        for i, t in enumerate(tables[1:], 1):
            if not t.local.schema.equals(schema, check_metadata=False):
                raise SchemaMismatch(
                    f"concat: tables[{i}] has columns {_check._fmt(t.local.schema)} but "
                    f"tables[0] has {_check._fmt(schema)}; every table must have the same "
                    "column names and types (cast or select first)")

    prep = prepare("concat", tables, what=[f"tables[{i}]" for i in range(len(tables))],
                   facts={"rows": [t.local.num_rows for t in tables]}, check=same_schema)
    every = np.asarray(prep.agreed.per_rank("rows"), np.int64).reshape(comm.Get_size(),
                                                                       len(tables))
    if comm.Get_size() == 1:
        out = pa.concat_tables([t.local for t in tables])
        return DistributedTable(comm, out, backend="cpu")
    # global positions: table i's rows follow all rows of the tables before it
    before = np.concatenate([[0], np.cumsum(every.sum(axis=0))[:-1]])
    bounds = _starts(even_shares(int(every.sum()), comm.Get_size()))
    rank = comm.Get_rank()
    routes = []
    for i, t in enumerate(tables):
        first = int(before[i] + every[:rank, i].sum())
        order, offsets = _route(t.local, first, bounds)
        routes.append((order, offsets, t.local))
    exchanges = _exchange.RowExchange.several(comm, routes)
    parts = []
    for ex, t in zip(exchanges, tables):
        columns = [ex.column(c) for c in range(t.local.num_columns)]
        ex.release()
        parts.append(pa.Table.from_arrays(columns, schema=schema))
    return DistributedTable(comm, pa.concat_tables(parts), backend="cpu")



def gather(table: DistributedTable, root: int = 0) -> Optional[pa.Table]:
    """All partitions concatenated in rank order (the global order) on ``root``, None
    elsewhere (collective; the ranks first agree on the schema)."""
    table = require_table(table, "gather: table")
    _check.agree(table.comm, [table.local.schema])
    return _ipc.gather(table.comm, table.local, root)
