"""The distributed table: one ``pyarrow.Table`` partition per rank of a communicator."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import pyarrow as pa

from hetflow.errors import ConfigError, InputError
from hetflow.frame import _backend
from hetflow.frame._arrays import arrow_of


class DistributedTable:
    """A table partitioned over the ranks of ``comm``: this rank holds ``local``.

    Construction is local (no communication); operations such as :meth:`join`, :meth:`sort`,
    :meth:`shuffle`, :meth:`groupby` and :meth:`gather` are collective: every rank of ``comm``
    must call them, in the same order. ``backend`` names the compute path that produced this
    table (``"cpu"`` for data handed in or read from files).
    """

    __slots__ = ("comm", "local", "backend")

    def __init__(self, comm, local: pa.Table, *, backend: str = "cpu"):
        if isinstance(local, pa.RecordBatch):
            local = pa.Table.from_batches([local])
        if not isinstance(local, pa.Table):
            raise InputError(f"DistributedTable needs a pyarrow.Table partition, got "
                             f"{type(local).__name__}")
        if backend not in ("cpu", "cupy", "pycylon"):
            raise ConfigError(f"backend must be 'cpu', 'cupy' or 'pycylon', got {backend!r}")
        _backend.configure_threads(comm)
        self.comm = comm
        self.local = local
        self.backend = backend

    # -- facts -------------------------------------------------------------------------------
    @property
    def local_rows(self) -> int:
        """Rows in this rank's partition."""
        return self.local.num_rows

    @property
    def schema(self) -> pa.Schema:
        return self.local.schema

    @property
    def column_names(self):
        return self.local.column_names

    def num_rows(self) -> int:
        """Total rows over all ranks (collective)."""
        return int(self.comm.allreduce(self.local.num_rows))

    def __repr__(self):
        return (f"DistributedTable(rank {self.comm.Get_rank()}/{self.comm.Get_size()}, "
                f"local_rows={self.local_rows}, columns={self.column_names}, "
                f"backend={self.backend!r})")

    def __copy__(self):
        return DistributedTable(self.comm, self.local, backend=self.backend)

    def __reduce__(self):
        # Its communicator ends with the task: pickled, it would arrive as one rank's rows
        # on a dead communicator. Returned on its own, the runner hands it over whole.
        from hetflow.errors import TableHandoffError
        raise TableHandoffError(
            "a DistributedTable cannot be pickled: return it from the task on its own (the "
            "task then resolves to a hetflow.TableHandle of the whole table), or gather() it")

    # -- operations (collective) -------------------------------------------------------------
    def shuffle(self, on, **kw) -> "DistributedTable":
        """Hash-partition rows by ``on``: equal keys end up on the same rank."""
        from hetflow.frame._shuffle import shuffle
        return shuffle(self, on, **kw)

    def join(self, other: "DistributedTable", on=None, **kw) -> "DistributedTable":
        """Distributed join with ``other``; see :func:`hetflow.frame.join`."""
        from hetflow.frame._join import join
        return join(self, other, on, **kw)

    def sort(self, by, ascending=True, **kw) -> "DistributedTable":
        """Globally sorted copy; see :func:`hetflow.frame.sort`."""
        from hetflow.frame._sort import sort
        return sort(self, by, ascending, **kw)

    def groupby(self, by) -> "GroupBy":  # noqa: F821 - _groupby imports this module
        """Group by key columns; finish with ``.agg({...})``."""
        from hetflow.frame._groupby import GroupBy
        return GroupBy(self, by)

    def unique(self, subset=None, **kw) -> "DistributedTable":
        """Drop duplicate rows (over ``subset`` columns), keeping each first occurrence."""
        from hetflow.frame._unique import unique
        return unique(self, subset, **kw)

    def head(self, n: int = 5) -> "DistributedTable":
        """The first ``n`` rows of the global order (rank order); no data moves."""
        from hetflow.frame._position import head
        return head(self, n)

    def tail(self, n: int = 5) -> "DistributedTable":
        """The last ``n`` rows of the global order; no data moves."""
        from hetflow.frame._position import tail
        return tail(self, n)

    def slice(self, start: Optional[int] = None, stop: Optional[int] = None
              ) -> "DistributedTable":
        """Rows ``start:stop`` of the global order (Python slice semantics); no data moves."""
        from hetflow.frame._position import slice_rows
        return slice_rows(self, start, stop)

    def rebalance(self, rows: Optional[Sequence[int]] = None) -> "DistributedTable":
        """Equal rows per rank (to within one; or ``rows[r]`` on rank r), global order kept."""
        from hetflow.frame._position import rebalance
        return rebalance(self, rows)

    def repartition(self, on, **kw) -> "DistributedTable":
        """Hash-partition by the ``on`` columns (the same as :meth:`shuffle`)."""
        from hetflow.frame._shuffle import shuffle
        return shuffle(self, on, **kw)

    def concat(self, *others: "DistributedTable") -> "DistributedTable":
        """This table's rows, then each of ``others``'; see :func:`hetflow.frame.concat`."""
        from hetflow.frame._position import concat
        return concat([self, *others])

    def union(self, other: "DistributedTable", **kw) -> "DistributedTable":
        """Distinct rows of both tables (SQL ``UNION``)."""
        from hetflow.frame._setops import union
        return union(self, other, **kw)

    def intersect(self, other: "DistributedTable", **kw) -> "DistributedTable":
        """Distinct rows found in both tables (SQL ``INTERSECT``)."""
        from hetflow.frame._setops import intersect
        return intersect(self, other, **kw)

    def difference(self, other: "DistributedTable", **kw) -> "DistributedTable":
        """Distinct rows of this table not in ``other`` (SQL ``EXCEPT``)."""
        from hetflow.frame._setops import difference
        return difference(self, other, **kw)

    def describe(self, columns=None, **kw) -> pa.Table:
        """Summary statistics of the numeric columns (a small table on every rank)."""
        from hetflow.frame._describe import describe
        return describe(self, columns, **kw)

    # -- row-wise operations on each partition (collective only in their error check) --------
    def filter(self, predicate) -> "DistributedTable":
        """Rows where a ``pyarrow.compute`` expression holds (``pc.field("v") > 0``)."""
        from hetflow.frame._local import filter_rows
        return filter_rows(self, predicate)

    def select(self, columns) -> "DistributedTable":
        """Only the named columns, in that order."""
        from hetflow.frame._local import select
        return select(self, columns)

    def drop(self, columns) -> "DistributedTable":
        """Every column but the named ones."""
        from hetflow.frame._local import drop
        return drop(self, columns)

    def rename(self, mapping) -> "DistributedTable":
        """Columns renamed by ``{old: new}``."""
        from hetflow.frame._local import rename
        return rename(self, mapping)

    def with_columns(self, columns=None, **named) -> "DistributedTable":
        """Columns added or replaced: expressions, functions of the partition, or scalars."""
        from hetflow.frame._local import with_columns
        return with_columns(self, columns, **named)

    def cast(self, dtypes, **kw) -> "DistributedTable":
        """Columns cast to new types (``{name: pyarrow type}`` or a schema)."""
        from hetflow.frame._local import cast
        return cast(self, dtypes, **kw)

    def fill_null(self, value=None, **kw) -> "DistributedTable":
        """Nulls replaced by ``value`` (columns it fits) or ``columns={name: value}``."""
        from hetflow.frame._local import fill_null
        return fill_null(self, value, **kw)

    def to_pandas(self, root: int = 0, **kw):
        """The gathered table as a pandas DataFrame on ``root``, None elsewhere (collective)."""
        from hetflow.frame._local import to_pandas
        return to_pandas(self, root, **kw)

    def to_polars(self, root: int = 0):
        """The gathered table as a polars DataFrame on ``root``, None elsewhere (collective)."""
        from hetflow.frame._local import to_polars
        return to_polars(self, root)

    def gather(self, root: int = 0) -> Optional[pa.Table]:
        """All partitions concatenated in rank order on ``root`` (collective); None elsewhere."""
        from hetflow.frame import _check, _exchange
        _check.agree(self.comm, [self.local.schema])
        return _exchange.gather(self.comm, self.local, root)

    def to_parquet(self, directory, **kw) -> str:
        """Write each rank's partition as ``directory/part-RRRRR.parquet`` (collective)."""
        from hetflow.frame._io import to_parquet
        return to_parquet(self, directory, **kw)


