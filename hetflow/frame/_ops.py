"""Collective operations: shuffle, join, sort, groupby-aggregate, unique.

Each one validates collectively first (:mod:`hetflow.frame._check`), so bad input raises the same
typed error on every rank before any rank enters a data collective.
"""
from __future__ import annotations

import functools
import logging
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError, InputError, SchemaMismatch
from hetflow.frame import (_arrays, _backend, _broadcast, _check, _exchange, _hash, _localjoin,
                           _localsort)
from hetflow.frame._exchange import MPI
from hetflow.frame._phases import phase
from hetflow.frame._table import DistributedTable

log = logging.getLogger("hetflow.frame")


def _require_table(value, what: str) -> DistributedTable:
    if not isinstance(value, DistributedTable):
        raise InputError(f"{what} must be a hetflow.frame.DistributedTable, got "
                         f"{type(value).__name__}")
    return value


# -- shuffle ----------------------------------------------------------------------------------
def _shuffle_local(comm, table: pa.Table, keys: Sequence[str], backend: str) -> pa.Table:
    """Exchange rows so that every row lands on rank ``hash(keys) % size`` (collective)."""
    size = comm.Get_size()
    if size == 1:
        return table
    xp = _backend.array_module(backend)
    dest = _hash.partition_of(xp, table, keys, size)
    order, offsets = _exchange.split_by(dest, size)
    del dest
    return _exchange.exchange_rows(comm, table, order, offsets)


def shuffle(table: DistributedTable, on, *, backend: Optional[str] = None) -> DistributedTable:
    """Hash-partition ``table`` by the ``on`` columns: equal keys land on the same rank.

    The destination depends only on the key values (never on the process), so two tables
    shuffled on keys of the same types are co-partitioned. Rows keep their relative order
    within each source rank; received rows are ordered by source rank.
    """
    table = _require_table(table, "shuffle: table")
    names = _check.key_names(on, "shuffle")
    _check.agree(table.comm, [table.local.schema])
    _check.check_columns(table.local.schema, names, "shuffle")
    if _backend.requested_name(backend) == "pycylon":
        from hetflow.frame import _pycylon
        return _pycylon.shuffle(table, names)
    be = _backend.resolve(backend)
    _backend.heap_pad_for(table.local.nbytes)
    out = _shuffle_local(table.comm, table.local, names, be)
    return DistributedTable(table.comm, out, backend=be if table.comm.Get_size() > 1 else "cpu")


# -- join -------------------------------------------------------------------------------------
_HOW = {"inner": "inner", "left": "left outer", "right": "right outer", "outer": "full outer",
        "full": "full outer", "semi": "left semi", "anti": "left anti"}


