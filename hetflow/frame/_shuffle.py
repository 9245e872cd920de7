"""Hash partitioning: every row to rank ``hash(keys) % size`` (the other operations' first step)."""
from __future__ import annotations

from typing import Optional, Sequence

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
    xp = _backend.array_module(backend)
    dest = (_hash.local_partition_of(table, keys, size) if alone and backend != "cupy" else
            _hash.partition_of(xp, table, keys, size))
    order, offsets = _exchange.split_by(dest, size)
    del dest
    return _exchange.exchange_rows(comm, table, order, offsets)


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
