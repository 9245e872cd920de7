"""Group-by aggregations: which there are (:class:`Agg`, :func:`plan`), what each keeps per
group on a rank (:func:`part_names`), and the kernels that compute those partial rows, merge
them and read results from them, on the compiled engine (:mod:`hetflow.frame._engine`). How
they distribute: :mod:`hetflow.frame._groupby`.

Each kernel is one polars ``group_by(keys).agg(...)`` over the rank's Arrow columns. The key
columns are read back from the rows where each group first appears (Arrow's ``take`` of the
rank's own columns: a key keeps its Arrow type, a dictionary stays one), as are ``first`` and
``last``; sums are taken at 64 bits (int64, uint64, float64: Arrow's types), and a sum, min or
max of a group with no non-null value is null (SQL's rule, not polars').
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError, InputError
from hetflow.frame import _arrays, _dense, _engine

#: Aggregations whose per-rank results do not combine exactly: their values are shuffled.
HOLISTIC = frozenset({"median", "quantile", "nunique"})
#: polars' quantile interpolations (its default, ``"nearest"``, is the default here too).
INTERPOLATIONS = ("nearest", "lower", "higher", "midpoint", "linear")


# -- what the user asks for ------------------------------------------------------------------
@dataclass(frozen=True)
class Agg:
    """An aggregation with parameters, for :meth:`GroupBy.agg`: ``Agg("quantile", q=0.9)``,
    ``Agg("std", ddof=0)``, ``Agg("nlargest", n=3)``. A plain string names the same thing
    with its defaults (``"std"`` is ``Agg("std", ddof=1)``, ``"median"`` is
    ``Agg("quantile", q=0.5, interpolation="linear")`` under its own name)."""

    name: str
    q: Optional[float] = None
    ddof: Optional[int] = None
    n: Optional[int] = None
    interpolation: Optional[str] = None

    def __post_init__(self):
        if self.name not in _KINDS:
            raise ConfigError(f"groupby.agg: unknown function {self.name!r}; expected one of "
                              f"{tuple(_KINDS)}")
        given = {k for k in ("q", "ddof", "n", "interpolation") if getattr(self, k) is not None}
        allowed = _PARAMS[self.name]
        if given - allowed:
            raise ConfigError(f"groupby.agg: {self.name} takes no {sorted(given - allowed)} "
                              f"(it takes {sorted(allowed) or 'no parameters'})")
        if self.name == "quantile" and self.q is None:
            raise ConfigError("groupby.agg: quantile needs q, e.g. Agg('quantile', q=0.9)")
        if self.q is not None and not (isinstance(self.q, (int, float)) and 0 <= self.q <= 1):
            raise ConfigError(f"groupby.agg: q must be a number in [0, 1], got {self.q!r}")
        if self.name in ("nlargest", "nsmallest") and not (
                isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1):
            raise ConfigError(f"groupby.agg: {self.name} needs n, a positive integer, got "
                              f"{self.n!r}")
        if self.ddof is not None and not (isinstance(self.ddof, int) and self.ddof >= 0):
            raise ConfigError(f"groupby.agg: ddof must be a non-negative integer, got "
                              f"{self.ddof!r}")
        if self.interpolation is not None and self.interpolation not in INTERPOLATIONS:
            raise ConfigError(f"groupby.agg: interpolation must be one of {INTERPOLATIONS}, "
                              f"got {self.interpolation!r}")

    @property
    def label(self) -> str:
        """The suffix of its result column: ``<column>_<label>``."""
        if self.name == "quantile":
            extra = "" if self.interpolation in (None, "nearest") else f"_{self.interpolation}"
            return f"quantile_{self.q:g}{extra}"
        if self.name in ("nlargest", "nsmallest"):
            return f"{self.name}_{self.n}"
        if self.name in ("var", "std") and self.ddof not in (None, 1):
            return f"{self.name}_ddof{self.ddof}"
        return self.name


@dataclass(frozen=True)
class Planned:
    """One aggregation of the plan: the column, the aggregation (defaults filled in), the
    result column's name, and what the user wrote (to hand the same spec on)."""

    column: str
    agg: Agg
    out: str
    source: Union[str, Agg]

    @property
    def name(self) -> str:
        return self.agg.name