def join(left: DistributedTable, right: DistributedTable, on=None, *, how: str = "inner",
         left_on=None, right_on=None, suffixes=("_x", "_y"),
         backend: Optional[str] = None) -> DistributedTable:
    """Distributed join: shuffle both sides on their keys (one integer key by ``key mod P``
    where that spreads both sides evenly, else by hash), then a local join.

    ``how`` is ``"inner"``, ``"left"``, ``"right"``, ``"outer"`` (alias ``"full"``), ``"semi"`` or
    ``"anti"``. Keys are ``on`` (same names on both sides) or ``left_on``/``right_on``; the key
    columns appear once in the result, under the left names, with values coalesced from both
    sides for outer joins (polars' ``coalesce=True``). Non-key columns present on both sides get
    ``suffixes``. Null keys never match each other (SQL and polars semantics; pandas' ``merge``
    does match NaN/None keys). Key types must be identical on both sides.
    """
    left = _require_table(left, "join: left")
    right = _require_table(right, "join: right")
    comm = left.comm
    if how not in _HOW:
        raise ConfigError(f"join: how={how!r} is not one of {sorted(_HOW)}")
    if MPI.Comm.Compare(comm, right.comm) not in (MPI.IDENT, MPI.CONGRUENT):
        raise InputError("join: left and right live on different communicators")
    if on is not None and (left_on is not None or right_on is not None):
        raise ConfigError("join: give either on= or left_on=/right_on=, not both")
    if on is not None:
        lk = rk = _check.key_names(on, "join")
    else:
        if left_on is None or right_on is None:
            raise ConfigError("join: no keys: give on= or both left_on= and right_on=")
        lk = _check.key_names(left_on, "join left_on")
        rk = _check.key_names(right_on, "join right_on")
        if len(lk) != len(rk):
            raise ConfigError(f"join: left_on has {len(lk)} columns but right_on has {len(rk)}")
    if not (isinstance(suffixes, (tuple, list)) and len(suffixes) == 2):
        raise ConfigError(f"join: suffixes must be a pair of strings, got {suffixes!r}")
    key_nulls = [_null_count(left.local, lk), _null_count(right.local, rk)]
    residues, counts = _modular_candidate(comm, left.local, right.local, lk, rk, how)
    # up to MODULAR_MAX_PARTS ranks the counts ride in the check (no round of their own)
    in_check = counts is not None and comm.Get_size() <= _hash.MODULAR_MAX_PARTS
    facts = _check.agree(comm, [left.local.schema, right.local.schema], what=("left", "right"),
                         facts=[int(_small(left.local, right.local))] + key_nulls +
                         [int(left.local.nbytes), int(right.local.nbytes)] +
                         ([int(c) for c in counts] if in_check else []))
    _check.check_columns(left.local.schema, lk, "join", "left table")
    _check.check_columns(right.local.schema, rk, "join", "right table")
    for a, b in zip(lk, rk):
        ta, tb = left.local.schema.field(a).type, right.local.schema.field(b).type
        if ta != tb:
            raise SchemaMismatch(f"join: key types differ: left {a!r} is {ta} but right {b!r} is "
                                 f"{tb}; cast one side so both keys have the same type")
    if _backend.requested_name(backend) == "pycylon":
        from hetflow.frame import _pycylon
        return _pycylon.join(left, right, lk, rk, how, suffixes)
    be = _backend.resolve(backend)
    _backend.heap_pad_for(left.local.nbytes + right.local.nbytes)
    if _broadcast.chosen(how, [f[3] for f in facts], [f[4] for f in facts]):
        out = _broadcast.join(comm, _canonical_zero(left.local, lk),
                              _canonical_zero(right.local, rk), lk, rk, how, tuple(suffixes))
        return DistributedTable(comm, out, backend=be)
    no_null_keys = not any(f[1] + f[2] for f in facts)
    if no_null_keys and _localjoin.fast_key_ok(left.local.schema, right.local.schema, lk, rk, how):
        if counts is not None and not _modular_agreed(
                comm, [f[5:] for f in facts] if in_check else counts):
            residues = None
        out = _join_streamed(comm, left.local, right.local, lk[0], rk[0], how, tuple(suffixes),
                             be, residues, batched=all(f[0] for f in facts))
        return DistributedTable(comm, out, backend=be if comm.Get_size() > 1 else "cpu")
    lt = _shuffle_local(comm, _canonical_zero(left.local, lk), lk, be)
    rt = _shuffle_local(comm, _canonical_zero(right.local, rk), rk, be)
    del left, right  # the caller still holds them; we only drop our references
    with phase("local"):
        out = _localjoin.join(lt, rt, lk, rk, how, tuple(suffixes))
    return DistributedTable(comm, out, backend=be if comm.Get_size() > 1 else "cpu")


def _modular_candidate(comm, left: pa.Table, right: pa.Table, lk, rk, how: str):
    """Both sides' :func:`~hetflow.frame._hash.modular_partition` with its rows per
    destination, as pairs (or None), and this rank's rows per destination over both sides
    (-1s where this rank cannot use it); ``(None, None)`` where the
    arguments rule it out. Those depend only on what every rank passes alike (the rank
    count, the key names, ``how``), so every rank has counts, or none has."""
    size = comm.Get_size()
    if not (size > 1 and len(lk) == 1 and len(rk) == 1 and how in _localjoin.FAST_HOW):
        return None, None
    sides = ((left, lk[0]), (right, rk[0]))
    if not all(t.schema.get_field_index(k) >= 0 and not t.column(k).null_count
               and _hash.is_integer_like(t.schema.field(k).type) for t, k in sides):
        return None, np.full(size, -1, np.int64)
    with phase("partition"):
        residues = [_hash.modular_partition(t.column(k), size) for t, k in sides]
        per_side = [_exchange.destination_counts(r, size) for r in residues]
    # each side's counts travel with its residues (its routing needs them: no second count)
    return list(zip(residues, per_side)), per_side[0] + per_side[1]


