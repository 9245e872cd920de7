"""The distributed sample sort: the result is globally ordered, rank i's rows before rank i+1's."""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError, InputError
from hetflow.frame import (_arrays, _backend, _check, _cylon_rules, _engine, _exchange,
                           _localjoin, _localsort, _pycylon)
from hetflow.frame._agreement import step
from hetflow.frame._phases import phase
from hetflow.frame._prepare import prepare, require_table, small
from hetflow.frame._table import DistributedTable

_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean,
            lambda t: pa.types.is_temporal(t) and not pa.types.is_interval(t))


def _is_numeric(t: pa.DataType) -> bool:
    return any(f(t) for f in _NUMERIC) and not pa.types.is_float16(t)


def sort(table: DistributedTable, by, ascending: Union[bool, Sequence[bool]] = True, *,
         backend: Optional[str] = None) -> DistributedTable:
    """Distributed sample sort: the result is globally ordered by ``by``.

    Rank i's rows all sort before (or equal to) rank i+1's. Nulls go last whatever the
    direction (pandas' default ``na_position="last"``), float NaN just before them. The sort is
    stable with respect to the ranks-in-order concatenation of the input. Each row's key is made
    unique by its origin (rank, position) when it is placed, so even a single key repeated on
    every row is spread evenly over the ranks. A single null-free numeric key is partitioned
    first, by splitters sampled from the unsorted rows, and each rank's rows sorted once (see
    :func:`_sort_numeric`); other keys are sorted locally, split by regular sampling of the
    sorted rows, exchanged, and sorted again.
    """
    table = require_table(table, "sort: table")
    comm = table.comm
    names = _check.key_names(by, "sort")
    if isinstance(ascending, bool):
        asc = [ascending] * len(names)
    else:
        asc = list(ascending)
        if len(asc) != len(names) or not all(isinstance(a, bool) for a in asc):
            raise ConfigError(f"sort: ascending must be a bool or one bool per key column "
                              f"({len(names)}), got {ascending!r}")
    schema = table.local.schema
    key_nulls = [table.local.column(n).null_count if schema.get_field_index(n) >= 0 else 0
                 for n in names]

    def sortable():
        for n in names:
            t = schema.field(n).type
            if pa.types.is_nested(t) or pa.types.is_null(t):
                raise InputError(f"sort: cannot sort by column {n!r} of type {t}")

    prep = prepare("sort", [table], [names], backend=backend, check=sortable,
                   facts={"small": small(table.local), "rows": table.local.num_rows,
                          "key_nulls": key_nulls},
                   cylon=lambda: _cylon_rules.sort(comm.Get_size(), table.local, names))
    if prep.pycylon:
        try:
            return prep.result(_pycylon.sort(comm, table.local, names, asc), backend="pycylon")
        except _pycylon.Declined as exc:
            prep = prep.without_pycylon("sort", str(exc))
    be, agreed = prep.backend, prep.agreed
    fast = (len(names) == 1 and _is_numeric(schema.field(names[0]).type)
            and not any(agreed.total("key_nulls")))
    if fast:
        out = _sort_numeric(comm, table.local, names[0], not asc[0], be,
                            batched=agreed.every("small"), rows=agreed.total("rows"))
    else:
        out = _sort_general(comm, table.local, names, asc)
        be = "cpu"
    return prep.result(out, backend=be)


