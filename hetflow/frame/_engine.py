"""The compiled local engine: polars, over a rank's Arrow partition.

Each rank's local work (a group-by's partial aggregation and its merge, ...) runs here, on
polars' Rust kernels; hetflow keeps the distributed algorithms and the MPI exchange. polars
takes Arrow arrays without copying fixed-width values (strings it converts to its own
layout) and gives Arrow arrays back.

Memory: :data:`ALLOCATOR`. Threads: polars sizes its thread pool once, from
``POLARS_MAX_THREADS`` when it is first imported. A rank started by a hetflow runtime has it
set to the task's cores per rank (the rank runner sets it with ``OMP_NUM_THREADS``, before the
task's code runs); elsewhere (a program under a bare ``mpiexec``) the first table a rank makes
sets it to the rank's share of the node's cores, as Arrow's pool
(:func:`hetflow.frame._backend.configure_threads`), else :func:`polars` takes
``OMP_NUM_THREADS``, else polars every core. A pool worker keeps the pool its first task sized.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.frame import _arrays

_polars = None

#: polars' allocator (its own jemalloc, configured by ``_RJEM_MALLOC_CONF`` when it starts)
#: hands freed pages back at once instead of after 10 s: a kernel's scratch then leaves the
#: rank's resident set when the kernel returns, and the next one's peak does not stack on it.
#: A group-by's partial aggregation of 2.5M int64 rows of about one group a row (38 MiB), one
#: thread: peak 113 MiB above its start and 41 kept after it (its output is 29) against 147
#: and 102; string keys (45 MiB) 170 and 62 against 250 and 243. Set only where the
#: environment has no setting of its own, and only before polars is first imported.
ALLOCATOR = "dirty_decay_ms:0,muzzy_decay_ms:0"

#: Name of the row-number column the kernels add (rows are read back by it with Arrow's take,
#: which keeps every column's Arrow type as it was).
ROW = "__hetflow_row"


def polars():
    """The polars module, imported with this rank's thread count (see the module docstring)."""
    global _polars
    if _polars is None:
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0 and \
                not os.environ.get("POLARS_MAX_THREADS"):
            os.environ["POLARS_MAX_THREADS"] = threads
        os.environ.setdefault("_RJEM_MALLOC_CONF", ALLOCATOR)
        import polars
        _polars = polars
    return _polars


def frame(columns: Sequence[pa.Array], names: Sequence[str], row: bool = False):
    """A polars DataFrame over Arrow arrays (fixed-width values not copied); ``row``: with a
    :data:`ROW` column numbering the rows."""
    pl = polars()
    columns = [_viewed(c) for c in columns]
    df = pl.from_arrow(pa.Table.from_arrays(columns, names=list(names)), rechunk=False)
    if isinstance(df, pl.Series):  # pragma: no cover - a table always gives a DataFrame
        df = df.to_frame()
    return df.with_row_index(ROW) if row else df


#: Arrow's string and binary views (pyarrow >= 16): polars' own layout, taken without a copy.
_VIEWS = ((pa.types.is_string, pa.types.is_large_string, getattr(pa, "string_view", None)),
          (pa.types.is_binary, pa.types.is_large_binary, getattr(pa, "binary_view", None)))


def _viewed(col):
    """Strings and binaries as Arrow's views where pyarrow has them: Arrow's cast writes the
    views (one pass over the offsets) and polars takes them as they are, where it converts
    offsets and bytes itself at about twice the cost (a 100-value string key, 5M rows, one
    thread: from Arrow and grouped 0.060 s against 0.075 s; 0.050 s from polars' own frame)."""
    t = col.type
    for small, large, view in _VIEWS:
        if view is not None and (small(t) or large(t)):
            return col.cast(view())
    return col


def collect(lazy):
    """``lazy.collect()`` on polars' default engine (from polars 2, its streaming engine runs
    the group-bys it can: 1.7-3.2x faster than the in-memory one, 5M rows, one thread). A
    float aggregation's last bits then depend on the order its partial sums were combined in,
    which varies from run to run, at one thread too (see docs/engine.md)."""
    return lazy.collect()


def arrow(df) -> pa.Table:
    """A polars DataFrame as an Arrow table, each column one chunk."""
    out = df.to_arrow()
    return out.combine_chunks() if any(c.num_chunks != 1 for c in out.columns) else out