def _modular_agreed(comm, counts) -> bool:
    """Whether every rank could use the modular partition and it spreads the rows of all of
    them evenly enough (the same answer on every rank). ``counts``: every rank's rows per
    destination as the check gathered them (a list of lists), or this rank's alone, summed
    here over the ranks with one ``Iallreduce`` (beyond :data:`MODULAR_MAX_PARTS` ranks)."""
    if isinstance(counts, list):
        every = np.asarray(counts, np.int64)
        return bool((every >= 0).all()) and _hash.modular_balanced(every.sum(axis=0))
    mine = np.zeros(len(counts) + 1, np.int64)  # the rows per destination, then "cannot"
    if (counts < 0).any():
        mine[-1] = 1
    else:
        mine[:-1] = counts
    total = np.empty_like(mine)
    _exchange.wait_all([comm.Iallreduce(mine, total, op=MPI.SUM)])
    return not total[-1] and _hash.modular_balanced(total[:-1])


def _null_count(table: pa.Table, names: Sequence[str]) -> int:
    """Nulls in the ``names`` columns that exist (missing ones are reported collectively later)."""
    return sum(table.column(n).null_count for n in names if table.schema.get_field_index(n) >= 0)


def _join_streamed(comm, left: pa.Table, right: pa.Table, lkey: str, rkey: str, how: str,
                   suffixes, be: str, residues=None, batched: bool = False) -> pa.Table:
    """Join on one null-free integer key with late materialisation: only the key columns are
    shuffled before the local match; each payload column is then shuffled when the output
    gathers it and dropped right after. A rank holds its input, its output and about one
    column in flight, instead of a shuffled copy of both tables beside the output. Small
    partitions (:data:`BATCH_BYTES`) move every column of both sides in one exchange instead:
    there the waits for the peers, not the memory, are what costs.

    ``residues``: both sides' destinations by the modular partition and their rows per
    destination, agreed on by every rank (the local match then addresses keys by their
    quotient); else the rows are hashed. ``batched``: every rank's partitions are small (see
    :func:`_small`)."""
    if comm.Get_size() == 1:   # nothing moves: the columns as they are
        fetch_left, fetch_right = _column_of(left), _column_of(right)
        keys = {"left": fetch_left(lkey), "right": fetch_right(rkey)}
    else:
        keys, fetch_left, fetch_right = _shuffled_keys(comm, left, right, lkey, rkey, be,
                                                       residues, batched)
    stride = comm.Get_size() if residues is not None else 1
    with phase("local"):  # the payload columns' exchange, nested in assemble, is its own phase
        li, ri = _localjoin.match(keys["left"], keys["right"], how, stride)
        return _localjoin.assemble(left.schema, right.schema, lkey, rkey, li, ri, how, suffixes,
                                   fetch_left, fetch_right, keys)


def _shuffled_keys(comm, left: pa.Table, right: pa.Table, lkey: str, rkey: str, be: str,
                   residues=None, batched: bool = False):
    """Route both tables' rows by their key's partition (collective): this rank's key columns
    (``{"left": ..., "right": ...}``) and a ``name -> column`` fetch per side for the rest.
    ``residues``: the two sides' destinations and rows per destination, already chosen (else
    the keys are hashed)."""
    size = comm.Get_size()
    xp = _backend.array_module(be)
    routes = []
    for i, (table, key) in enumerate(((left, lkey), (right, rkey))):
        counts = None
        if residues is not None:
            dest, counts = residues[i]
        else:
            dest = _hash.partition_of(xp, table, [key], size)
        order, offsets = _exchange.split_by(dest, size, counts)
        del dest
        routes.append((order, offsets, table))
        del order
    left_route, right_route = _exchange.RowExchange.several(comm, routes)
    del routes
    if not batched:
        return ({"left": left_route.column(lkey), "right": right_route.column(rkey)},
                left_route.column, right_route.column)
    # small partitions: every column of both sides in one exchange (latency-bound)
    requests = ([(left_route, i) for i in range(left.num_columns)] +
                [(right_route, i) for i in range(right.num_columns)])
    got = _exchange.fetch_together(requests)
    left_cols = dict(zip(left.schema.names, got[:left.num_columns]))
    right_cols = dict(zip(right.schema.names, got[left.num_columns:]))
    del got
    keys = {"left": left_cols.pop(lkey), "right": right_cols.pop(rkey)}
    return keys, left_cols.pop, right_cols.pop