def plan(spec) -> List[Planned]:
    """Parse ``{column: function or list of functions}`` (each a name or an :class:`Agg`)."""
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"groupby.agg: expected a non-empty dict column -> function, "
                          f"got {spec!r}")
    out: List[Planned] = []
    for col, funcs in spec.items():
        funcs = [funcs] if isinstance(funcs, (str, Agg)) else list(funcs)
        if not funcs:
            raise ConfigError(f"groupby.agg: no function given for column {col!r}")
        parsed = []
        for f in funcs:
            if isinstance(f, str):
                agg = Agg(f)
                if f == "quantile":
                    raise ConfigError("groupby.agg: quantile needs q, e.g. "
                                      "Agg('quantile', q=0.9)")
                if f in ("nlargest", "nsmallest"):
                    raise ConfigError(f"groupby.agg: {f} needs n, e.g. Agg({f!r}, n=3)")
            elif isinstance(f, Agg):
                agg = f
            else:
                raise ConfigError(f"groupby.agg: a function is a name or a frame.Agg, got "
                                  f"{f!r} for column {col!r}")
            parsed.append((agg, f))
        for agg, source in parsed:
            name = f"{col}_{agg.label}"     # always: predictable from the call alone
            out.append(Planned(col, _with_defaults(agg), name, source))
    names = [p.out for p in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"groupby.agg: result columns {dup} would appear twice")
    return out


def _with_defaults(agg: Agg) -> Agg:
    if agg.name in ("var", "std"):
        return Agg(agg.name, ddof=1 if agg.ddof is None else agg.ddof)
    if agg.name == "quantile":
        return Agg("quantile", q=float(agg.q), interpolation=agg.interpolation or "nearest")
    return agg


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _ordered_numbers(t: pa.DataType) -> bool:
    """Types whose values NumPy orders as Arrow does: numbers and temporals (not intervals)."""
    return _numeric(t) or (pa.types.is_temporal(t) and not pa.types.is_interval(t))


def _anything(t: pa.DataType) -> bool:
    return True


def _orderable(t: pa.DataType) -> bool:
    return not (pa.types.is_nested(t) or pa.types.is_dictionary(t) or pa.types.is_null(t)
                or pa.types.is_interval(t))


def _summable(t: pa.DataType) -> bool:
    return _numeric(t) or pa.types.is_decimal(t)


# name -> (the column types it takes, how they are described in an error)
_KINDS: Dict[str, tuple] = {
    "sum": (_summable, "integer, float and decimal"),
    "mean": (_summable, "integer, float and decimal"),
    "count": (_anything, "every"),
    "size": (_anything, "every"),
    "min": (_orderable, "every non-nested"),
    "max": (_orderable, "every non-nested"),
    "first": (_anything, "every"),
    "last": (_anything, "every"),
    "var": (_numeric, "integer and float"),
    "std": (_numeric, "integer and float"),
    "median": (_numeric, "integer and float"),
    "quantile": (_numeric, "integer and float"),
    "nunique": (_anything, "every"),
    "nlargest": (_ordered_numbers, "integer, float and temporal"),
    "nsmallest": (_ordered_numbers, "integer, float and temporal"),
}
_PARAMS = {"var": {"ddof"}, "std": {"ddof"}, "quantile": {"q", "interpolation"},
           "nlargest": {"n"}, "nsmallest": {"n"}}
_PARAMS = {name: _PARAMS.get(name, set()) for name in _KINDS}


def check_types(schema: pa.Schema, planned: Sequence[Planned]) -> None:
    """Raise InputError for an aggregation the column's type does not take (every rank: the
    schema is agreed first)."""
    for p in planned:
        t = schema.field(p.column).type
        takes, described = _KINDS[p.name]
        if not takes(t):
            raise InputError(f"groupby.agg: {p.name} does not take column {p.column!r} of "
                             f"type {t}; it takes {described} columns")


def holistic(planned: Sequence[Planned]) -> bool:
    return any(p.name in HOLISTIC for p in planned)


