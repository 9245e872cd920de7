"""Set operations on whole rows: union (distinct), intersect, difference.

Both tables are shuffled on all their columns (co-partitioned: equal rows meet on one rank),
then each rank groups its rows of both sides once: a row is kept by the union always, by the
intersection when both sides hold it, by the difference when only the left one does. As in
SQL's ``UNION``/``INTERSECT``/``EXCEPT``, the result is distinct and two nulls are the same
value; -0.0 and 0.0 are one value, and so is every NaN (as in polars). Each rank's rows come
in the order of their first occurrence on it (the left table's rows, by source rank, then the
right's).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import InputError, NotSupported, SchemaMismatch
from hetflow.frame import _check, _cylon_rules, _engine
from hetflow.frame._exchange import MPI
from hetflow.frame._agreement import step
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._shuffle import shuffle_local
from hetflow.frame._table import DistributedTable


def union(left: DistributedTable, right: DistributedTable, *,
          backend: Optional[str] = None) -> DistributedTable:
    """The distinct rows of ``left`` and ``right`` together (SQL ``UNION``)."""
    return _set_op("union", left, right, backend)


def intersect(left: DistributedTable, right: DistributedTable, *,
              backend: Optional[str] = None) -> DistributedTable:
    """The distinct rows found in both ``left`` and ``right`` (SQL ``INTERSECT``)."""
    return _set_op("intersect", left, right, backend)


def difference(left: DistributedTable, right: DistributedTable, *,
               backend: Optional[str] = None) -> DistributedTable:
    """The distinct rows of ``left`` not found in ``right`` (SQL ``EXCEPT``)."""
    return _set_op("difference", left, right, backend)


def _hashable(t: pa.DataType) -> bool:
    """Types the shuffle's hash and Arrow's grouping both take as a key."""
    return not (pa.types.is_nested(t) or pa.types.is_dictionary(t) or pa.types.is_null(t)
                or pa.types.is_float16(t))


def _set_op(op: str, left: DistributedTable, right: DistributedTable,
            backend: Optional[str]) -> DistributedTable:
    left = require_table(left, f"{op}: left")
    right = require_table(right, f"{op}: right")
    comm = left.comm
    if MPI.Comm.Compare(comm, right.comm) not in (MPI.IDENT, MPI.CONGRUENT):
        raise InputError(f"{op}: left and right live on different communicators")
    ls, rs = left.local.schema, right.local.schema

    def rows_comparable():
        if not ls.equals(rs, check_metadata=False):
            raise SchemaMismatch(f"{op}: the tables' columns differ: left {_check._fmt(ls)}, "
                                 f"right {_check._fmt(rs)}; a set operation compares whole "
                                 "rows, so both need the same column names and types")
        if len(set(ls.names)) != len(ls.names):
            raise InputError(f"{op}: column names repeat in {ls.names}")
        bad = [f"{f.name!r} ({f.type})" for f in ls if not _hashable(f.type)]
        if bad:
            raise NotSupported(f"{op}: column {', '.join(bad)} cannot be compared as part of "
                               "a row (nested, dictionary, null and float16 columns are not "
                               "supported); select or cast the other columns first")

    prep = prepare(op, [left, right], what=("left", "right"), check=rows_comparable,
                   backend=backend,
                   cylon=lambda: _cylon_rules.never(op, "pycylon has no set operations"))
    names = list(ls.names)
    lt = shuffle_local(comm, _canonical_floats(left.local), names, prep.backend)
    rt = shuffle_local(comm, _canonical_floats(right.local), names, prep.backend)
    with step(comm, f"{op}: each distinct row's first occurrence"):
        both = pa.concat_tables([lt, rt])
        side = np.repeat(np.array([0, 1], np.int8), [lt.num_rows, rt.num_rows])
        keep = _engine.first_rows([both.column(n) for n in names], side,
                                  {"union": "any", "intersect": "both", "difference": "first"}[op])
        out = both.take(pa.array(keep))
    return prep.result(out)


def _canonical_floats(table: pa.Table) -> pa.Table:
    """-0.0 as 0.0 and every NaN as one NaN: Arrow's grouping compares floats bitwise."""
    for i, field in enumerate(table.schema):
        if pa.types.is_floating(field.type) and table.num_rows:
            col = pc.add(table.column(i), pa.scalar(0.0, field.type))
            col = pc.if_else(pc.is_nan(col), pa.scalar(float("nan"), field.type), col)
            table = table.set_column(i, field.name, col)
    return table
