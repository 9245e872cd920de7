"""Which operations asked of pycylon it runs: decided once, in :func:`~._prepare.prepare`.

An operation passes ``prepare(..., cylon=lambda: rules.join(...))``; where pycylon was asked
for, ``prepare`` builds that :class:`Route` after the ranks agreed on the schemas and the key
columns, sums its per-column counts over the ranks (one small allreduce), and asks it how the
operation goes, the same way on every rank:

* ``None``: pycylon runs it (:mod:`hetflow.frame._pycylon`);
* ``(op, why)``: pycylon has no such operation (semi/anti join, a shuffle co-partitioned with
  the CPU engine's, the group-by functions of ``NO_CYLON_AGG``), gets it wrong
  (``CYLON_WRONG``: left, right and outer joins; string and binary keys of a join, group-by or
  unique on more than one rank), or cannot carry a column of the table (a join or sort with a
  dictionary, decimal or duration column; on more than one rank also a bool or large_string
  column, which Cylon cannot split between ranks): the CPU engine runs it, and a warning on the
  ``hetflow.frame`` logger says why;
* :class:`~hetflow.errors.NotSupported`: pycylon has the operation but its semantics differ
  from the CPU engine's in a way the adapter cannot convert (NaN keys, null sort keys, null
  aggregated values, NaN under a min or max, unique over a subset); the message names it.

None of this needs pycylon installed. The facts about Cylon are from cylondata/cylon at 03e0338
(run beside the CPU engine on the same data); the files named are in that repository.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import NotSupported

#: How an operation goes when pycylon was asked for: None (pycylon runs it) or the operation's
#: name and why the CPU engine runs it instead.
Decision = Optional[Tuple[str, str]]

# pycylon's join types (python/pycylon/pycylon/common/join_config.pyx, StrToJoinType)
JOIN_HOW = {"inner": "inner", "left": "left", "right": "right", "outer": "outer",
            "full": "outer"}
# The aggregations run on pycylon, by their names there (python/pycylon/pycylon/data/
# aggregates.pyx, AggregationOpString); the others run on the CPU engine (NO_CYLON_AGG).
AGG = {"sum": "sum", "count": "cnt", "min": "min", "max": "max", "mean": "mean"}
# What Cylon computes wrong, and so never runs here: the CPU engine does, and the log says why.
CYLON_WRONG = {
    "outer joins": "Cylon's left, right and outer joins give an unmatched row's cells of the "
                   "other side 0 instead of null (and crash when such a column holds nulls)",
    "string keys": "on more than one rank Cylon partitions string and binary keys by the "
                   "address of each value, not its bytes (a join loses rows, a group-by or "
                   "unique returns a group more than once)",
}
# Why each aggregation pycylon's DataFrame.groupby(...).agg does not run goes to the CPU engine.
NO_CYLON_AGG = {
    None: "pycylon's group-by has no {name} aggregation (its names: sum, cnt, min, max, var, "
          "nunique, mean, quantile, std; python/pycylon/pycylon/data/aggregates.pyx)",
    "var": "pycylon's agg takes a name only, no ddof, and Cylon's defaults disagree (VarOp's "
           "ddof=1, VarKernelOptions' ddof=0), so the ddof it applies is not known here",
    "std": "pycylon's agg takes a name only, no ddof, and Cylon's defaults disagree (VarOp's "
           "ddof=1, VarKernelOptions' ddof=0), so the ddof it applies is not known here",
    "median": "pycylon's agg takes a name only: no q and no interpolation (Cylon's quantile "
              "kernel states neither polars' nearest nor its linear median)",
    "quantile": "pycylon's agg takes a name only: no q (Cylon's quantile is at 0.5) and no "
                "interpolation",
    "nunique": "Cylon's nunique has not been compared with the CPU engine's (a null and NaN each "
               "count as one value) on a pycylon build",
}


@dataclass(frozen=True)
class Route:
    """An operation's pycylon routing: ``count()`` gives this rank's counts the decision needs
    (as many on every rank: the schemas and keys are agreed by then), ``decide(totals)`` the
    :data:`Decision` from their sums over the ranks (or raises NotSupported)."""

    count: Callable[[], List[int]]
    decide: Callable[[np.ndarray], Decision]


def never(op: str, why: str) -> Route:
    """An operation pycylon has no form of: the CPU engine runs it, and says ``why``."""
    return Route(lambda: [], lambda totals: (op, why))


# -- types ---------------------------------------------------------------------------------------
def split_type(t: pa.DataType) -> bool:
    """Types Cylon can split between ranks (partition.cpp fails with "splitter not implemented"
    on any other column: arrow_kernels.cpp's CreateSplitter): integers, float32/64, string,
    binary, fixed-size binary, dates, timestamps, times. No bool, large_string, large_binary,
    float16, decimal or nested types. Cylon's row hash, comparator and sort kernels handle the
    same ones (arrow_comparator.cpp's and CreateSorter's switches also lack bool and
    large_string, which fail at one rank too: "unknown type large_string")."""
    return ((pa.types.is_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t)
             or pa.types.is_string(t) or pa.types.is_binary(t)
             or pa.types.is_fixed_size_binary(t) or pa.types.is_date(t)
             or pa.types.is_timestamp(t) or pa.types.is_time(t)))


def table_type(t: pa.DataType) -> bool:
    """Types a pycylon Table can hold at all (arrow_types.cpp's CheckSupportedTypes; any other
    column fails ``DataFrame(table)`` with "unsupported type", on one rank too): the
    splittable ones, bool, float16, large_string, large_binary, and lists of numbers. No
    dictionary, decimal, duration, interval, struct or null column."""
    if pa.types.is_list(t):
        return pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)
    return (split_type(t) or pa.types.is_boolean(t) or pa.types.is_float16(t)
            or pa.types.is_large_string(t) or pa.types.is_large_binary(t))


def _uncarried(size: int, op: str, *schemas: pa.Schema) -> Optional[str]:
    """Why Cylon cannot carry the tables' columns, key or not, through ``op``: a type a pycylon
    Table cannot hold, or (on more than one rank) one Cylon cannot split between ranks; None if
    it can."""
    def named(ok) -> List[str]:
        return [f"{f.name!r} ({f.type})" for schema in schemas for f in schema
                if not ok(f.type)]
    unheld = named(table_type)
    if unheld:
        return (f"column {', '.join(unheld)}: a pycylon Table cannot hold this type (making "
                "one fails with 'unsupported type')")
    unsplit = named(split_type) if size > 1 else []
    if unsplit:
        return (f"column {', '.join(unsplit)}: Cylon has no splitter for this type (a {op} on "
                "more than one rank fails with 'splitter not implemented')")
    return None


def _require_key_types(op: str, schema: pa.Schema, names: Sequence[str], side: str = "") -> None:
    for n in names:
        t = schema.field(n).type
        if not split_type(t):
            where = f" of the {side} table" if side else ""
            raise NotSupported(f"{op} on pycylon: key column {n!r}{where} is {t}, a type Cylon's "
                               f"row comparator does not handle; use backend='cpu'")


def _address_hashed(size: int, schema: pa.Schema, names: Sequence[str]) -> List[str]:
    """The ``names`` whose values Cylon would partition by address (``CYLON_WRONG``): string
    and binary columns, when the table spans more than one rank."""
    if size == 1:
        return []
    return [n for n in names if _bytes_type(schema.field(n).type)]


def _bytes_type(t: pa.DataType) -> bool:
    """String and binary types (large and fixed-size too)."""
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t))


# -- counts (this rank's; prepare sums them over the ranks) --------------------------------------
def _nulls_nans(table: pa.Table, names: Sequence[str]) -> List[int]:
    """Nulls, then NaNs, of each named column: ``[nulls0, nans0, nulls1, ...]``."""
    out = []
    for n in names:
        col = table.column(n)
        nan = 0
        if pa.types.is_floating(col.type) and len(col):
            nan = pc.sum(pc.is_nan(col)).as_py() or 0
        out += [col.null_count, int(nan)]
    return out


def _counting_nulls_nans(decide, *columns) -> Route:
    """The route that counts nulls and NaNs of each ``(table, names)`` in ``columns`` (in
    that order, see :func:`_nulls_nans`) and gives their totals over the ranks to ``decide``."""
    return Route(lambda: [n for table, names in columns for n in _nulls_nans(table, names)],
                 decide)


def _negative_zeros(table: pa.Table, names: Sequence[str]) -> List[int]:
    """1 for each named float column holding -0.0 here, else 0."""
    out = []
    for n in names:
        col = table.column(n)
        found = False
        if pa.types.is_floating(col.type) and len(col):
            v = np.asarray(pc.fill_null(col, 1.0).to_numpy(), dtype=np.float64)
            found = bool((np.signbit(v) & (v == 0)).any())
        out.append(int(found))
    return out


def _pairs(totals: np.ndarray, names: Sequence[str]) -> Dict[str, Tuple[int, int]]:
    return {n: (int(totals[2 * i]), int(totals[2 * i + 1])) for i, n in enumerate(names)}


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names))


def _refuse(names: str, message: str) -> None:
    """Raise :class:`NotSupported` with ``message`` (``{names}`` in it: ``names``) where
    ``names`` (the columns that keep an operation off pycylon, as text) is not empty."""
    if names:
        raise NotSupported(message.format(names=names))


# -- the operations ------------------------------------------------------------------------------
def join(size: int, left: pa.Table, right: pa.Table, lk: List[str], rk: List[str],
         how: str) -> Route:
    """A join on ``size`` ranks: inner joins run on pycylon."""
    def decide(totals) -> Decision:
        if how not in JOIN_HOW:
            return (f"{how} join", "pycylon has no semi or anti join (JoinConfig knows inner, "
                    "left, right and outer)")
        if how != "inner":
            return f"{how} join", CYLON_WRONG["outer joins"]
        _require_key_types("join", left.schema, lk, "left")
        _require_key_types("join", right.schema, rk, "right")
        why = _uncarried(size, "join", left.schema, right.schema)
        if why:
            return "join", why
        strings = _address_hashed(size, left.schema, lk) + _address_hashed(size, right.schema, rk)
        if strings:
            return "join", f"key {_quoted(strings)}: {CYLON_WRONG['string keys']}"
        named = [f"left {n!r}" for n in lk] + [f"right {n!r}" for n in rk]
        _refuse(", ".join(n for i, n in enumerate(named) if totals[2 * i + 1]),
                "join on pycylon: float key {names} holds NaN; Cylon compares keys with == (NaN "
                "never matches NaN) while the CPU engine's Arrow join matches NaN keys; use "
                "backend='cpu' or drop the NaN rows")
        return None
    return _counting_nulls_nans(decide, (left, lk), (right, rk))


def sort(size: int, table: pa.Table, names: List[str]) -> Route:
    """A sort on ``size`` ranks: pycylon's sample sort, keys without nulls or NaN."""
    def decide(totals) -> Decision:
        _require_key_types("sort", table.schema, names)
        why = _uncarried(size, "sort", table.schema)
        if why:
            return "sort", why
        _refuse(_quoted([n for n, (nulls, nans) in _pairs(totals, names).items() if nulls or nans]),
                "sort on pycylon: key {names} holds nulls or NaN; the CPU engine sorts them "
                "last in both directions, which pycylon's sort does not promise; use "
                "backend='cpu'")
        return None
    return _counting_nulls_nans(decide, (table, names))


def groupby(size: int, table: pa.Table, by: List[str], planned: Sequence) -> Route:
    """``GroupBy.agg`` on ``size`` ranks (``planned``: the CPU engine's aggregations,
    :class:`hetflow.frame._aggregate.Planned`): sums, counts, minima, maxima and means."""
    values = list(dict.fromkeys(p.column for p in planned))
    schema = table.schema

    def decide(totals) -> Decision:
        for p in planned:
            if p.name not in AGG:
                return (f"groupby {p.name}",
                        NO_CYLON_AGG.get(p.name, NO_CYLON_AGG[None]).format(name=p.name))
        _require_key_types("groupby", schema, by)
        strings = _address_hashed(size, schema, by)
        if strings:
            return "groupby", f"key {_quoted(strings)}: {CYLON_WRONG['string keys']}"
        for p in planned:
            if p.column in by:
                raise NotSupported(f"groupby.agg on pycylon: column {p.column!r} is also a group "
                                   "key, which Cylon's group-by does not take; use backend='cpu'")
            t = schema.field(p.column).type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)) or pa.types.is_float16(t):
                raise NotSupported(f"groupby.agg on pycylon: column {p.column!r} is {t}; Cylon's "
                                   "aggregation kernels take integer and float columns only")
        keys, cols = _pairs(totals, by), _pairs(totals[2 * len(by):], values)
        _refuse(_quoted([n for n, (nulls, nans) in keys.items() if nulls or nans]),
                "groupby on pycylon: key {names} holds nulls or NaN; the CPU engine makes each "
                "one group, Cylon compares NaN with == (every NaN its own group); use "
                "backend='cpu'")
        _refuse(_quoted([n for n, (nulls, _) in cols.items() if nulls]),
                "groupby.agg on pycylon: column {names} holds nulls; Cylon's kernels give an "
                "all-null group 0 or the kernel's start value where the CPU engine gives null; "
                "use backend='cpu'")
        extremes = {p.column for p in planned if p.name in ("min", "max")}
        _refuse(_quoted([n for n, (_, nans) in cols.items() if nans and n in extremes]),
                "groupby.agg on pycylon: column {names} holds NaN; Cylon's min and max compare "
                "with <, so a group's result is NaN or a number depending on where its NaN "
                "falls, where the CPU engine skips NaN; use backend='cpu'")
        return None
    return _counting_nulls_nans(decide, (table, by), (table, values))