def _column_of(table: pa.Table):
    """``name -> the column as one array``: what a one-rank exchange would give, without
    checking that its row order is the identity (a pass over every row of the table)."""
    return lambda name: _arrays._single(table.column(name))


#: Below this many bytes of partitions on a rank, an operation moves all their columns in one
#: exchange (a few MiB moves in well under a millisecond; each extra wait for the peers costs
#: more on a busy node); above it, columns move one at a time so a rank holds about one
#: column in flight beside its input and output (the memory bound of large partitions).
BATCH_BYTES = 8 << 20


def _small(*tables: pa.Table) -> bool:
    """Whether this rank's ``tables`` are small enough to exchange in one go (see
    :data:`BATCH_BYTES`), and their column names unique (columns are then looked up by name).
    An operation moves its columns in one go only when this holds on every rank (its
    collective check gathers each rank's answer): the two ways make different collectives,
    and ranks whose partitions lie on both sides of the bound would mismatch them."""
    return (sum(t.nbytes for t in tables) <= BATCH_BYTES and
            all(len(set(t.schema.names)) == t.num_columns for t in tables))


def _canonical_zero(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """-0.0 == 0.0, but Arrow's hash join compares float keys bitwise: adding 0.0 turns -0.0
    into 0.0 (and nothing else changes), so the two match as in polars, pandas and SQL."""
    for name in keys:
        i = table.schema.get_field_index(name)
        if pa.types.is_floating(table.schema.field(i).type):
            col = table.column(i)
            table = table.set_column(i, name, pc.add(col, pa.scalar(0.0, col.type)))
    return table


# -- sort -------------------------------------------------------------------------------------
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
    table = _require_table(table, "sort: table")
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
    local_nulls = [table.local.column(n).null_count if schema.get_field_index(n) >= 0 else 0
                   for n in names]
    facts = _check.agree(comm, [schema], facts=[int(_small(table.local)), table.local.num_rows] +
                         local_nulls)
    _check.check_columns(schema, names, "sort")
    for n in names:
        t = schema.field(n).type
        if pa.types.is_nested(t) or pa.types.is_null(t):
            raise InputError(f"sort: cannot sort by column {n!r} of type {t}")
    if _backend.requested_name(backend) == "pycylon":
        from hetflow.frame import _pycylon
        return _pycylon.sort(table, names, asc)
    be = _backend.resolve(backend)
    _backend.heap_pad_for(table.local.nbytes)
    any_nulls = any(sum(f[2 + i] for f in facts) for i in range(len(names)))
    fast = len(names) == 1 and _is_numeric(schema.field(names[0]).type) and not any_nulls
    if fast:
        out = _sort_numeric(comm, table.local, names[0], not asc[0], be,
                            batched=all(f[0] for f in facts), rows=sum(f[1] for f in facts))
    else:
        out = _sort_general(comm, table.local, names, asc)
        be = "cpu"
    return DistributedTable(comm, out, backend=be)


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
    every rank's partition is small (:func:`_small`): all columns move in one exchange.
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
        with phase("local"):
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
        with phase("local"):
            local = (_localsort.radix_argsort(received) if xp is np else
                     xp.asnumpy(xp.argsort(xp.asarray(received))))
            columns[key_index] = _arrays.from_values(column.type, _localsort.widen(
                _arrays.gather(received, local), descending, lo, values.dtype))
    else:
        received = ex.column(key_index)
        with phase("local"):
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
    keys = table.select(names).take(order).combine_chunks()
    cols = [keys.column(i) for i in range(len(names))]
    n = keys.num_rows
    m = min(n, 32 * size)  # regular sampling of the sorted rows: within ~1/32 of an even share
    pos = [(i * n) // m for i in range(m)]
    samples = [(tuple(c[p].as_py() for c in cols), rank, p) for p in pos]
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
            row = (tuple(c[mid].as_py() for c in cols), rank, mid)
            if full_cmp(row, split) < 0:
                lo = mid + 1
            else:
                hi = mid
        bounds.append(lo)
    bounds.append(n)
    del keys, cols
    order_np = _arrays.to_numpy(order)
    parts = _exchange.exchange_rows(comm, table, order_np, bounds)
    return parts.take(_sort_indices(parts, names, asc))


_PER_KEY_NULLS = int(pa.__version__.split(".")[0]) >= 25


def _sort_indices(table: pa.Table, names: List[str], asc: List[bool]) -> pa.Array:
    """Arrow's stable sort indices, nulls at the end of every key (pyarrow >= 25 takes the
    null placement per key and deprecates the global option)."""
    if _PER_KEY_NULLS:
        keys = [(n, "ascending" if a else "descending", "at_end") for n, a in zip(names, asc)]
        return pc.sort_indices(table, sort_keys=keys)
    keys = [(n, "ascending" if a else "descending") for n, a in zip(names, asc)]
    return pc.sort_indices(table, sort_keys=keys, null_placement="at_end")


# -- groupby / unique -------------------------------------------------------------------------
_AGGS = ("sum", "count", "mean", "min", "max")


class GroupBy:
    """``table.groupby(by).agg({...})``: a distributed group-by with a local pre-aggregation."""

    def __init__(self, table: DistributedTable, by):
        self.table = _require_table(table, "groupby: table")
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
        schema = t.local.schema
        _check.agree(t.comm, [schema])
        _check.check_columns(schema, self.by, "groupby")
        _check.check_columns(schema, [c for c, _, _ in plan], "groupby.agg")
        if _backend.requested_name(backend) == "pycylon":
            from hetflow.frame import _pycylon
            return _pycylon.groupby_agg(t, self.by, plan)
        be = _backend.resolve(backend)
        _backend.heap_pad_for(t.local.nbytes)
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
        local = _group(source, self.by, partial_aggs)
        del source
        shuffled = _shuffle_local(t.comm, local, self.by, be)
        final_aggs = [(name, "max" if name.endswith("_max") else
                       "min" if name.endswith("_min") else "sum") for name in partial_names]
        merged = _group(shuffled, self.by, final_aggs)
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
        out = pa.Table.from_arrays(columns, names=out_names)
        return DistributedTable(t.comm, out, backend=be if t.comm.Get_size() > 1 else "cpu")


def _group_by(table: pa.Table, by: List[str]):
    """``table.group_by(by)`` on one thread (a deterministic group order); pyarrow < 12 has no
    ``use_threads`` and gives its own order, which no caller relies on (groups are
    re-aggregated, and ``unique`` sorts the rows it keeps)."""
    try:
        return table.group_by(by, use_threads=False)
    except TypeError:  # pyarrow < 12 (pycylon's environments pin pyarrow 9-10)
        return table.group_by(by)


def _group(table: pa.Table, by: List[str], aggs) -> pa.Table:
    """Group-by-aggregate whose result columns are ``by`` then each aggregated column's own
    name (Arrow names them ``col_func`` and has changed their position between versions)."""
    out = _group_by(table, by).aggregate(aggs)
    wanted = list(by) + [f"{col}_{func}" for col, func in aggs]
    return out.select(wanted).rename_columns(list(by) + [col for col, _ in aggs])


def unique(table: DistributedTable, subset=None, *,
           backend: Optional[str] = None) -> DistributedTable:
    """Drop rows whose ``subset`` columns (default: all) repeat, keeping each first occurrence
    in the ranks-in-order concatenation of the input."""
    table = _require_table(table, "unique: table")
    schema = table.local.schema
    names = list(schema.names) if subset is None else _check.key_names(subset, "unique")
    _check.agree(table.comm, [schema])
    _check.check_columns(schema, names, "unique")
    if _backend.requested_name(backend) == "pycylon":
        from hetflow.frame import _pycylon
        return _pycylon.unique(table, names)
    be = _backend.resolve(backend)
    _backend.heap_pad_for(table.local.nbytes)
    shuffled = _shuffle_local(table.comm, table.local, names, be)
    marker = "__hetflow_row"
    while marker in schema.names:
        marker += "_"
    indexed = shuffled.select(names).append_column(
        marker, _arrays.arrow_of(np.arange(shuffled.num_rows, dtype=np.int64)))
    first = _group_by(indexed, names).aggregate([(marker, "min")])
    keep = np.sort(_arrays.to_numpy(first.column(f"{marker}_min")))
    out = shuffled.take(_arrays.arrow_of(keep))
    return DistributedTable(table.comm, out, backend=be if table.comm.Get_size() > 1 else "cpu")