def _sort_numeric(comm, table: pa.Table, name: str, descending: bool, be: str,
                  batched: bool = False, rows: int = 0) -> pa.Table:
    """Sample sort of a null-free numeric key, partitioning first: splitters from a sample of
    the unsorted rows, every row sent to the rank its key falls to (ties split by the row's
    origin, rank then position), and each rank's received rows sorted once.

    Sorting locally first, then exchanging the sorted runs and merging them, sorts every row
    twice (the radix sort and the merge) and packs each column in sorted order: a random
    gather. Here a rank packs its rows in their input order (reads in sequence) and its only
    random gather is the final one, which a one-rank sort makes too. The received rows lie in
    (origin rank, position) order and the local sort is stable, so the result is stable with
    respect to the ranks-in-order input, as the splitters' tie-break requires. ``batched``:
    every rank's partition is small (:func:`~hetflow.frame._prepare.small`): all columns
    move in one exchange.
    ``rows``: the rows of all ranks (they set how many rows are sampled).

    An integer key whose values all lie within 2**32 of the smallest (over all ranks) moves and
    is sorted as its uint32 offset from it (:func:`_localsort.narrow`), and is widened back
    when gathered into the output: half the key's bytes on the wire, and its receive buffer,
    alive through the local sort, half as large.
    """
    size = comm.Get_size()
    xp = _backend.array_module(be)
    column = table.column(name)
    if size == 1:
        with phase("local"):
            return table.take(_arrays.arrow_of(_localsort.sort_order(xp, column, descending)))
    values = _localsort.key_values(column)
    with phase("sample"):
        sk, sr, sp, lo, span = _splitters(comm, values, descending, rows)
    # the same on every rank (a collective decision: it sets the key's bytes on the wire),
    # whatever each rank's backend
    narrow = (not batched and span is not None and span < 2**32 and
              _localsort.narrow_kinds(values.dtype))
    with phase("partition"):
        if narrow:
            keys = _localsort.narrow(values, descending, lo)
            dest, counts = _sort_destinations(keys, (sk - lo).astype(np.uint32), sr, sp, comm)
        elif values.dtype.kind == "i" and not descending:  # signed ascending: the values' order
            dest, counts = _sort_destinations(values, (sk ^ _localsort._SIGN).view(np.int64)
                                      .astype(values.dtype), sr, sp, comm)
        else:
            dest, counts = _sort_destinations(_localsort.numeric_key(values, descending), sk,
                                              sr, sp, comm)
    order, offsets = _exchange.split_by(dest, size, counts)
    if batched or not narrow:
        del dest
    ex = _exchange.RowExchange(comm, order, offsets, table)
    del order
    key_index = table.schema.get_field_index(name)
    columns: List[Optional[pa.Array]] = [None] * table.num_columns
    if batched:
        # small partitions: every column in one exchange (latency-bound), then one gather each
        got = _exchange.fetch_together([(ex, i) for i in range(table.num_columns)])
        ex.release()
        with step(comm, "sort: the local sort"), phase("local"):
            local = _localsort.sort_order(xp, got[key_index], descending)
            for i in range(table.num_columns):
                columns[i] = _localjoin.take(got[i], local, False)
                got[i] = None
        return pa.Table.from_arrays(columns, schema=table.schema)
    # The key first, to sort on; then every other column is fetched and gathered into place
    # one at a time, so a column's receive buffer is freed before the next one arrives.
    if narrow:
        received = _arrays.to_numpy(ex.column(_arrays.arrow_of(keys)))
        del keys
        # The routing (4 bytes a row) is rebuilt from the destinations (1 byte) after the local
        # sort, whose temporaries are the operation's peak: a 2-rank sort of 2M rows per rank
        # then peaks at ~2.9x its partition, not ~3.2x.
        ex.order = None
        with step(comm, "sort: the local sort"), phase("local"):
            local = (_localsort.radix_argsort(received) if xp is np else
                     xp.asnumpy(xp.argsort(xp.asarray(received))))
            columns[key_index] = _arrays.from_values(column.type, _localsort.widen(
                _arrays.gather(received, local), descending, lo, values.dtype))
    else:
        received = ex.column(key_index)
        with step(comm, "sort: the local sort"), phase("local"):
            local = _localsort.sort_order(xp, received, descending)
            columns[key_index] = _localjoin.take(received, local, False)
    del received, values
    rest = [i for i in range(table.num_columns) if i != key_index]
    if narrow and rest:
        ex.order = _exchange.split_by(dest, size, counts)[0]
        del dest
    if not rest:
        ex.release()
    for i in rest:
        received = ex.column(i)
        if i == rest[-1]:
            ex.release()  # every column has arrived: the routing is no longer needed
        with phase("local"):
            columns[i] = _localjoin.take(received, local, False)
        del received
    return pa.Table.from_arrays(columns, schema=table.schema)