#: Aggregations whose partial rows are their own result (no :func:`finish` step of note).
ARROW = frozenset({"sum", "count", "mean", "min", "max", "size"})


def part_names(p: Planned) -> List[str]:
    """The partial columns an aggregation keeps per group and rank."""
    return {"mean": ["sum", "count"], "var": ["n", "mean", "m2"],
            "std": ["n", "mean", "m2"]}.get(p.name, ["value"])


# -- kernels ---------------------------------------------------------------------------------
def _ordinal(col) -> pa.Array:
    """A column as polars orders it: its own values, or (a type polars does not order as
    Arrow does) each value's rank among them, nulls kept."""
    col = _engine.decoded(col)
    if _engine.native(col.type):
        return col
    rank = pc.rank(col, sort_keys="ascending", tiebreaker="dense")
    return pc.if_else(pc.is_valid(col), rank, pa.nulls(len(col), rank.type)) if col.null_count \
        else rank


def _validity(col) -> pa.Array:
    return pc.is_valid(_arrays._single(col))


def _wide(t: pa.DataType) -> Optional[pa.DataType]:
    """A sum's type (Arrow's): integers at 64 bits of their signedness, floats as float64,
    decimals at precision 38."""
    if pa.types.is_decimal(t):
        return pa.decimal128(38, t.scale)
    return (pa.float64() if pa.types.is_floating(t) else
            pa.uint64() if pa.types.is_unsigned_integer(t) else pa.int64())


def _cast(t: pa.DataType):
    return lambda arr, rows: arr if arr.type == t else arr.cast(t)


class _Kernel:
    """One polars group-by over a table's rows: the columns it reads (each prepared once),
    the expressions, and how each result comes back to Arrow (``post(array, rows)``, rows
    being each group's first row)."""

    def __init__(self, keys: Sequence[pa.Array]):
        keys = [_arrays._single(k) for k in keys]
        self.keys = [_arrays.unsigned_zero(k) if pa.types.is_floating(k.type) else k
                     for k in keys]
        self.columns = [_engine.comparable(k) for k in keys]
        self.names = [f"k{i}" for i in range(len(keys))]
        self.exprs, self.outs, self.after, self._added = [], [], [], {}
        self.numbered = False   # whether a result reads the rows' numbers
        self.holistic = False   # whether a result reads each group's rows (see _engine.grouped)

    def col(self, col: pa.Array, how=_engine.decoded):
        """``col`` as ``how`` prepares it, a polars column (added once per column and way)."""
        at = (id(col), how)
        if at not in self._added:
            self._added[at] = (f"c{len(self.names)}", col)  # col held: its id stays its own
            self.columns.append(how(col))
            self.names.append(self._added[at][0])
        return _engine.polars().col(self._added[at][0])

    def out(self, expr, post=None, after=None) -> str:
        """A result: ``expr`` per group, then ``after(column)`` (an expression over the
        groups' results, e.g. ``pl.col(name) * 2``), then ``post(array, rows)`` in Arrow."""
        name = f"o{len(self.exprs)}"
        self.exprs.append(expr.alias(name))
        self.outs.append((name, post))
        if after is not None:
            self.after.append(after(_engine.polars().col(name)).alias(name))
        return name

    def hidden(self, expr) -> str:
        """A result read only by another's ``after``."""
        name = f"h{len(self.exprs)}"
        self.exprs.append(expr.alias(name))
        return name

    def row(self):
        """The rows' numbers, a polars column."""
        self.numbered = True
        return _engine.polars().col(_engine.ROW)

    def count(self, col: pa.Array):
        """The non-null values of ``col`` per group."""
        return self.col(col, _validity).sum() if col.null_count else _engine.polars().len()

    def run(self) -> Tuple[List[pa.Array], List[pa.Array]]:
        """The groups' keys and the results, one row per group. A key polars holds as Arrow
        does comes back from polars; any other is read from its group's first row."""
        pl = _engine.polars()
        keys = self.names[:len(self.keys)]
        by_row = [i for i, k in enumerate(self.keys) if not _engine.native(k.type)]
        first = [pl.col(_engine.ROW).first().alias("__first")] if by_row else []
        lazy = _engine.frame(self.columns, self.names, row=self.numbered or bool(by_row)).lazy()
        got = _engine.arrow(_engine.collect(_engine.grouped(
            lazy, keys, self.keys, first + self.exprs, self.holistic).with_columns(self.after)))
        rows = _arrays._single(got.column("__first")) if by_row else None
        keys = [k.take(rows) if i in by_row else _arrays._single(got.column(f"k{i}")).cast(k.type)
                for i, k in enumerate(self.keys)]
        results = [(_arrays._single(got.column(name)), post) for name, post in self.outs]
        return keys, [post(arr, rows) if post else arr for arr, post in results]


