"""The distributed join: both sides partitioned on their keys, then a local match; or, when
the right side is small, that side sent to every rank (:mod:`hetflow.frame._broadcast`).

One null-free integer key takes the streamed path (:func:`_join_streamed`: only the keys
move before the match, each payload column when the output gathers it), partitioned by
``key mod P`` where that spreads both sides evenly (:mod:`hetflow.frame._hash`); one string
or binary key takes it too, through its 64-bit hash (:func:`_join_by_hash`); other keys
shuffle both whole sides, then :func:`hetflow.frame._localjoin.join`.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa

from hetflow.errors import ConfigError, InputError, SchemaMismatch
from hetflow.frame import (_arrays, _backend, _broadcast, _check, _cylon_rules, _exchange, _hash,
                           _intmatch, _localjoin, _pycylon, _strmatch)
from hetflow.frame._agreement import step
from hetflow.frame._arrays import destination_dtype, from_values
from hetflow.frame._exchange import MPI
from hetflow.frame._phases import phase
from hetflow.frame._prepare import prepare, require_table, small
from hetflow.frame._shuffle import shuffle_local
from hetflow.frame._table import DistributedTable

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
    left = require_table(left, "join: left")
    right = require_table(right, "join: right")
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
    residues, counts = _modular_candidate(comm, left.local, right.local, lk, rk, how)
    # up to MODULAR_MAX_PARTS ranks the counts ride in the check (no round of their own)
    in_check = counts is not None and comm.Get_size() <= _hash.MODULAR_MAX_PARTS
    facts = {"small": small(left.local, right.local),
             "key_nulls": _null_count(left.local, lk) + _null_count(right.local, rk),
             "left_bytes": int(left.local.nbytes), "right_bytes": int(right.local.nbytes)}
    if in_check:
        facts["modular_counts"] = [int(c) for c in counts]

    ls, rs = left.local.schema, right.local.schema

    def key_types_match():
        for a, b in zip(lk, rk):
            ta, tb = ls.field(a).type, rs.field(b).type
            if ta != tb:
                raise SchemaMismatch(f"join: key types differ: left {a!r} is {ta} but right "
                                     f"{b!r} is {tb}; cast one side so both keys have the same "
                                     "type")

    prep = prepare("join", [left, right], [lk, rk], what=("left", "right"), facts=facts,
                   check=key_types_match, backend=backend, cylon=functools.partial(
                       _cylon_rules.join, comm.Get_size(), left.local, right.local, lk, rk, how))
    if prep.pycylon:
        empty = _localjoin.join(left.local.slice(0, 0), right.local.slice(0, 0), lk, rk, how,
                                tuple(suffixes))
        return prep.result(_pycylon.join(comm, left.local, right.local, lk, rk, empty.schema),
                           backend="pycylon")
    be, agreed = prep.backend, prep.agreed
    if _broadcast.chosen(how, agreed.per_rank("left_bytes"), agreed.per_rank("right_bytes")):
        out = _broadcast.join(comm, canonical_zero(left.local, lk),
                              canonical_zero(right.local, rk), lk, rk, how, tuple(suffixes))
        return prep.result(out)
    if _localjoin.binary_key_ok(left.local.schema, right.local.schema, lk, rk, how):
        out = _join_by_hash(comm, left.local, right.local, lk[0], rk[0], how, tuple(suffixes),
                            be, batched=agreed.every("small"))
        return prep.result(out)
    if not agreed.total("key_nulls") and _localjoin.fast_key_ok(
            left.local.schema, right.local.schema, lk, rk, how):
        if counts is not None and not _modular_agreed(
                comm, agreed.per_rank("modular_counts") if in_check else counts):
            residues = None
        out = _join_streamed(comm, left.local, right.local, lk[0], rk[0], how, tuple(suffixes),
                             be, residues, batched=agreed.every("small"))
        return prep.result(out)
    lt = shuffle_local(comm, canonical_zero(left.local, lk), lk, be)
    rt = shuffle_local(comm, canonical_zero(right.local, rk), rk, be)
    del left, right  # the caller still holds them; we only drop our references
    with step(comm, "join: the local join"), phase("local"):
        out = _localjoin.join(lt, rt, lk, rk, how, tuple(suffixes))
    return prep.result(out)


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
    partitions (:data:`~hetflow.frame._prepare.BATCH_BYTES`) move every column of both sides
    in one exchange instead: there the waits for the peers, not the memory, are what costs.

    ``residues``: both sides' destinations by the modular partition and their rows per
    destination, agreed on by every rank (the local match then addresses keys by their
    quotient); else the rows are hashed. ``batched``: every rank's partitions are small (see
    :func:`~hetflow.frame._prepare.small`)."""
    if comm.Get_size() == 1:   # nothing moves: the columns as they are
        fetch_left, fetch_right = _column_of(left), _column_of(right)
        keys = {"left": fetch_left(lkey), "right": fetch_right(rkey)}
    else:
        keys, fetch_left, fetch_right = _shuffled_keys(comm, left, right, lkey, rkey, be,
                                                       residues, batched)
    stride = comm.Get_size() if residues is not None else 1
    with step(comm, "join: matching the keys"), phase("local"):
        li, ri = _intmatch.match(keys["left"], keys["right"], how, stride, identity=True)
    # the payload columns' exchange, nested in assemble, is its own phase; assemble makes
    # every fetch even where a column fails, so the step's agreement meets every rank
    with step(comm, "join: building the output"), phase("local"):
        return _localjoin.assemble(left.schema, right.schema, lkey, rkey, li, ri, how, suffixes,
                                   fetch_left, fetch_right, keys)


