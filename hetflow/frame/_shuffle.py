"""Hash partitioning: every row to rank ``hash(keys) % size`` (the other operations' first step)."""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import pyarrow as pa

from hetflow.frame import _backend, _check, _cylon_rules, _exchange, _hash
from hetflow.frame._prepare import prepare, require_table
from hetflow.frame._table import DistributedTable


def shuffle_local(comm, table: pa.Table, keys: Sequence[str], backend: str,
                  alone: bool = False) -> pa.Table:
    """Exchange rows so that every row lands on rank ``hash(keys) % size`` (collective).
    ``alone``: the table is the operation's only one (a group-by, unique), so off the GPU
    its keys are hashed by the compiled engine (:func:`hetflow.frame._hash.local_partition_of`),
    not co-partitioned with other tables: the same partition whichever CPU backend was asked
    for (an operation pycylon cannot run, run on the CPU, gives the CPU engine's floats to the
    last digit: a group's var depends on what else its rank aggregates)."""
    size = comm.Get_size()
    if size == 1:
        return table
    order, offsets = _routing(table, keys, size, backend, alone)
    return _exchange.exchange_rows(comm, table, order, offsets)


def _routing(table: pa.Table, keys: Sequence[str], parts: int, backend: str, alone: bool):
    """Rows ordered by their partition (0..parts-1) of the keys' hash, and each one's offset."""
    xp = _backend.array_module(backend)
    dest = (_hash.local_partition_of(table, keys, parts) if alone and backend != "cupy" else
            _hash.partition_of(xp, table, keys, parts))
    return _exchange.split_by(dest, parts)


def shuffle_rounds(comm, table: pa.Table, keys: Sequence[str], backend: str, rounds: int,
                   alone: bool = False) -> Iterator[pa.Table]:
    """:func:`shuffle_local` in ``rounds`` exchanges (collective; every rank must ask for the
    same number): the rows whose keys hash to partition ``c`` of ``size * rounds`` go to rank
    ``c % size`` in round ``c // size``, so all the rows of one key arrive in one round and
    each round's table is about 1/rounds of the rank's rows. A caller that reduces each round
    before the next (a group-by of about one group a row) holds one round's rows and scratch
    at a time instead of the whole shuffled partition's. Within a round, rows are ordered as
    :func:`shuffle_local` orders them (by source rank, each source's in their own order)."""
    size = comm.Get_size()
    if size == 1 or rounds <= 1:
        yield shuffle_local(comm, table, keys, backend, alone)
        return
    # partition c = round * size + rank: split_by orders rows by round, then rank
    order, offsets = _routing(table, keys, size * rounds, backend, alone)
    for r in range(rounds):
        lo, hi = r * size, (r + 1) * size
        mine = offsets[lo:hi + 1] - offsets[lo]
        part = _exchange.exchange_rows(comm, table, order[offsets[lo]:offsets[hi]], mine)
        yield part
        del part


def shuffle(table: DistributedTable, on, *, backend: Optional[str] = None) -> DistributedTable:
    """Hash-partition ``table`` by the ``on`` columns: equal keys land on the same rank.

    The destination depends only on the key values (never on the process), so two tables
    shuffled on keys of the same types are co-partitioned. Rows keep their relative order
    within each source rank; received rows are ordered by source rank.
    """
    table = require_table(table, "shuffle: table")
    names = _check.key_names(on, "shuffle")
    prep = prepare("shuffle", [table], [names], backend=backend, cylon=lambda: _cylon_rules.never(
        "shuffle", "pycylon's shuffle uses Cylon's own hash, so its partitions would not be "
        "co-partitioned with the CPU engine's"))
    return prep.result(shuffle_local(table.comm, table.local, names, prep.backend))
