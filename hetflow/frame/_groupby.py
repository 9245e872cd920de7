"""Group-by-aggregate: how it distributes (the kernels are :mod:`hetflow.frame._aggregate`).

* Every aggregation combines exactly (sum, count, mean, min, max, size, first, last, var, std,
  nlargest, nsmallest): each rank reduces its rows to one partial row per group, those rows
  are shuffled by the group keys, and each rank merges the rows of its groups and finishes
  them. Only one row per group and rank crosses the network.
* Any of median, quantile or nunique: no partial result of theirs combines exactly, so the
  rows themselves (keys and aggregated columns only) are shuffled by the group keys and each
  rank aggregates the whole of its groups.

One rank aggregates its rows in one step either way.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from hetflow.frame import _aggregate, _arrays, _check, _cylon_rules, _dense, _pycylon
from hetflow.frame._aggregate import Agg, Planned
from hetflow.frame._agreement import step
from hetflow.frame._mpi import MPI, wait_all
from hetflow.frame._phases import phase
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._shuffle import shuffle_rounds
from hetflow.frame._table import DistributedTable


class GroupBy:
    """``table.groupby(by).agg({...})``: a distributed group-by."""

    def __init__(self, table: DistributedTable, by):
        self.table = require_table(table, "groupby: table")
        self.by = _check.key_names(by, "groupby")

    def agg(self, spec: Dict[str, Union[str, Agg, Sequence[Union[str, Agg]]]], *,
            backend: Optional[str] = None, legacy_names: bool = False) -> DistributedTable:
        """Aggregate ``{column: function or a list of them}``; a function is a name or a
        :class:`~hetflow.frame.Agg` (for parameters): ``sum``, ``count``, ``mean``, ``min``,
        ``max``, ``size``, ``first``, ``last``, ``var``/``std`` (``ddof=1``), ``median``,
        ``quantile`` (``q``; ``interpolation="nearest"``, polars' default), ``nunique``,
        ``nlargest``/``nsmallest`` (``n``).

        Result columns: the group keys, then ``<column>_<function>`` for every function
        (``amount_mean``, ``age_first``; pyarrow's ``TableGroupBy.aggregate`` rule), one row
        per group; a null key is a group of its own. ``legacy_names=True`` (deprecated: it
        goes in 0.3) names a column with one function ``column``, as hetflow 0.1 did.
        ``count`` counts non-null values, ``size`` rows; ``sum``/``min``/``max``/``mean`` skip
        nulls and give null for a group with no non-null value (SQL semantics; pandas'
        and polars' sum give 0). docs/engine.md gives each one's semantics.
        """
        t = self.table
        planned = _aggregate.plan(spec)

        def check():
            _check.check_columns(t.local.schema, [p.column for p in planned], "groupby.agg")
            _aggregate.check_types(t.local.schema, planned)

        prep = prepare("groupby", [t], [self.by], backend=backend, check=check,
                       cylon=lambda: _cylon_rules.groupby(t.comm.Get_size(), t.local, self.by,
                                                          planned))
        if prep.pycylon:
            out = _pycylon.groupby_agg(t.comm, t.local, self.by, planned,
                                       result_schema(t.local.schema, self.by, planned))
            return _legacy(prep.result(out, backend="pycylon"), planned, legacy_names)
        out = aggregate(t.comm, t.local, self.by, planned,
                        lambda table, keys, rounds=1: shuffle_rounds(
                            t.comm, table, keys, prep.backend, rounds, alone=True))
        return _legacy(prep.result(out), planned, legacy_names)


def _legacy(out: DistributedTable, planned: Sequence[Planned], legacy: bool) -> DistributedTable:
    """``out`` with hetflow 0.1's names when asked (``column`` for a column's only function),
    and a FutureWarning: ``legacy_names`` goes in 0.3."""
    if not legacy:
        return out
    import warnings

    warnings.warn("groupby.agg(legacy_names=True) is deprecated and goes in hetflow 0.3: "
                  "read every result column as <column>_<function> (e.g. 'age_first')",
                  FutureWarning, stacklevel=3)
    alone = {p.column for p in planned
             if sum(q.column == p.column for q in planned) == 1}
    return out.rename({p.out: p.column for p in planned if p.column in alone})


def aggregate(comm, table: pa.Table, by: List[str], planned: Sequence[Planned],
              shuffle: Callable[..., Iterable[pa.Table]]) -> pa.Table:
    """This rank's part of the group-by (collective when ``comm`` has several ranks):
    ``shuffle(table, keys, rounds)`` moves rows so that equal keys meet on one rank, in
    ``rounds`` exchanges (each a table of the rows of some keys, all of them)."""
    values = [c for c in dict.fromkeys(p.column for p in planned) if c not in by]
    source = table.select(list(by) + values)
    holistic = _aggregate.holistic(planned)
    if not holistic and _few_repeats(comm, source, by):
        return _by_rounds(comm, source, by, planned, shuffle)
    if holistic and comm.Get_size() > 1:
        (source,) = shuffle(source, list(by), 1)    # the values of each group meet here
    if holistic or comm.Get_size() == 1:
        with step(comm, "groupby: aggregating the groups"), phase("local"):
            out = _aggregate.whole(source, by, planned)
        return out
    names = _names(by, planned)
    # the partials' types as an empty partition gives them, the same on every rank (the
    # exchange reads each rank's columns as the agreed types)
    with phase("partial"):
        schema = _aggregate.partials(source.slice(0, 0), by, planned, names).schema
        partial = _aggregate.partials(source, by, planned, names).cast(schema)
    del source
    (merged,) = shuffle(partial, list(by), 1)       # one row per group and source rank
    del partial
    with step(comm, "groupby: merging and finishing the groups"), phase("local"):
        out = _merged(merged, by, planned, names)
    return out


#: Exchanges of a group-by of about one group a row (see :func:`_by_rounds`).
ROUNDS = 8


def _by_rounds(comm, source: pa.Table, by: List[str], planned: Sequence[Planned],
               shuffle) -> pa.Table:
    """A group-by of about one group a row: the rows move in :data:`ROUNDS` exchanges, each
    aggregated (all of its groups' rows are in it) before the next. The kernel's scratch grows
    with its groups (polars' group index and hash table, 2-3x the rows it reads), so a rank
    holds one round's rows and scratch at a time, not the whole shuffled partition's, and
    the results' chunks are joined into one column each at the end. Each group's rows reach
    the kernel in the order one exchange would give them: its results are the same."""
    schema = _aggregate.whole(source.slice(0, 0), by, planned).schema
    outs = []
    for part in shuffle(source, list(by), ROUNDS):
        # each round agreed (an error fails every rank before the next exchange)
        with step(comm, "groupby: aggregating the groups"), phase("local"):
            outs.append(_aggregate.whole(part, by, planned).cast(schema))
        del part
    del source
    with phase("local"):
        out = pa.concat_tables(outs)
        del outs
        return out.combine_chunks()


#: Rows of a rank's sample for :func:`_few_repeats`; a rank with fewer than SAMPLE_ROWS * 4
#: rows takes no sample (its partial rows are cheap whatever they hold).
SAMPLE_ROWS = _dense.SAMPLE_ROWS
#: Partial rows per input row above which the rows themselves are shuffled.
MOST_ROWS_KEPT = 0.5


def _few_repeats(comm, source: pa.Table, by: List[str]) -> bool:
    """Whether partial rows would keep most of the rows (about one group a row): then each
    rank's partial aggregation costs as much as the merge after it and saves no exchange, and
    the rows are shuffled and aggregated once instead (collective: one small allreduce).

    Each rank of at least ``4 * SAMPLE_ROWS`` rows estimates its groups from a seeded sample
    of its rows (:func:`hetflow.frame._dense.estimate_groups`); the decision is on the sum
    over the ranks. Six keys of about one group a row, 5M rows a rank: 2.2 s of CPU per rank
    saved of 5.4 (a loaded machine)."""
    if comm.Get_size() == 1:
        return False
    n = source.num_rows
    mine = np.zeros(2, np.int64)
    if n >= 4 * SAMPLE_ROWS:
        try:
            mine[:] = n, round(_dense.estimate_groups(source, by))
        except Exception:  # noqa: BLE001 - no estimate: the other ranks wait in the allreduce,
            mine[:] = 0    # and a key polars cannot group fails every rank's kernel alike
    total = np.empty(2, np.int64)
    wait_all([comm.Iallreduce(mine, total, op=MPI.SUM)])
    return bool(total[0] and total[1] > MOST_ROWS_KEPT * total[0])


def _merged(merged: pa.Table, by: List[str], planned: Sequence[Planned],
            names: List[str]) -> pa.Table:
    """The results of the partial rows of this rank's groups (one per group and source)."""
    merged = _aggregate.partials(merged, by, planned, names, merging=True)
    parts, i = [], len(by)
    for p in planned:
        width = len(_aggregate.part_names(p))
        parts.append([_arrays._single(merged.column(j)) for j in range(i, i + width)])
        i += width
    return pa.Table.from_arrays([_arrays._single(merged.column(k)) for k in by]
                                + _aggregate.finish(parts, planned),
                                names=list(by) + [p.out for p in planned])


def result_schema(schema: pa.Schema, by: List[str], planned: Sequence[Planned]) -> pa.Schema:
    """The schema of the group-by's result: the kernels' own, on an empty partition."""
    columns = list(dict.fromkeys(list(by) + [p.column for p in planned]))
    return _aggregate.whole(schema.empty_table().select(columns), by, planned).schema


def _private(names: Sequence[str], stem: str) -> str:
    while stem in names:
        stem += "_"
    return stem


def _names(by: List[str], planned: Sequence[Planned]) -> List[str]:
    """The partial columns' names (none of them a key's)."""
    stem = _private(by, "__hetflow_part")
    return [f"{stem}{i}_{j}" for i, p in enumerate(planned) for j in _aggregate.part_names(p)]
