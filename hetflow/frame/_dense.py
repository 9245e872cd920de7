"""Group-by on dense group codes: a rank's sum, mean, count, size, min and max of integer and
float columns by integer, string, binary and temporal keys, in NumPy, where measured faster
than polars' ``group_by`` (:func:`route`).

Each key becomes an integer code per row (an integer key without nulls whose range is within
about twice the rows: its offset from its minimum; any other: Arrow's ``dictionary_encode``,
a null an entry of its own), the keys' codes are combined into one (mixed radix; a range
wider than about twice the rows is encoded again into dense codes), and each aggregation is
one pass over the rows into an array as long as the groups: ``np.bincount`` for counts and
sums (float sums at float64 in row order; integer sums exact: through the float weights only
where every partial sum stays below 2**53, else widened to 64 bits first and added with
``np.add.at`` of one dtype), ``np.minimum.at``/``np.maximum.at`` for an integer column's
minimum and maximum, ``np.fmin.at``/``np.fmax.at`` for a float column's (NaN skipped unless
every value is NaN, as polars' ``min``/``max``), each accumulator of the column's own dtype:
no ``ufunc.at`` leaves NumPy's fast path on a mixed dtype pair (an int32 column added into
an int64 accumulator took 25x the time of int64 values). A column's null rows go to one slot
past the groups, dropped; a sum, min or max of a group with no non-null value is null.

polars' group-by spends most of a many-group call updating each aggregation's state row by
row; these passes do not (measured: :data:`ROUTE`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.frame import _arrays, _engine

#: The aggregations this kernel computes (the partial rows of :mod:`_aggregate`: a mean's are
#: its sum and count).
FUNCS = frozenset({"sum", "mean", "count", "size", "min", "max"})
_EXACT = 1 << 53
_LIMIT = 1 << 62


def _key_type(t: pa.DataType) -> bool:
    """Keys Arrow's ``dictionary_encode`` groups as polars does: equal values, a null one
    group, every NaN one (a float key goes with -0.0 made 0.0 first); dictionaries, whose
    keys keep their type, stay on polars."""
    return (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_boolean(t)
            or pa.types.is_date32(t) or pa.types.is_timestamp(t)
            or (pa.types.is_floating(t) and t.bit_width in (32, 64)))


def _value_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or (pa.types.is_floating(t) and t.bit_width in (32, 64))


def eligible(table: pa.Table, by: Sequence[str], planned) -> bool:
    """Whether every aggregation of ``planned`` and every key of ``by`` can run here."""
    if table.num_rows == 0 or not all(_key_type(table.schema.field(k).type) for k in by):
        return False
    return all(p.name in FUNCS and (p.name in ("count", "size")
                                    or _value_type(table.schema.field(p.column).type))
               for p in planned)


@dataclass
class Codes:
    """Rows numbered by group: ``code[i]`` (int64) is row i's group in ``[0, groups)``,
    ``sizes`` the rows per group, ``keys`` the key columns of the groups in that order."""

    code: np.ndarray
    groups: int
    sizes: np.ndarray
    keys: List[pa.Array]


def _key_codes(key: pa.Array, n: int):
    """A key's code per row (int64) and the values its codes stand for (an Arrow array)."""
    t = key.type
    if pa.types.is_integer(t) and not key.null_count:
        lo, hi = (v.as_py() for v in pc.min_max(key).values())
        if hi - lo < 2 * n + 4096 and hi < 2**63:
            values = _arrays.to_numpy(key)
            code = values.astype(np.int64)
            code -= lo
            return code, _arrays.arrow_of(np.arange(lo, hi + 1, dtype=np.int64)).cast(t)
    if pa.types.is_boolean(t) and not key.null_count:
        return _arrays.to_numpy(key).astype(np.int64), pa.array([False, True])
    if pa.types.is_floating(t):
        key = _arrays.unsigned_zero(key)
    enc = pc.dictionary_encode(key, null_encoding="encode")
    return _arrays.to_numpy(enc.indices).astype(np.int64), enc.dictionary