def grouped(lazy, names: Sequence[str], keys: Sequence[pa.Array], aggs, holistic: bool):
    """``lazy.group_by(names).agg(aggs)``, the key columns ``names`` holding ``keys``.

    ``holistic`` (an aggregation reads each group's rows: median, quantile, nunique): several
    null-free integer keys whose ranges' product stays below 2**62 are grouped by one int64
    code (each key's offset from its minimum, mixed radix) and read back from it. polars
    groups one integer column faster than several (two int32 keys of 100 values each, 5M
    rows, median and std, one thread: 0.23 s against 0.36 s CPU), and with a holistic
    aggregation it evaluates every aggregation over each group's rows in their order either
    way, so the results are the same to the bit. Without one, polars' single-key path sums
    floats in another order (means and sums differed in the last digit): not packed."""
    pl = polars()
    spans = _key_spans(keys) if holistic else None
    if spans is None:
        return lazy.group_by(list(names)).agg(aggs)
    code, stride = pl.lit(0, pl.Int64), 1
    strides = []
    for name, (lo, span) in reversed(list(zip(names, spans))):
        code = code + (pl.col(name).cast(pl.Int64) - lo) * stride
        strides.append(stride)
        stride *= span
    strides.reverse()
    back = [((pl.col(CODE) // st) % span + lo).cast(lazy.collect_schema()[name]).alias(name)
            for name, (lo, span), st in zip(names, spans, strides)]
    return lazy.with_columns(code.alias(CODE)).group_by(CODE).agg(aggs) \
        .select(back + [pl.all().exclude(CODE)])


#: The one int64 key column of :func:`grouped`'s packed keys.
CODE = "__hetflow_code"


def _key_spans(keys: Sequence[pa.Array]):
    """Each key's (minimum, values in its range) where :func:`grouped` packs them, else None."""
    if len(keys) < 2 or not all(
            pa.types.is_integer(k.type) and not k.null_count and len(k) for k in keys):
        return None
    spans, total = [], 1
    for k in keys:
        lo, hi = (v.as_py() for v in pc.min_max(k).values())
        if hi >= 2**63:   # beyond int64 (a uint64 key)
            return None
        spans.append((lo, hi - lo + 1))
        total *= hi - lo + 1
        if total >= 2**62:
            return None
    return spans


def native(t: pa.DataType) -> bool:
    """Types polars groups, orders and reduces as Arrow does (others go by codes or ranks)."""
    return (pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_date32(t) or pa.types.is_timestamp(t)
            or (pa.types.is_floating(t) and t.bit_width in (32, 64)))


def decoded(col) -> pa.Array:
    """One array, a dictionary's values decoded."""
    col = _arrays._single(col)
    return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col


def sums_fit(col) -> bool:
    """Whether any group's sum of a narrow integer column fits its own type (its rows times
    its largest magnitude do): polars then sums it as it is, exactly, and the partial row
    widens it. Casting each value to 64 bits first cost 45% of a 100-group mean of three
    columns (5M rows, one thread, min of 5 on a loaded machine: 0.075 s against 0.046 s)."""
    col = decoded(col)
    t = col.type
    if not pa.types.is_integer(t) or t.bit_width == 64 or len(col) == 0:
        return False
    lo, hi = (v.as_py() for v in pc.min_max(col).values())
    if lo is None:
        return True
    info = np.iinfo(_arrays._numpy_dtype(t))
    return len(col) * hi <= info.max and len(col) * lo >= info.min


def comparable(col) -> pa.Array:
    """A column as polars compares it for equality: -0.0 as 0.0 (NaN is one value there),
    dictionaries decoded, other types as their values' codes (a null one of them)."""
    col = decoded(col)
    if pa.types.is_floating(col.type):
        return _arrays.unsigned_zero(col)
    if native(col.type):
        return col
    return pc.dictionary_encode(col, null_encoding="encode").indices


def distinct_rows(keys: Sequence[pa.Array]) -> int:
    """How many distinct combinations of ``keys`` there are (a null one value, as NaN, -0.0
    and 0.0)."""
    names = [f"k{i}" for i in range(len(keys))]
    return frame([comparable(k) for k in keys], names).n_unique()


def first_rows(keys: Sequence[pa.Array], side: Optional[np.ndarray] = None,
               keep: str = "any") -> np.ndarray:
    """The row (ascending) where each distinct combination of ``keys`` first appears (a null
    one value, as NaN, -0.0 and 0.0). ``side`` (0 or 1 per row): only the combinations that
    occur on both sides (``keep="both"``), or on side 0 alone (``keep="first"``)."""
    pl = polars()
    names = [f"k{i}" for i in range(len(keys))]
    columns = [comparable(k) for k in keys]
    if side is not None:
        columns.append(_arrays.arrow_of(side))
        names.append("side")
    aggs = [pl.col(ROW).first().alias("first")]
    if side is not None:
        aggs += [pl.col("side").min().alias("lo"), pl.col("side").max().alias("hi")]
    got = frame(columns, names, row=True).lazy().group_by(names[:len(keys)]).agg(aggs)
    if keep == "both":
        got = got.filter((pl.col("lo") == 0) & (pl.col("hi") == 1))
    elif keep == "first":
        got = got.filter(pl.col("hi") == 0)
    return collect(got.select(pl.col("first").sort()))["first"].to_numpy()
