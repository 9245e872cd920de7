"""Distinct rows: a shuffle on the subset's columns, then each key's first occurrence."""
from __future__ import annotations

from typing import Optional

import pyarrow as pa

from hetflow.frame import _check, _cylon_rules, _engine, _pycylon
from hetflow.frame._agreement import step
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._shuffle import shuffle_local
from hetflow.frame._table import DistributedTable


def unique(table: DistributedTable, subset=None, *,
           backend: Optional[str] = None) -> DistributedTable:
    """Drop rows whose ``subset`` columns (default: all) repeat, keeping each first occurrence
    in the ranks-in-order concatenation of the input."""
    table = require_table(table, "unique: table")
    schema = table.local.schema
    names = list(schema.names) if subset is None else _check.key_names(subset, "unique")
    prep = prepare("unique", [table], [names], backend=backend, cylon=lambda: _cylon_rules.unique(
        table.comm.Get_size(), table.local, names))
    if prep.pycylon:
        return prep.result(_pycylon.unique(table.comm, table.local), backend="pycylon")
    shuffled = shuffle_local(table.comm, table.local, names, prep.backend, alone=True)
    # -0.0 and 0.0 one value, NaN one value, as in the group-by and polars
    with step(table.comm, "unique: each key's first row"):
        out = shuffled.take(pa.array(_engine.first_rows([shuffled.column(n) for n in names])))
    return prep.result(out)
