"""Group-by-aggregate: a local pre-aggregation, a shuffle of the partial rows, a final one."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError
from hetflow.frame import _check
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._shuffle import shuffle_local
from hetflow.frame._table import DistributedTable

_AGGS = ("sum", "count", "mean", "min", "max")


class GroupBy:
    """``table.groupby(by).agg({...})``: a distributed group-by with a local pre-aggregation."""

    def __init__(self, table: DistributedTable, by):
        self.table = require_table(table, "groupby: table")
        self.by = _check.key_names(by, "groupby")

    def agg(self, spec: Dict[str, Union[str, Sequence[str]]], *,
            backend: Optional[str] = None) -> DistributedTable:
        """Aggregate ``{column: "sum"|"count"|"mean"|"min"|"max" or a list of them}``.

        Result columns: the group keys, then ``column`` (one function) or ``column_function``
        (several). ``count`` counts non-null values; ``sum``/``min``/``max``/``mean`` skip nulls
        and give null for a group with no non-null value (SQL semantics; pandas' sum gives 0).
        """
        t = self.table
        if not isinstance(spec, dict) or not spec:
            raise ConfigError(f"groupby.agg: expected a non-empty dict column -> function, "
                              f"got {spec!r}")
        plan = []
        for col, funcs in spec.items():
            funcs = [funcs] if isinstance(funcs, str) else list(funcs)
            for f in funcs:
                if f not in _AGGS:
                    raise ConfigError(f"groupby.agg: unknown function {f!r} for column {col!r}; "
                                      f"expected one of {_AGGS}")
            for f in funcs:
                plan.append((col, f, col if len(funcs) == 1 else f"{col}_{f}"))
        prep = prepare("groupby", [t], [self.by], backend=backend, check=lambda: (
            _check.check_columns(t.local.schema, [c for c, _, _ in plan], "groupby.agg")))
        if prep.pycylon:
            from hetflow.frame import _pycylon
            return _pycylon.groupby_agg(t, self.by, plan)
        be = prep.backend
        # Pre-aggregate locally (sum/count/min/max partials; mean as sum and count) so only
        # one row per group and rank crosses the network.
        partial_aggs, partial_names = [], []
        source = t.local.select(self.by)
        for i, (col, f, _) in enumerate(plan):
            for pf in (("sum", "count") if f == "mean" else (f,)):
                alias = f"__p{i}_{pf}"
                source = source.append_column(alias, t.local.column(col))
                partial_aggs.append((alias, pf))
                partial_names.append(alias)
        local = group(source, self.by, partial_aggs)
        del source
        shuffled = shuffle_local(t.comm, local, self.by, be)
        final_aggs = [(name, "max" if name.endswith("_max") else
                       "min" if name.endswith("_min") else "sum") for name in partial_names]
        merged = group(shuffled, self.by, final_aggs)
        columns, out_names = [merged.column(k) for k in self.by], list(self.by)
        for i, (_col, f, out_name) in enumerate(plan):
            if f == "mean":
                s = merged.column(f"__p{i}_sum").cast(pa.float64())
                c = merged.column(f"__p{i}_count")
                c = pc.if_else(pc.equal(c, 0), pa.scalar(None, c.type), c)
                columns.append(pc.divide(s, c.cast(pa.float64())))
            else:
                columns.append(merged.column(f"__p{i}_{f}"))
            out_names.append(out_name)
        return prep.result(pa.Table.from_arrays(columns, names=out_names))


def group_by(table: pa.Table, by: List[str]):
    """``table.group_by(by)`` on one thread (a deterministic group order); pyarrow < 12 has no
    ``use_threads`` and gives its own order, which no caller relies on (groups are
    re-aggregated, and ``unique`` sorts the rows it keeps)."""
    try:
        return table.group_by(by, use_threads=False)
    except TypeError:  # pyarrow < 12 (pycylon's environments pin pyarrow 9-10)
        return table.group_by(by)


def group(table: pa.Table, by: List[str], aggs) -> pa.Table:
    """Group-by-aggregate whose result columns are ``by`` then each aggregated column's own
    name (Arrow names them ``col_func`` and has changed their position between versions)."""
    out = group_by(table, by).aggregate(aggs)
    wanted = list(by) + [f"{col}_{func}" for col, func in aggs]
    return out.select(wanted).rename_columns(list(by) + [col for col, _ in aggs])