def codes(keys: Sequence[pa.Array]) -> Optional[Codes]:
    """The rows' group codes, or None where the keys' combined range passes 2**62."""
    n = len(keys[0])
    code, span, parts = None, 1, []
    for key in keys:
        idx, dictionary = _key_codes(_arrays._single(key), n)
        m = max(len(dictionary), 1)
        if span * m >= _LIMIT:
            return None
        if code is None:
            code = idx
        else:
            code *= m
            code += idx
        span *= m
        parts.append((dictionary, m))
    if span > 2 * n + 4096:     # several wide keys: their combinations numbered densely
        enc = pc.dictionary_encode(_arrays.arrow_of(code))
        group = _arrays.to_numpy(enc.dictionary)
        code = _arrays.to_numpy(enc.indices).astype(np.int64)
        sizes = np.bincount(code, minlength=len(group))
    else:
        sizes = np.bincount(code, minlength=span)
        group = np.flatnonzero(sizes)
        if len(group) < span:   # slots no row has: the groups numbered densely
            remap = np.zeros(span, np.int64)
            remap[group] = np.arange(len(group), dtype=np.int64)
            code = remap[code]
            sizes = sizes[group]
    keys_out, rest = [], group.astype(np.int64)
    for dictionary, m in reversed(parts):
        keys_out.append(dictionary.take(_arrays.arrow_of(rest % m)))
        rest = rest // m
    return Codes(code, len(group), sizes, keys_out[::-1])


def _wide(dtype: np.dtype) -> type:
    return np.float64 if dtype.kind == "f" else np.uint64 if dtype.kind == "u" else np.int64


class _Column:
    """One value column's reductions over :class:`Codes` (its null rows sent to the slot
    ``groups``, one past the groups)."""

    def __init__(self, col: pa.Array, g: Codes):
        self.col, self.g = col, g
        self.where, self.count = g.code, g.sizes
        if col.null_count:
            self.where = g.code.copy()
            self.where[~_arrays.to_numpy(col.is_valid())] = g.groups
            self.count = np.bincount(self.where, minlength=g.groups + 1)[:g.groups]
        self._values = None

    def result(self, func: str) -> pa.Array:
        """The column's ``sum``, ``min`` or ``max`` per group (null where it has no value)."""
        got = self.sum() if func == "sum" else self.extreme(func)
        t = pa.from_numpy_dtype(got.dtype) if func == "sum" else self.col.type
        return _arrays.from_values(t, got, None if self.count.all() else self.count > 0)

    @property
    def values(self) -> np.ndarray:
        if self._values is None:
            self._values = _arrays.value_buffer(self.col).view(_arrays._numpy_dtype(self.col.type))
        return self._values

    def sum(self) -> np.ndarray:
        v, slots = self.values, self.g.groups + 1
        wide = _wide(v.dtype)
        if v.dtype.kind == "f":
            return np.bincount(self.where, weights=v, minlength=slots)[:-1]
        lo, hi = (x.as_py() for x in pc.min_max(self.col).values())
        if lo is None or len(v) * max(abs(lo), abs(hi)) < _EXACT:   # every partial sum exact
            return np.bincount(self.where, weights=v, minlength=slots)[:-1].astype(wide)
        acc = np.zeros(slots, wide)
        np.add.at(acc, self.where, v.astype(wide))          # one dtype: NumPy's fast path
        return acc[:-1]

    def extreme(self, func: str) -> np.ndarray:
        v, slots = self.values, self.g.groups + 1
        if v.dtype.kind == "f":
            acc = np.full(slots, np.nan, v.dtype)
            (np.fmin if func == "min" else np.fmax).at(acc, self.where, v)
        else:
            info = np.iinfo(v.dtype)
            acc = np.full(slots, info.max if func == "min" else info.min, v.dtype)
            (np.minimum if func == "min" else np.maximum).at(acc, self.where, v)
        return acc[:-1]


def partials(table: pa.Table, by: Sequence[str], planned) -> Optional[tuple]:
    """The groups' key columns and each aggregation's partial columns (``_aggregate``'s
    :func:`~hetflow.frame._aggregate.part_names`, Arrow's types), or None where the keys do
    not encode (:func:`codes`)."""
    g = codes([table.column(k) for k in by])
    if g is None:
        return None
    funcs: Dict[str, set] = {}
    for p in planned:
        funcs.setdefault(p.column, set()).update({"sum"} if p.name == "mean" else {p.name})
    done = {}
    for name, wanted in funcs.items():   # a column's scratch goes before the next one's
        c = _Column(_arrays._single(table.column(name)), g)
        done[name] = {f: c.result(f) for f in wanted - {"count", "size"}}
        done[name]["count"] = _arrays.from_values(pa.int64(), c.count)
        del c
    size = _arrays.from_values(pa.int64(), g.sizes)
    out = []
    for p in planned:
        got = done[p.column]
        out.append([size] if p.name == "size" else [got["sum"], got["count"]]
                   if p.name == "mean" else [got[p.name]])
    return g.keys, out