def _extreme(k: _Kernel, col: pa.Array, func: str) -> None:
    """A min or max, Arrow's type kept (a type polars does not order as Arrow: by ranks)."""
    if _engine.native(_engine.decoded(col).type):
        x = k.col(col)
        k.out(x.min() if func == "min" else x.max(), _cast(col.type))
        return
    r = k.col(col, _ordinal)
    k.out(k.row().filter(r == (r.min() if func == "min" else r.max())).first(),
          lambda rows, _: col.take(rows))


def _ranked(k: _Kernel, col: pa.Array, n: int, largest: bool, merging: bool) -> None:
    """Each group's n largest (descending) or smallest (ascending) non-null values, a list."""
    x = k.col(col)
    if merging:
        x = x.explode()
    # a sort and its head: 0.39 s against top_k's 0.46 s (then sorted) for 5M rows in 100k
    # groups, one thread; the same values (NaN the largest in both)
    kept = x.drop_nulls().sort(descending=largest).head(n)
    item = col.type.value_type if merging else col.type
    k.out(kept, _cast(pa.large_list(item)))


def _parts(k: _Kernel, p: Planned, cols: Sequence[pa.Array], merging: bool) -> None:
    """Register ``p``'s partial columns (:func:`part_names`) over a value column
    (``cols[0]``), or, ``merging``, over partial columns of several ranks (``cols``)."""
    pl = _engine.polars()
    name, col = p.name, cols[0]
    if name in ("sum", "mean"):
        x = k.col(col)
        wide = _wide(_engine.decoded(col).type)
        if not pa.types.is_decimal(wide) and not _engine.sums_fit(col):
            x = x.cast(pl.Float64 if pa.types.is_floating(wide) else
                       pl.UInt64 if pa.types.is_unsigned_integer(wide) else pl.Int64)
        count = k.hidden(k.count(col))   # a sum of no value is null
        k.out(x.sum(), _cast(wide), lambda c: pl.when(pl.col(count) > 0).then(c))
        if name == "mean":
            k.out(k.col(cols[1]).sum() if merging else k.count(col), _cast(pa.int64()))
    elif name in ("min", "max"):
        _extreme(k, col, name)
    elif name in ("count", "size"):
        k.out(k.col(col).sum() if merging else k.count(col) if name == "count" else pl.len(),
              _cast(pa.int64()))
    elif name in ("first", "last"):
        row = k.row()
        k.out(row.first() if name == "first" else row.last(), lambda rows, _: col.take(rows))
    elif name in ("nlargest", "nsmallest"):
        _ranked(k, col, p.agg.n, name == "nlargest", merging)
    elif name in ("var", "std") and not merging:
        x = k.col(col).cast(pl.Float64)
        n = k.out(x.count().cast(pl.Float64))
        k.out(x.mean(), None, lambda c: c.fill_null(0.0))
        k.out(x.var(ddof=0), None, lambda c: (c * pl.col(n)).fill_null(0.0))
    elif name in ("var", "std"):
        n, mean, m2 = (k.col(c) for c in cols)
        total = n.sum()
        merged = pl.when(total > 0).then((n * mean).sum() / total).otherwise(0.0)
        k.out(total)
        k.out(merged)
        k.out(m2.sum() + (n * (mean - merged) ** 2).sum())
    else:
        raise AssertionError(f"{name} has no exact partial result")