def _join_by_hash(comm, left: pa.Table, right: pa.Table, lkey: str, rkey: str, how: str,
                  suffixes, be: str, batched: bool = False) -> pa.Table:
    """Join on one string or binary key by its 64-bit hash, with late materialisation as in
    :func:`_join_streamed`: each side's key is hashed (the hash routes the row), the hashes
    are matched as integers and the matched pairs' keys compared
    (:func:`hetflow.frame._strmatch.match_by_hash`), then each output column is gathered by
    one take. Arrow's hash join of the same strings took 3x longer and several times the
    memory. Across ranks the rows move in :data:`JOIN_ROUNDS` rounds, each matched and its
    output built before the next, and a rank hashes its round's keys again: peak memory per
    rank 3.0x the partition (2.5M rows per rank and side, 2 ranks) against 4.4x in one
    exchange with the hash riding along."""
    xp = _backend.array_module(be)
    hashes = []
    with phase("partition"):
        for table, key in ((left, lkey), (right, rkey)):
            h = _hash.hash_rows(xp, table.select([key]), [key])
            hashes.append(h if xp is np else xp.asnumpy(h))
            del h
    if comm.Get_size() == 1:
        fetch_left, fetch_right = _column_of(left), _column_of(right)
        keys = {"left": fetch_left(lkey), "right": fetch_right(rkey)}
        lh, rh = (from_values(pa.uint64(), h) for h in hashes)
        del hashes
        return _match_and_assemble(comm, left.schema, right.schema, lkey, rkey, how, suffixes,
                                   [lh, rh], keys, fetch_left, fetch_right)
    # the hash routes the rows: partition c of size * rounds goes to rank c % size in round
    # c // size (rank h % size, as in one round); the receiver hashes its round's keys again
    # rather than hold every row's hash (8 bytes a row) through the rounds
    size, rounds = comm.Get_size(), (1 if batched else JOIN_ROUNDS)
    routing = []
    for h in hashes:
        with phase("partition"):
            dest = (h % np.uint64(size * rounds)).astype(destination_dtype(size * rounds))
        routing.append(_exchange.split_by(dest, size * rounds))
        del dest, h
    del hashes
    outs = []
    for r in range(rounds):
        lo, hi = r * size, (r + 1) * size
        routes = [(order[offsets[lo]:offsets[hi]], offsets[lo:hi + 1] - offsets[lo], t)
                  for (order, offsets), t in zip(routing, (left, right))]
        keys, fetch_left, fetch_right = _routed_keys(comm, routes, lkey, rkey, batched)
        del routes
        with phase("partition"):
            hashed = [from_values(pa.uint64(), _host(xp, _hash.hash_rows(
                xp, pa.table({k: keys[side]}), [k]))) for side, k in (("left", lkey),
                                                                      ("right", rkey))]
        outs.append(_match_and_assemble(comm, left.schema, right.schema, lkey, rkey, how,
                                        suffixes, hashed, keys, fetch_left, fetch_right))
        del keys, fetch_left, fetch_right
    del routing
    if len(outs) == 1:
        return outs[0]
    with phase("local"):
        out = pa.concat_tables(outs)
        del outs
        return out.combine_chunks()


#: Rounds of a string join's exchange (see :func:`_join_by_hash`): each round's rows are
#: matched and their output built before the next round's arrive, so the match's scratch
#: (its bucket table spans twice the right rows) is for a round's rows, not a partition's.
JOIN_ROUNDS = 8


def _match_and_assemble(comm, lschema, rschema, lkey: str, rkey: str, how: str, suffixes,
                        hashed: list, keys, fetch_left, fetch_right) -> pa.Table:
    """The string join's local match of the hashes (``hashed``: the two sides', emptied
    here) and keys, then its output (collective: each step agreed on every rank)."""
    with step(comm, "join: matching the keys"), phase("local"):
        li, ri = _strmatch.match_by_hash(hashed[0], hashed[1], keys["left"], keys["right"],
                                         how)
    hashed.clear()
    with step(comm, "join: building the output"), phase("local"):
        return _localjoin.assemble(lschema, rschema, lkey, rkey, li, ri, how, suffixes,
                                   fetch_left, fetch_right, keys)


def _host(xp, h) -> np.ndarray:
    return h if xp is np else xp.asnumpy(h)


def _shuffled_keys(comm, left: pa.Table, right: pa.Table, lkey: str, rkey: str, be: str,
                   residues=None, batched: bool = False):
    """Route both tables' rows by their key's partition (collective): this rank's key columns
    (``{"left": ..., "right": ...}``) and a ``name -> column`` fetch per side for the rest.
    ``residues``: the two sides' destinations and rows per destination (None: counted
    here), already chosen (else the keys are hashed)."""
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
    return _routed_keys(comm, routes, lkey, rkey, batched)


def _routed_keys(comm, routes, lkey: str, rkey: str, batched: bool):
    """:func:`_shuffled_keys` for routes made already: ``[(order, offsets, table)]`` of the
    left side, then the right (collective)."""
    left, right = routes[0][2], routes[1][2]
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


def canonical_zero(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """-0.0 == 0.0, but Arrow's hash join compares float keys bitwise: adding 0.0 turns -0.0
    into 0.0 (and nothing else changes), so the two match as in polars, pandas and SQL."""
    for name in keys:
        i = table.schema.get_field_index(name)
        if pa.types.is_floating(table.schema.field(i).type):
            table = table.set_column(i, name, _arrays.unsigned_zero(table.column(i)))
    return table