#: Groups from which a group-by whose keys are hashed (a string, binary, float or temporal
#: key, an integer one of a wide range or with nulls) runs here: below it, polars' group-by
#: was as fast or faster (one rank, 5M rows, one thread, CPU s, median of 3, load 7-18: a
#: 100-value string key's sum 0.085 s against 0.204 here, 1k values 0.121 against 0.151, 10k
#: 0.188 against 0.165; sum/mean/count/min/max of two columns 0.22 / 0.21 / 0.40 against 0.26
#: / 0.23 / 0.35; 100k values 1.16 against 0.63 s, a 5 x 100k-value pair 1.87 against 0.91).
MANY_GROUPS = 5000
#: Rows of the sample :func:`estimate_groups` counts the groups of.
SAMPLE_ROWS = 1 << 15


def route(table: pa.Table, by: Sequence[str], planned) -> str:
    """``"dense"`` (this kernel) or ``"polars"`` for a non-holistic group-by of ``table``.

    Integer and boolean keys without nulls whose ranges' product is within about twice the
    rows are numbered by their offsets, no hashing: here (a 100-value int32 key's mean of
    three columns 0.048 s against polars' 0.055, a 1000-value one 0.049 against 0.055; the
    100k-value key's sums of three columns 0.074 against 0.26). Keys that are hashed: here
    from :data:`MANY_GROUPS` groups (:func:`estimate_groups`), but for several keys of about
    one group a row, whose combinations are encoded again (six keys, 5M rows in 5M groups:
    4.2 s here against polars' 2.6; one string key of about one group a row 1.25 against
    1.56, here)."""
    if not eligible(table, by, planned):
        return "polars"
    n, span = table.num_rows, 1
    for name in by:
        key = _arrays._single(table.column(name))
        if key.null_count or not (pa.types.is_integer(key.type) or pa.types.is_boolean(key.type)):
            span = None
            break
        if pa.types.is_integer(key.type):
            lo, hi = (v.as_py() for v in pc.min_max(key).values())
            span *= hi - lo + 1
        else:
            span *= 2
        if span > 2 * n + 4096:
            span = None
            break
    if span is not None:
        return "dense"
    groups = estimate_groups(table, by)
    if groups < MANY_GROUPS or (len(by) > 1 and groups > n / 2):
        return "polars"
    return "dense"


def estimate_groups(table: pa.Table, by: Sequence[str]) -> float:
    """The groups of ``table``'s rows by ``by``: counted under ``4 * SAMPLE_ROWS`` rows, else
    estimated from a seeded sample of about SAMPLE_ROWS rows, drawn uniformly (a sorted
    table's groups are not read as more than they are): ``d`` groups seen in ``s`` rows drawn
    evenly from ``G`` give ``d = G (1 - exp(-s / G))``, and the table's ``n`` rows hold
    ``G (1 - exp(-n / G))`` of them."""
    n = table.num_rows
    if n < 4 * SAMPLE_ROWS:
        return float(_engine.distinct_rows([table.column(k) for k in by]))
    picked = np.random.default_rng(41).integers(0, n, SAMPLE_ROWS)
    picked.sort()
    picked = picked[np.concatenate(([True], picked[1:] != picked[:-1]))]  # distinct rows
    sample = table.select(list(by)).take(_arrays.arrow_of(picked))
    return groups_among(_engine.distinct_rows([sample.column(k) for k in by]), len(picked), n)


def groups_among(seen: int, sample: int, rows: int) -> float:
    """The groups among ``rows`` rows drawn as ``sample`` rows that held ``seen`` groups."""
    if seen >= sample:
        return float(rows)
    lo, hi = float(seen), float(seen)
    while hi * -np.expm1(-sample / hi) < seen:      # G (1 - exp(-s / G)) rises with G
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * -np.expm1(-sample / mid) < seen else (lo, mid)
    return hi * -np.expm1(-rows / hi)


def run(table: pa.Table, by: Sequence[str], planned) -> Optional[tuple]:
    """:func:`partials` where :func:`route` picks this kernel, else None (polars runs it)."""
    return partials(table, by, planned) if route(table, by, planned) == "dense" else None