def _holistic(k: _Kernel, p: Planned, col: pa.Array) -> None:
    """A result of ``p`` over every row of each group: median, quantile, nunique."""
    k.holistic = True
    if p.name == "nunique":
        k.out(k.col(col, _engine.comparable).n_unique(), _cast(pa.int64()))
        return
    x = k.col(col).cast(_engine.polars().Float64)
    k.out(x.median() if p.name == "median" else x.quantile(p.agg.q, p.agg.interpolation))


def _table(keys: List[pa.Array], by: Sequence[str], columns: List[pa.Array],
           names: Sequence[str]) -> pa.Table:
    return pa.Table.from_arrays(keys + columns, names=list(by) + list(names))


def partials(table: pa.Table, by: Sequence[str], planned: Sequence[Planned],
             names: Sequence[str], merging: bool = False) -> pa.Table:
    """One partial row per group (keys, then the ``names`` columns, :func:`part_names` of each
    aggregation in turn) of ``table``'s rows, or, ``merging``, of ``table``'s partial rows (in
    that same layout: several ranks' rows per group, in rank order)."""
    got = None if merging else _dense.run(table, by, planned)
    if got is not None:   # dense group codes (hetflow/frame/_dense.py)
        return _table(got[0], by, [c for cols in got[1] for c in cols], names)
    k = _Kernel([table.column(c) for c in by])
    i = 0
    for p in planned:
        width = len(part_names(p))
        cols = ([_arrays._single(table.column(n)) for n in names[i:i + width]] if merging
                else [_arrays._single(table.column(p.column))])
        _parts(k, p, cols, merging)
        i += width
    keys, out = k.run()
    return _table(keys, by, out, names)


def whole(table: pa.Table, by: Sequence[str], planned: Sequence[Planned]) -> pa.Table:
    """The results of ``table``'s groups, every row of each being here."""
    keys, parts = _dense.run(table, by, planned) or _whole_parts(table, by, planned)
    return _table(keys, by, finish(parts, planned), [p.out for p in planned])


def _whole_parts(table: pa.Table, by: Sequence[str], planned: Sequence[Planned]):
    k = _Kernel([table.column(c) for c in by])
    for p in planned:
        col = _arrays._single(table.column(p.column))
        (_holistic if p.name in HOLISTIC else lambda k, p, c: _parts(k, p, [c], False))(k, p, col)
    keys, out = k.run()
    ends = np.cumsum([1 if p.name in HOLISTIC else len(part_names(p)) for p in planned])
    return keys, [out[e - w:e] for e, w in zip(ends, np.diff(ends, prepend=0))]


def _floats(col: pa.Array) -> np.ndarray:
    """The values as float64 (nulls as 0)."""
    if col.null_count:
        col = col.fill_null(pa.scalar(0, col.type))
    return _arrays.to_numpy(col).astype(np.float64, copy=False)


def _spread(n_col, m2_col, ddof: int, root: bool) -> pa.Array:
    n, m2 = _arrays.to_numpy(n_col), _arrays.to_numpy(m2_col)
    ok = n - ddof > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(ok, m2 / np.where(ok, n - ddof, 1), 0.0)
    return _arrays.from_values(pa.float64(), np.sqrt(var) if root else var, ok)


def finish(parts: List[List[pa.Array]], planned: Sequence[Planned]) -> List[pa.Array]:
    """Each aggregation's result column from its partial columns over all of a group's rows."""
    out = []
    for p, cols in zip(planned, parts):
        if p.name == "mean":
            total, count = cols
            c = _arrays.to_numpy(count)
            with np.errstate(invalid="ignore", divide="ignore"):
                # unsafe: an int64 sum beyond 2**53 rounds (as the mean itself does)
                s = _floats(total.cast(pa.float64(), safe=False)) / np.where(c > 0, c, 1)
            out.append(_arrays.from_values(pa.float64(), s, c > 0))
        elif p.name in ("var", "std"):
            out.append(_spread(cols[0], cols[2], p.agg.ddof, p.name == "std"))
        else:
            out.append(cols[0])
    return out