def unique(size: int, table: pa.Table, names: List[str]) -> Route:
    """``unique`` on ``size`` ranks: over all columns only (with a subset the CPU engine keeps
    each key's first occurrence in rank order, Cylon whichever its shuffle delivers first)."""
    schema = table.schema
    every = list(schema.names)

    def decide(totals) -> Decision:
        if set(names) != set(every):
            raise NotSupported("unique on pycylon: a subset of columns is not supported; the CPU "
                               "engine keeps each key's first occurrence in rank order, pycylon "
                               "an unspecified one; use backend='cpu' or unique over all columns")
        _require_key_types("unique", schema, every)
        strings = _address_hashed(size, schema, every)
        if strings:
            return "unique", f"column {_quoted(strings)}: {CYLON_WRONG['string keys']}"
        _refuse(_quoted([n for n, (nulls, nans) in _pairs(totals, every).items() if nulls or nans]),
                "unique on pycylon: column {names} holds nulls or NaN; Cylon compares NaN with "
                "== (never a duplicate) and its null hashing is unverified here; use "
                "backend='cpu'")
        zeros = [n for n, z in zip(every, totals[2 * len(every):]) if z]
        if zeros:
            return "unique", (f"column {_quoted(zeros)} holds -0.0: Cylon keeps -0.0 and 0.0 "
                              "apart, the CPU engine (as polars) counts them one value")
        return None
    return Route(lambda: _nulls_nans(table, every) + _negative_zeros(table, every), decide)
