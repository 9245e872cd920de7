"""The distributed table: one ``pyarrow.Table`` partition per rank of a communicator."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import pyarrow as pa

from hetflow.errors import ConfigError, InputError, TableHandoffError
from hetflow.frame import _backend
from hetflow.frame._arrays import arrow_of


class DistributedTable:
    """A table partitioned over the ranks of ``comm``: this rank holds ``local``.

    Construction is local (no communication); operations such as :meth:`join`, :meth:`sort`,
    :meth:`shuffle`, :meth:`groupby` and :meth:`gather` are collective: every rank of ``comm``
    must call them, in the same order. ``backend`` names the compute path that produced this
    table (``"cpu"`` for data handed in or read from files).

    This module holds the data and its facts only; the operations are functions of their own
    modules, attached as methods where the package is assembled (``hetflow/frame/__init__.py``),
    so no operation module imports another through the table.
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
        raise TableHandoffError(
            "a DistributedTable cannot be pickled: return it from the task on its own (the "
            "task then resolves to a hetflow.TableHandle of the whole table), or gather() it")


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
