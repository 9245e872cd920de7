"""hetflow's Cylon engine: distributed Arrow tables over MPI (join, sort, shuffle, groupby).

Each rank of a communicator holds one ``pyarrow.Table`` partition of a :class:`DistributedTable`;
operations are collective and move rows between ranks as Arrow IPC streams through one MPI
``Alltoallv``. The algorithms are Cylon's (hash-partitioned join, sample sort); see
``frame.join``, ``frame.sort``. Example, on every rank of ``comm``::

    from hetflow import frame
    left = frame.generate(comm, 1_000_000, seed=1)
    right = frame.generate(comm, 1_000_000, seed=2)
    joined = frame.join(left, right, on="key")       # how="inner" | "left" | "right" | "outer"
    ordered = frame.sort(left, "key")                # rank i's rows <= rank i+1's
    table = ordered.gather()                         # pyarrow.Table on rank 0, None elsewhere

Also: set operations (``union``, ``intersect``, ``difference``), rows by global position
(``head``, ``tail``, ``slice``, ``rebalance``, ``concat``), ``describe``, and row-wise
operations on each partition (``filter``, ``select``, ``with_columns``, ``cast``, ...).

Bad input (unknown columns, mismatched key types, ranks whose schemas disagree) raises the same
:class:`~hetflow.errors.InputError` subclass on every rank, before any data moves.
"""
from hetflow.frame._aggregate import Agg
from hetflow.frame._backend import set_backend
from hetflow.frame._describe import describe
from hetflow.frame._exchange import barrier
from hetflow.frame._groupby import GroupBy
from hetflow.frame._io import read_csv, read_parquet, to_parquet
from hetflow.frame._join import join
from hetflow.frame._local import (cast, drop, fill_null, filter_rows, from_pandas, rename, select,
                                  to_pandas, to_polars, with_columns)
from hetflow.frame._position import concat, head, rebalance, slice_rows, tail
from hetflow.frame._setops import difference, intersect, union
from hetflow.frame._shuffle import shuffle
from hetflow.frame._sort import sort
from hetflow.frame._table import DistributedTable, from_local, generate
from hetflow.frame._unique import unique


def gather(table: DistributedTable, root: int = 0):
    """``table.gather(root)``: all partitions concatenated on ``root``, None elsewhere."""
    return table.gather(root)


def repartition(table: DistributedTable, on, **kw) -> DistributedTable:
    """``table.repartition(on)``: hash-partition by the ``on`` columns (as :func:`shuffle`)."""
    return shuffle(table, on, **kw)


# frame.slice(t, start, stop) and frame.filter(t, predicate), as the methods are named
slice = slice_rows
filter = filter_rows


def groupby(table: DistributedTable, by) -> GroupBy:
    """``table.groupby(by)``: finish with ``.agg({column: function})``."""
    return table.groupby(by)


__all__ = ["Agg", "DistributedTable", "GroupBy", "barrier", "cast", "concat", "describe", "difference",
           "drop", "fill_null", "filter", "from_local", "from_pandas", "gather", "generate",
           "groupby", "head", "intersect", "join", "read_csv", "read_parquet", "rebalance",
           "rename", "repartition", "select", "set_backend", "shuffle", "slice", "sort", "tail",
           "to_pandas", "to_parquet", "to_polars", "union", "unique", "with_columns"]
