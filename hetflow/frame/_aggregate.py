"""Group-by aggregation kernels: which aggregations there are, what each keeps per group on
a rank (:func:`local`), how those partial results merge exactly (:func:`combine`) and how a
result is read from them (:func:`finish`). How they distribute: :mod:`hetflow.frame._groupby`.

Groups are numbered by :func:`group_ids` (dense, in order of first appearance), and every
kernel works on those numbers; the group keys are the rows where each group first appears.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError, InputError
from hetflow.frame import _arrays, _groupcodes

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


#: Aggregations computed, partials and merge both, by the dense-code kernel
#: (:mod:`hetflow.frame._groupcodes`) on numeric columns, else by Arrow's hash aggregation.
ARROW = frozenset({"sum", "count", "mean", "min", "max", "size"})


def arrow_only(planned: Sequence[Planned]) -> bool:
    return all(p.name in ARROW for p in planned)


def by_arrow(table: pa.Table, by: List[str], planned: Sequence[Planned], names: List[str],
             merging: bool) -> pa.Table:
    """Partial rows (keys, then the ``names`` columns laid out as :func:`part_names` says)
    of :data:`ARROW` aggregations, by the dense-code kernel where it applies, else by one
    Arrow hash aggregation over the keys; ``merging``:
    ``table`` holds such partial rows already (several per group), to be merged."""
    keys = [_arrays.unsigned_zero(_arrays._single(table.column(k))) for k in by]
    requests, i = [], 0
    columns: Dict[str, pa.Array] = {}  # one array per column: the kernels prepare each once
    for p in planned:
        for part in part_names(p):
            name = names[i]
            i += 1
            if merging:
                col = _arrays._single(table.column(name))
                func = p.name if p.name in ("min", "max") else "sum"
            else:
                col = columns.setdefault(p.column, _arrays._single(table.column(p.column)))
                func = ("size" if p.name == "size" else
                        "count" if part == "count" or p.name == "count"
                        else p.name if p.name in ("min", "max") else "sum")
            requests.append((name, func, col))
    out = _groupcodes.aggregate(keys, requests)
    if out is not None:
        return out.rename_columns(list(by) + names)
    source = pa.table(keys + [col for _, _, col in requests],
                      names=list(by) + [name for name, _, _ in requests])
    arrow = [(name, "count", pc.CountOptions(mode="all")) if func == "size" else (name, func)
             for name, func, _ in requests]
    try:
        grouped = source.group_by(list(by), use_threads=False)
    except TypeError:  # pyarrow < 12 (pycylon's environments): no use_threads
        grouped = source.group_by(list(by))
    out = grouped.aggregate(arrow)
    return out.select(list(by) + [f"{r[0]}_{r[1]}" for r in arrow]).rename_columns(
        list(by) + names)


# -- groups ----------------------------------------------------------------------------------
@dataclass
class Groups:
    """Rows numbered by group: ``ids[i]`` is row i's group (0..count-1, in order of first
    appearance), ``first[g]`` the row where group g first appears."""

    ids: np.ndarray
    count: int
    first: np.ndarray
    _last: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def last(self) -> np.ndarray:
        """The row where each group last appears."""
        if self._last is None:
            last = np.zeros(self.count, np.int64)
            np.maximum.at(last, self.ids, np.arange(len(self.ids), dtype=np.int64))
            self._last = last
        return self._last


def _canonical(col: pa.Array) -> pa.Array:
    """The values as dictionary encoding numbers them: -0.0 as 0.0, dictionaries decoded."""
    if pa.types.is_floating(col.type):
        return _arrays.unsigned_zero(col)
    if pa.types.is_dictionary(col.type):
        return _canonical(col.cast(col.type.value_type))
    return col


def _codes(col: pa.Array):
    """Each value's number among the column's distinct values (null one of them, NaN one),
    in order of first appearance, and how many there are."""
    enc = pc.dictionary_encode(_canonical(_arrays._single(col)), null_encoding="encode")
    return _arrays.to_numpy(enc.indices).astype(np.int64, copy=False), len(enc.dictionary)


def _dense(codes: np.ndarray):
    """Integer codes renumbered 0.. in order of first appearance, and their count (a hash:
    3x faster than a stable argsort of 1M int64 codes here, at 100 to 10M distinct)."""
    return _codes(_arrays.arrow_of(codes))


def group_ids(columns: Sequence) -> Groups:
    """Number the rows of ``columns`` (the group keys, as Arrow arrays of equal length) by
    their distinct combination of values; a null is a value, as in polars. One column: its
    values' dictionary codes; several: their codes combined into one integer per row and
    renumbered (both in order of first appearance)."""
    n = len(columns[0])
    codes, card = None, 1
    for col in columns:
        idx, k = _codes(col)
        if codes is None:
            codes, card = idx, k
            continue
        if card * max(k, 1) >= 1 << 62:
            codes, card = _dense(codes)
        codes = codes * k + idx
        card *= k
    if len(columns) > 1:
        codes, card = _dense(codes)
    if n == 0:
        return Groups(np.zeros(0, np.int64), 0, np.zeros(0, np.int64))
    return Groups(codes, int(card), _first_rows(codes))


def _first_rows(codes: np.ndarray) -> np.ndarray:
    """Where each code first appears, for codes numbered in order of first appearance (a
    code's first row is where the running maximum grows)."""
    if not len(codes):
        return np.zeros(0, np.int64)
    top = np.maximum.accumulate(codes)
    starts = np.empty(len(codes), bool)
    starts[0] = True
    np.greater(top[1:], top[:-1], out=starts[1:])
    return np.flatnonzero(starts)


# -- kernels ---------------------------------------------------------------------------------
def _valid(col: pa.Array) -> np.ndarray:
    if not col.null_count:
        return np.ones(len(col), bool)
    return _arrays.to_numpy(pc.is_valid(col))


def _floats(col: pa.Array) -> np.ndarray:
    """The values as float64 (nulls as 0: always read with :func:`_valid`)."""
    if col.null_count:
        col = col.fill_null(pa.scalar(0, col.type))
    return _arrays.to_numpy(col).astype(np.float64, copy=False)


def _native(g: Groups, requests) -> List[pa.Array]:
    """Arrow's hash aggregation of ``(column, function)`` requests by group number, one pass;
    each result aligned with the group numbers."""
    if not requests:
        return []
    names = [f"c{i}" for i in range(len(requests))]
    t = pa.table([_arrays.arrow_of(g.ids)] + [c for c, _ in requests], names=["g"] + names)
    try:
        grouped = t.group_by(["g"], use_threads=False)
    except TypeError:  # pyarrow < 12 (pycylon's environments): no use_threads
        grouped = t.group_by(["g"])
    out = grouped.aggregate([(n, f) for n, (_, f) in zip(names, requests)])
    order = _arrays.to_numpy(out.column("g"))
    if not np.array_equal(order, np.arange(g.count)):
        out = out.take(_arrays.arrow_of(np.argsort(order, kind="stable")))
    return [_arrays._single(out.column(f"{n}_{f}")) for n, (_, f) in zip(names, requests)]


def _counts(g: Groups, mask: Optional[np.ndarray] = None, weights=None) -> np.ndarray:
    ids = g.ids if mask is None else g.ids[mask]
    if weights is not None:
        weights = weights if mask is None else weights[mask]
        return np.rint(np.bincount(ids, weights=weights, minlength=g.count)).astype(np.int64)
    return np.bincount(ids, minlength=g.count).astype(np.int64)


def _sums(g: Groups, values: np.ndarray) -> np.ndarray:
    # float64 always: bincount of no rows gives int64, and every rank's partials must agree
    return np.bincount(g.ids, weights=values, minlength=g.count).astype(np.float64, copy=False)


def _int64(values: np.ndarray) -> pa.Array:
    return _arrays.arrow_of(values.astype(np.int64, copy=False))


def _moments(g: Groups, col: pa.Array) -> List[pa.Array]:
    """(n, mean, M2) of each group's non-null values, by two passes (the mean first, then the
    squared deviations from it: no cancellation of large sums of squares)."""
    ok = _valid(col)
    x = np.where(ok, _floats(col), 0.0)
    n = _counts(g, ok).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, _sums(g, x) / n, 0.0)
        d = np.where(ok, x - mean[g.ids], 0.0)
    return [_arrays.arrow_of(n), _arrays.arrow_of(mean), _arrays.arrow_of(_sums(g, d * d))]