def from_local(comm, table: pa.Table) -> DistributedTable:
    """Wrap this rank's partition (same as ``DistributedTable(comm, table)``)."""
    return DistributedTable(comm, table)


def generate(comm, rows_per_rank: int, *, unique: float = 0.9, seed: Optional[int] = None,
             columns: Sequence[str] = ("key", "value")) -> DistributedTable:
    """The Radical-Cylon paper's synthetic data: int64 columns, values uniform in
    ``[0, unique * total_rows)``, ``rows_per_rank`` rows on every rank.

    Each rank draws from its own stream: ``seed=None`` seeds with the rank (the paper's choice);
    an integer ``seed`` seeds with ``(seed, rank)``, so two tables with different seeds differ and
    every run with the same seeds and rank count is identical.
    """
    if int(rows_per_rank) != rows_per_rank or rows_per_rank < 0:
        raise ConfigError(f"rows_per_rank must be a non-negative integer, got {rows_per_rank!r}")
    if not 0 < unique <= 1:
        raise ConfigError(f"unique must be in (0, 1], got {unique!r}")
    columns = list(columns)
    if not columns or len(set(columns)) != len(columns):
        raise ConfigError(f"columns must be distinct names, got {columns!r}")
    _backend.configure_threads(comm)  # before the data exists, so its temporaries are freed
    return DistributedTable(comm, synthetic_partition(comm.Get_rank(), comm.Get_size(),
                                                      rows_per_rank, unique=unique, seed=seed,
                                                      columns=columns))


def synthetic_partition(rank: int, size: int, rows_per_rank: int, *, unique: float = 0.9,
                        seed: Optional[int] = None, columns: Sequence[str] = ("key", "value")
                        ) -> pa.Table:
    """Rank ``rank``'s partition of :func:`generate`'s data, without a communicator (so a
    single-process baseline can rebuild exactly the data the ranks hold)."""
    rng = np.random.default_rng(rank if seed is None else [int(seed), rank])
    high = max(1, int(unique * int(rows_per_rank) * size))
    data: Dict[str, np.ndarray] = {
        name: rng.integers(0, high, int(rows_per_rank), dtype=np.int64) for name in columns}
    return pa.Table.from_arrays([arrow_of(v) for v in data.values()], names=list(data))