def _samples_per_rank(size: int, rows: int = 0) -> int:
    """Sample rows per rank for the splitters (the same on every rank: ``rows`` is the rows of
    all ranks). With s random samples per rank, a rank's share of the rows is off an even one
    by about 1/sqrt(s) of it (one standard deviation, whatever the rank count): ~3% with
    1,024, ~6% with 256. The operation waits for its fullest rank, so larger partitions take
    more: one sample per :data:`ROWS_PER_SAMPLE` rows of the average rank (sorting them costs
    about a hundredth of the local sort), at least 1,024 (up to 256 ranks; 256 from 1,024
    ranks) and at most 2**18 in all. 2 ranks of 2M rows: 7,812 each, ~1.1%. Regular sampling
    of locally sorted rows bounds it (the other keys' path), but needs the local sort first.
    Every rank gathers all samples (at most 4 MiB), then sorts them."""
    base = max(256, min(1024, (1 << 18) // size))
    return max(base, min(rows // size // ROWS_PER_SAMPLE, (1 << 18) // size))


#: Rows of the average rank per splitter sample, above the 1,024 samples per rank every sort
#: takes (see :func:`_samples_per_rank`).
ROWS_PER_SAMPLE = 256
#: More samples than this (of all ranks) are ordered by the radix argsort (0.17 ms for 16k
#: samples, against 0.8 ms for NumPy's stable comparison sort of their 64-bit keys).
RADIX_SAMPLES = 8192


def _splitters(comm, values: np.ndarray, descending: bool, total_rows: int = 0):
    """The p - 1 splitters of the sample sort, as uint64 keys, origin ranks and positions, the
    same on every rank (collective); then the smallest key of all ranks and the span above it
    (None without rows, or for float keys).

    Each rank samples one row, at a seeded random place, from each of ``s`` equal strata of
    its rows (robust to input that repeats with some period, and reproducible); the samples,
    weighted by the rows each stands for (a rank with more rows weighs more), are ordered by
    (sort key, origin rank, position) and cut at every 1/p of the total weight. The key is
    :func:`_localsort.numeric_key`'s uint64 (its order is the sort order). ``total_rows``: the
    rows of all ranks (see :func:`_samples_per_rank`).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    n = len(values)
    cap = _samples_per_rank(size, total_rows)
    m = min(n, cap)
    if m == n:
        pos = np.arange(n, dtype=np.int64)
    else:
        starts = (np.arange(m + 1, dtype=np.int64) * n) // m
        rng = np.random.default_rng([rank, n])
        pos = starts[:-1] + (rng.random(m) * np.diff(starts)).astype(np.int64)
    # One fixed-size non-blocking allgather (a slower rank is waited for asleep): per rank its
    # sample count, row count, smallest and largest key, then up to cap keys and positions.
    mine = np.zeros(4 + 2 * cap, np.int64)
    mine[0], mine[1] = m, n
    if n and _localsort.narrow_kinds(values.dtype):
        mine[2:4] = np.array(_localsort.key_range(values, descending), np.uint64).view(np.int64)
    mine[4:4 + m] = _localsort.numeric_key(values[pos], descending).view(np.int64)
    mine[4 + cap:4 + cap + m] = pos
    every = np.empty((size, len(mine)), np.int64)
    _exchange.wait_all([comm.Iallgather(mine, every)])
    counts, rows = every[:, 0], every[:, 1]
    keys = np.concatenate([every[r, 4:4 + c] for r, c in enumerate(counts)]).view(np.uint64)
    ranks = np.repeat(np.arange(size, dtype=np.int64), counts)
    positions = np.concatenate([every[r, 4 + cap:4 + cap + c] for r, c in enumerate(counts)])
    # by (key, rank, position): the samples lie in rank order, each rank's by position (its
    # strata ascend), so a stable sort by key alone gives that order (a third of lexsort's time)
    g = (_localsort.radix_argsort(keys) if len(keys) > RADIX_SAMPLES else
         np.argsort(keys, kind="stable"))
    if not len(g):  # no rows anywhere
        none = np.zeros(size - 1, np.int64)
        return none.view(np.uint64), none, none, None, None
    weight = np.cumsum((rows / np.maximum(counts, 1))[ranks[g]])
    cut = np.searchsorted(weight, weight[-1] * np.arange(1, size) / size, side="right")
    pick = g[np.minimum(cut, len(g) - 1)]
    lo = span = None
    if _localsort.narrow_kinds(values.dtype):
        ranges = every[rows > 0, 2:4].view(np.uint64)
        lo = ranges[:, 0].min()
        span = int(ranges[:, 1].max()) - int(lo)
    return keys[pick], ranks[pick], positions[pick], lo, span


def _sort_destinations(keys: np.ndarray, bounds: np.ndarray, sr: np.ndarray, sp: np.ndarray,
                       comm) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Each row's rank, the number of splitters at or below (its key, this rank, its position),
    and the rows per rank where the comparisons count them (else None).

    ``keys`` and the splitters' keys ``bounds`` are in the same order-preserving domain. A few
    ranks: one comparison pass per splitter; more: a binary search of the splitter keys. A row
    whose key equals a splitter's is placed by (rank, position) against it.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    n = len(keys)
    small = _arrays.destination_dtype(size)
    if size - 1 <= _exchange._SCAN_PARTS:
        dest = _arrays.empty(n, small)
        dest.fill(0)
        above = _arrays.empty(n, bool)
        at_least = np.zeros(size + 1, np.int64)  # rows sent to rank d or above
        at_least[0] = n
        for j in range(size - 1):
            b = bounds[j]
            if rank > sr[j]:
                np.greater_equal(keys, b, out=above)
            else:
                np.greater(keys, b, out=above)
                if rank == sr[j]:
                    ties = np.flatnonzero(keys == b)
                    above[ties[np.searchsorted(ties, sp[j]):]] = True
            dest += above.view(np.uint8)
            at_least[j + 1] = np.count_nonzero(above)
        return dest, at_least[:-1] - at_least[1:]
    lo = np.searchsorted(bounds, keys, side="left")
    hi = np.searchsorted(bounds, keys, side="right")
    ties = np.flatnonzero(hi != lo)
    if len(ties):
        first = lo[ties]
        for a in np.unique(first):
            rows = ties[first == a]
            b = int(hi[rows[0]])
            before = int(np.count_nonzero(sr[a:b] < rank))
            mine = sp[a:b][sr[a:b] == rank]
            lo[rows] = a + before + np.searchsorted(mine, rows, side="right")
    return lo.astype(small), None


_NULL_CLASS, _NAN_CLASS = 2, 1


def _value_class(v) -> int:
    if v is None:
        return _NULL_CLASS
    if isinstance(v, float) and v != v:
        return _NAN_CLASS
    return 0


def _compare_keys(a, b, asc: Sequence[bool]) -> int:
    """Compare two key tuples the way Arrow sorts (nulls, then NaN, last in both directions)."""
    for x, y, up in zip(a, b, asc):
        cx, cy = _value_class(x), _value_class(y)
        if cx != cy:
            return -1 if cx < cy else 1
        if cx or x == y:
            continue
        r = -1 if x < y else 1
        return r if up else -r
    return 0


def _sort_general(comm, table: pa.Table, names: List[str], asc: List[bool]) -> pa.Table:
    size, rank = comm.Get_size(), comm.Get_rank()
    order = _sort_indices(table, names, asc)
    if size == 1:
        return table.take(order)
    order_np = _arrays.to_numpy(order)
    # the sorted keys are read where the sampling and the search look, through the order:
    # no sorted copy of the key columns (for string keys most of the partition)
    cols = [table.column(name) for name in names]

    def key_at(p: int) -> tuple:
        return tuple(c[int(order_np[p])].as_py() for c in cols)

    n = table.num_rows
    m = min(n, 32 * size)  # regular sampling of the sorted rows: within ~1/32 of an even share
    pos = [(i * n) // m for i in range(m)]
    samples = [(key_at(p), rank, p) for p in pos]
    everything = [s for part in comm.allgather(samples) for s in part]

    def full_cmp(a, b):
        c = _compare_keys(a[0], b[0], asc)
        return c if c else (-1 if (a[1], a[2]) < (b[1], b[2]) else (1 if (a[1], a[2]) > (b[1], b[2]) else 0))

    everything.sort(key=functools.cmp_to_key(full_cmp))
    total = len(everything)
    bounds = [0]
    for j in range(1, size):
        if not total:
            bounds.append(0)
            continue
        split = everything[(j * total) // size]
        lo, hi = bounds[-1], n  # boundaries are monotone: search right of the previous one
        while lo < hi:
            mid = (lo + hi) // 2
            row = (key_at(mid), rank, mid)
            if full_cmp(row, split) < 0:
                lo = mid + 1
            else:
                hi = mid
        bounds.append(lo)
    bounds.append(n)
    parts = _exchange.exchange_rows(comm, table, order_np, bounds)
    order = order_np = cols = None  # freed before the local sort's indices and its output
    with step(comm, "sort: the local sort"):
        out = parts.take(_sort_indices(parts, names, asc))
    return out


def _is_binary_like(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t))


def _sort_indices(table: pa.Table, names: List[str], asc: List[bool]) -> pa.Array:
    """Stable sort indices on the compiled engine (polars), Arrow's order: nulls at the end of
    every key, NaN after every number in both directions (polars puts NaN first when
    descending: a float key is preceded by its is-NaN flag), dictionaries by their values.
    One string or binary key: Arrow's stable sort, in place of polars' (2.5M strings of 26 MiB,
    one thread: 29 MiB above the start at its peak against 124 for polars' conversion to its
    own layout and its sort's scratch; its time within this machine's noise of polars')."""
    if len(names) == 1:
        col = _engine.decoded(table.column(names[0]))
        if _is_binary_like(col.type):
            return pc.array_sort_indices(col, order="ascending" if asc[0] else "descending")
    pl = _engine.polars()
    columns, exprs, descending = [], [], []
    for i, (name, up) in enumerate(zip(names, asc)):
        col = _engine.decoded(table.column(name))
        columns.append(col)
        if pa.types.is_floating(col.type):
            exprs.append(pl.col(f"k{i}").is_nan())
            descending.append(False)
        exprs.append(pl.col(f"k{i}"))
        descending.append(not up)
    df = _engine.frame(columns, [f"k{i}" for i in range(len(names))])
    order = df.select(pl.arg_sort_by(exprs, descending=descending, nulls_last=True,
                                     maintain_order=True).alias("o"))
    return _arrays._single(_engine.arrow(order).column(0))