def _merge_moments(g: Groups, n_col, mean_col, m2_col) -> List[pa.Array]:
    """Chan et al.'s exact merge of (n, mean, M2) partials: M2 = sum(M2_i) +
    sum(n_i (mean_i - mean)^2), each deviation taken from the merged mean."""
    n_i, mean_i, m2_i = (_arrays.to_numpy(c) for c in (n_col, mean_col, m2_col))
    n = _sums(g, n_i)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, _sums(g, n_i * mean_i) / n, 0.0)
        dev = np.where(n_i > 0, mean_i - mean[g.ids], 0.0)
    m2 = _sums(g, m2_i) + _sums(g, n_i * dev * dev)
    return [_arrays.arrow_of(n), _arrays.arrow_of(mean), _arrays.arrow_of(m2)]


def _spread(n_col, m2_col, ddof: int, root: bool) -> pa.Array:
    n, m2 = _arrays.to_numpy(n_col), _arrays.to_numpy(m2_col)
    ok = n - ddof > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(ok, m2 / np.where(ok, n - ddof, 1), 0.0)
    return _arrays.from_values(pa.float64(), np.sqrt(var) if root else var, ok)


def _sorted_values(g: Groups, col: pa.Array):
    """The non-null values ordered by (group, value) (NaN after every number, as in polars),
    with each group's count and first position in that order."""
    rows = np.flatnonzero(_valid(col))
    values = _arrays.to_numpy(pc.drop_null(col) if col.null_count else col)
    ids = g.ids[rows]
    # by (group, value) in one argsort of group * n + the value's rank (a quarter of lexsort's
    # time for 2M rows); equal values may come in any order, being equal
    rank = np.empty(len(values), np.int64)
    rank[np.argsort(values)] = np.arange(len(values), dtype=np.int64)
    order = np.argsort(ids * len(values) + rank)
    del rank
    counts = np.bincount(ids, minlength=g.count)
    starts = np.zeros(g.count + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    return rows[order], values[order], counts, starts


def _quantile(g: Groups, col: pa.Array, q: float, how: str) -> pa.Array:
    """polars' quantile of each group's non-null values at position q (n - 1): ``nearest``
    rounds half up, ``linear`` interpolates, ``midpoint`` averages the two neighbours."""
    _, values, counts, starts = _sorted_values(g, col)
    values = values.astype(np.float64, copy=False)
    has = counts > 0
    pos = q * np.maximum(counts - 1, 0)
    lo, hi = np.floor(pos).astype(np.int64), np.ceil(pos).astype(np.int64)
    if how == "nearest":
        lo = hi = np.floor(pos + 0.5).astype(np.int64)
    elif how == "lower":
        hi = lo
    elif how == "higher":
        lo = hi
    if not len(values):
        return pa.nulls(g.count, pa.float64())
    last = len(values) - 1   # an empty group's positions are clipped, its result null
    a = values[np.minimum(starts[:-1] + lo, last)]
    b = values[np.minimum(starts[:-1] + hi, last)]
    with np.errstate(invalid="ignore"):
        if how == "midpoint":
            out = np.where(lo == hi, a, (a + b) / 2)
        elif how == "linear":
            out = np.where(lo == hi, a, a + (pos - lo) * (b - a))
        else:
            out = a
    return _arrays.from_values(pa.float64(), np.ascontiguousarray(out), has)


def _extremes(g: Groups, col: pa.Array, n: int, largest: bool) -> pa.Array:
    """Each group's n largest (descending) or smallest (ascending) non-null values, a list."""
    rows, _, counts, starts = _sorted_values(g, col)
    k = np.minimum(counts, n)
    offsets = np.zeros(g.count + 1, np.int64)
    np.cumsum(k, out=offsets[1:])
    group = np.repeat(np.arange(g.count, dtype=np.int64), k)
    r = np.arange(offsets[-1], dtype=np.int64) - offsets[:-1][group]
    at = starts[:-1][group] + (counts[group] - 1 - r if largest else r)
    items = col.take(_arrays.arrow_of(rows[at]))
    return pa.LargeListArray.from_arrays(_arrays.arrow_of(offsets), items)


def _nunique(g: Groups, col: pa.Array) -> pa.Array:
    """Distinct values per group, a null counting as one (polars' ``n_unique``)."""
    codes, k = _codes(col)
    if g.count * max(k, 1) < 1 << 62:
        # each (group, value) pair as one integer, the distinct ones found by a sort (4-8x
        # faster here than hashing 1M pairs; np.unique's hash path took seconds)
        pairs = np.sort(g.ids * k + codes)
        distinct = pairs[np.concatenate(([True], pairs[1:] != pairs[:-1]))] if len(pairs) \
            else pairs
        return _int64(np.bincount(distinct // k, minlength=g.count))
    pairs = group_ids([_arrays.arrow_of(g.ids), col]).first
    return _int64(np.bincount(g.ids[pairs], minlength=g.count))


def part_names(p: Planned) -> List[str]:
    """The partial columns an aggregation keeps per group and rank."""
    return {"mean": ["sum", "count"], "var": ["n", "mean", "m2"],
            "std": ["n", "mean", "m2"]}.get(p.name, ["value"])


def _native_requests(p: Planned, col: pa.Array):
    """What Arrow's hash aggregation computes for ``p``: its own function, or a mean's sum."""
    if p.name in ("sum", "min", "max"):
        return [(col, p.name)]
    if p.name == "mean":
        return [(col, "sum")]
    return []


def local(columns: Dict[str, pa.Array], g: Groups, planned: Sequence[Planned]) -> List[List[pa.Array]]:
    """Each aggregation's partial columns (:func:`_part_names`) over this rank's rows; for the
    holistic ones, the final values of each group (all its rows are here)."""
    native = _native(g, [r for p in planned for r in _native_requests(p, columns[p.column])])
    native.reverse()
    out = []
    for p in planned:
        col = columns[p.column]
        a = p.agg
        if p.name in ("sum", "min", "max"):
            out.append([native.pop()])
        elif p.name == "mean":
            out.append([native.pop(), _int64(_counts(g, _valid(col)))])
        elif p.name == "count":
            out.append([_int64(_counts(g, _valid(col)))])
        elif p.name == "size":
            out.append([_int64(_counts(g))])
        elif p.name in ("var", "std"):
            out.append(_moments(g, col))
        elif p.name == "first":
            out.append([col.take(_arrays.arrow_of(g.first))])
        elif p.name == "last":
            out.append([col.take(_arrays.arrow_of(g.last))])
        elif p.name in ("nlargest", "nsmallest"):
            out.append([_extremes(g, col, a.n, p.name == "nlargest")])
        elif p.name == "median":
            out.append([_quantile(g, col, 0.5, "linear")])
        elif p.name == "quantile":
            out.append([_quantile(g, col, a.q, a.interpolation)])
        elif p.name == "nunique":
            out.append([_nunique(g, col)])
        else:  # pragma: no cover - plan() admits only the names above
            raise AssertionError(p.name)
    return out


def combine(parts: List[List[pa.Array]], g: Groups, planned: Sequence[Planned]) -> List[List[pa.Array]]:
    """Merge partial rows of the same group (several ranks' partials, in rank order) into one
    partial row per group, exactly as :func:`local` over all their rows would have."""
    native = _native(g, [r for p, cols in zip(planned, parts)
                         for r in _native_requests(p, cols[0])])
    native.reverse()
    out = []
    for p, cols in zip(planned, parts):
        if p.name in ("sum", "min", "max"):
            out.append([native.pop()])
        elif p.name == "mean":
            out.append([native.pop(), _int64(_counts(g, weights=_floats(cols[1])))])
        elif p.name in ("count", "size"):
            out.append([_int64(_counts(g, weights=_floats(cols[0])))])
        elif p.name in ("var", "std"):
            out.append(_merge_moments(g, *cols))
        elif p.name == "first":
            out.append([cols[0].take(_arrays.arrow_of(g.first))])
        elif p.name == "last":
            out.append([cols[0].take(_arrays.arrow_of(g.last))])
        elif p.name in ("nlargest", "nsmallest"):
            lists = cols[0]
            items = lists.flatten()
            parent = _arrays.to_numpy(pc.list_parent_indices(lists)).astype(np.int64)
            inner = Groups(g.ids[parent], g.count, np.zeros(0, np.int64))
            out.append([_extremes(inner, items, p.agg.n, p.name == "nlargest")])
        else:
            raise AssertionError(f"{p.name} has no exact partial result")
    return out


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
