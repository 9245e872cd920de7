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
from hetflow.frame._groupby import GroupBy
from hetflow.frame._io import read_csv, read_parquet, to_parquet
from hetflow.frame._join import join
from hetflow.frame._local import (cast, drop, fill_null, filter_rows, from_pandas, rename, select,
                                  to_pandas, to_polars, with_columns)
from hetflow.frame._mpi import barrier
from hetflow.frame._position import concat, gather, head, rebalance, slice_rows, tail
from hetflow.frame._setops import difference, intersect, union
from hetflow.frame._shuffle import shuffle
from hetflow.frame._sort import sort
from hetflow.frame._table import DistributedTable, from_local, generate
from hetflow.frame._unique import unique


def repartition(table: DistributedTable, on, **kw) -> DistributedTable:
    """Hash-partition by the ``on`` columns (the same as :func:`shuffle`)."""
    return shuffle(table, on, **kw)


def groupby(table: DistributedTable, by) -> GroupBy:
    """Group by key columns; finish with ``.agg({column: function})``."""
    return GroupBy(table, by)


def _concat_method(self: DistributedTable, *others: DistributedTable) -> DistributedTable:
    """This table's rows, then each of ``others``'; see :func:`hetflow.frame.concat`."""
    return concat([self, *others])


# The table's methods are the operations' functions (``t.join(u, on="k")`` is
# ``join(t, u, on="k")``), attached here, where every operation's module is loaded: the
# table's own module imports none of them, so none imports another through it.
for _name, _function in {
        "shuffle": shuffle, "repartition": repartition, "join": join, "sort": sort,
        "groupby": groupby, "unique": unique, "head": head, "tail": tail, "slice": slice_rows,
        "rebalance": rebalance, "concat": _concat_method, "union": union,
        "intersect": intersect, "difference": difference, "describe": describe,
        "filter": filter_rows, "select": select, "drop": drop, "rename": rename,
        "with_columns": with_columns, "cast": cast, "fill_null": fill_null,
        "to_pandas": to_pandas, "to_polars": to_polars, "gather": gather,
        "to_parquet": to_parquet}.items():
    setattr(DistributedTable, _name, _function)
del _name, _function

# frame.slice(t, start, stop) and frame.filter(t, predicate), as the methods are named
slice = slice_rows
filter = filter_rows


__all__ = ["Agg", "DistributedTable", "GroupBy", "barrier", "cast", "concat", "describe", "difference",
           "drop", "fill_null", "filter", "from_local", "from_pandas", "gather", "generate",
           "groupby", "head", "intersect", "join", "read_csv", "read_parquet", "rebalance",
           "rename", "repartition", "select", "set_backend", "shuffle", "slice", "sort", "tail",
           "to_pandas", "to_parquet", "to_polars", "union", "unique", "with_columns"]
