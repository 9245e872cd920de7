"""Distributed tables handed between tasks.

A task whose ranks return a :class:`hetflow.frame.DistributedTable` resolves to a
:class:`TableHandle` for the whole table: every rank's partition, in rank order. The
partitions stay where the runtime can keep them (the ``pool``: in its ranks' memory, as
:func:`hetflow.keep` keeps objects), and are otherwise written as Parquet, one owner-only
file per rank, under the runtime's dir in the run dir (removed with it). Passing the handle
to a later task delivers a ``DistributedTable`` on that task's communicator:

- the same number of ranks: rank ``i`` gets partition ``i`` as it was;
- another number: the rows are split into equal contiguous ranges of the table's global
  order (partition 0's rows first), so order is kept and ranks are balanced;
- a pool's table given to another rank count, another pool or another runtime travels
  once through the client (a gather on its own ranks), inside the task's payload.

On the client, :meth:`TableHandle.to_arrow` gives the whole table. Files are read back as
Parquet, never unpickled, and only when this user owns them and nobody else may read them.

Rank side: :func:`hand_over` (the runner, on a returned table) and :func:`materialize`
(the runner, on a task's arguments). Client side: :func:`assemble` (the runner's
``collect``) and :func:`prepare` (the kernel, on a task's arguments).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from hetflow.errors import TableHandoffError

#: The runtime's subdirectory holding the Parquet partitions of handed-over tables.
TABLES_DIR = "tables"


def is_table(value: Any) -> bool:
    """Whether ``value`` is a ``frame.DistributedTable`` (without importing the engine)."""
    kind = type(value)
    return kind.__name__ == "DistributedTable" and kind.__module__ == "hetflow.frame._table"


@dataclass(frozen=True)
class Partition:
    """One rank's part of a handed-over table: where it is, and its shape."""

    position: int            # its rank in the table's communicator (its place in the order)
    rows: int
    schema: Any              # pyarrow.Schema
    backend: str = "cpu"
    path: str = ""           # a Parquet file, or
    pool: str = ""           # a pool's uid, its resident key and the pool slot holding it
    key: str = ""
    slot: int = -1


@dataclass(frozen=True, eq=False)
class TableHandle:
    """The whole distributed table a task returned: pass it to a later task (any rank
    count, any runtime) to get a ``DistributedTable`` there, or read it here with
    :meth:`to_arrow` / :meth:`to_pandas`."""

    parts: Tuple[Partition, ...]
    origin: str = ""         # "task 3 (mpirun)": named in errors

    @property
    def ranks(self) -> int:
        """How many partitions (the rank count of the task that made it)."""
        return len(self.parts)

    @property
    def rows(self) -> Tuple[int, ...]:
        """Rows per partition, in order."""
        return tuple(p.rows for p in self.parts)

    @property
    def num_rows(self) -> int:
        return sum(self.rows)

    @property
    def schema(self):
        return self.parts[0].schema

    @property
    def pool(self) -> Optional[str]:
        """The uid of the pool whose ranks hold the partitions (None: Parquet files)."""
        return self.parts[0].pool or None

    @property
    def slots(self) -> Tuple[int, ...]:
        """The pool slots holding the partitions, in order (a pool's table only)."""
        return tuple(p.slot for p in self.parts)

    @property
    def key(self) -> str:
        return self.parts[0].key

    @property
    def paths(self) -> Tuple[str, ...]:
        """The Parquet files holding the partitions, in order (empty for a pool's table)."""
        return tuple(p.path for p in self.parts if p.path)

    def to_arrow(self):
        """The whole table as one ``pyarrow.Table`` on the client, in global order."""
        if self.pool:
            return _from_pool(self)
        import pyarrow as pa

        return pa.concat_tables([_read(self, p) for p in self.parts])

    def to_pandas(self):
        """:meth:`to_arrow` as a ``pandas.DataFrame``."""
        return self.to_arrow().to_pandas()

    def __repr__(self):
        where = (f"pool slots {list(self.slots)}" if self.pool
                 else f"{len(self.parts)} Parquet file(s)")
        return (f"TableHandle({self.num_rows} rows in {self.ranks} partition(s) on {where}, "
                f"columns={self.schema.names}, from {self.origin or 'a task'})")


class InlineTable:
    """A whole table carried inside a task's payload (one Arrow IPC stream) with its
    partitions' row counts: what a pool's table becomes on its way to other ranks."""

    def __init__(self, data: bytes, rows: Tuple[int, ...], origin: str = ""):
        self.data, self.rows, self.origin = data, tuple(rows), origin

    def __reduce__(self):
        return (InlineTable, (self.data, self.rows, self.origin))

    @classmethod
    def of(cls, table, rows, origin: str = "") -> "InlineTable":
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return cls(sink.getvalue().to_pybytes(), rows, origin)

    def table(self):
        import pyarrow as pa

        return pa.ipc.open_stream(pa.py_buffer(self.data)).read_all()


# ----------------------------------------------------------------------------- rank side
def hand_over(table, comm, tables_dir: Optional[str], task_id) -> Partition:
    """This rank's part of a returned table, kept (pool) or written (elsewhere)."""
    size = table.comm.Get_size() if table.comm is not None else 0
    if size != comm.Get_size():
        raise TableHandoffError(
            f"task {task_id} returned a DistributedTable on a communicator of {size} rank(s), "
            f"but the task has {comm.Get_size()}: only a table over all of the task's ranks "
            "can be handed over (gather() it, or return it from a task of that size)")
    position, local = table.comm.Get_rank(), table.local
    from hetflow import resident

    task = resident.current_task()
    if task is not None:            # a pool rank: the partition stays in its memory
        key = f"{task_id}.table"
        resident._store[key] = table
        return Partition(position, local.num_rows, local.schema, table.backend,
                         pool=resident._pool_uid, key=key, slot=task["slot"])
    if not tables_dir:
        raise TableHandoffError(f"task {task_id}: this runtime gave its ranks no directory to "
                                "write a returned DistributedTable to")
    import pyarrow.parquet as pq

    from hetflow._private import private_dir

    where = private_dir(os.path.join(tables_dir, f"task-{task_id}"))
    path = os.path.join(where, f"part-{position:05d}-{os.urandom(4).hex()}.parquet")
    # Created owner-only before pyarrow opens it (it would create it with the umask's mode).
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    pq.write_table(local, path)
    return Partition(position, local.num_rows, local.schema, table.backend, path=path)


def materialize(args: tuple, kwargs: dict, comm) -> Tuple[tuple, dict]:
    """The task's arguments with every handed-over table made a ``DistributedTable`` on
    ``comm`` (top level, and one level down in lists, tuples and dicts)."""
    if not _any_table(args, kwargs, (TableHandle, InlineTable)):
        return args, kwargs
    return _replace(args, kwargs, lambda value: _on_ranks(value, comm),
                    (TableHandle, InlineTable))


def _on_ranks(value, comm):
    from hetflow.frame import DistributedTable

    rank, size = comm.Get_rank(), comm.Get_size()
    if isinstance(value, InlineTable):
        whole = value.table()
        start, end = _share(value.rows, rank, size)
        return DistributedTable(comm, whole.slice(start, end - start))
    same = size == value.ranks
    backend = value.parts[rank].backend if same else "cpu"
    if value.pool:
        return DistributedTable(comm, _resident_part(value, rank, size), backend=backend)
    import pyarrow as pa

    start, end = _share(value.rows, rank, size)
    pieces, offset = [], 0
    for part in value.parts:
        lo, hi = max(start, offset), min(end, offset + part.rows)
        if lo < hi:
            pieces.append(_read(value, part).slice(lo - offset, hi - lo))
        offset += part.rows
    local = pa.concat_tables(pieces) if pieces else value.schema.empty_table()
    return DistributedTable(comm, local, backend=backend)


def _share(rows, rank: int, size: int) -> Tuple[int, int]:
    """Rank ``rank``'s global row range: its own partition's when the rank count is the
    table's, else an equal contiguous share of all rows."""
    if len(rows) == size:
        start = sum(rows[:rank])
        return start, start + rows[rank]
    total = sum(rows)
    return total * rank // size, total * (rank + 1) // size


def _resident_part(handle: TableHandle, rank: int, size: int):
    from hetflow import resident

    task = resident.current_task()
    if task is None or handle.pool != resident._pool_uid:
        raise TableHandoffError(f"{handle!r} lives on a pool's ranks, and this task does not "
                                "run on that pool (the runtime should have sent it inline)")
    if size != handle.ranks or task["slot"] != handle.parts[rank].slot:
        raise TableHandoffError(f"{handle!r}: task rank {rank} runs on pool slot "
                                f"{task['slot']}, not on the slot holding partition {rank}")
    return resident.stored(handle.key, handle, "DistributedTable").local


def _read(handle: TableHandle, part: Partition):
    """A partition's Parquet file, after checking that nobody but this user could have
    written or read it."""
    import pyarrow.parquet as pq

    try:
        info = os.stat(part.path)
    except FileNotFoundError:
        raise TableHandoffError(
            f"{handle!r}: its file {part.path} is gone. A handed-over table's files are "
            "removed with its run dir (runtime(keep_run_dir=True) or a given run_dir keeps "
            "them)") from None
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise TableHandoffError(f"{handle!r}: {part.path} is not owner-only (mode "
                                f"{info.st_mode & 0o777:o}, owner {info.st_uid}): not read")
    table = pq.read_table(part.path)
    if table.num_rows != part.rows or not table.schema.equals(part.schema):
        raise TableHandoffError(f"{handle!r}: {part.path} holds {table.num_rows} rows of "
                                f"{table.schema.names}, not the {part.rows} it was written with")
    return table


# ----------------------------------------------------------------------------- client side
def assemble(values, origin: str) -> TableHandle:
    """The handle to a table from every rank's :class:`Partition` (in task-rank order)."""
    values = list(values)
    odd = [r for r, v in enumerate(values) if not isinstance(v, Partition)]
    if odd:
        raise TableHandoffError(
            f"{origin}: rank(s) {[r for r in range(len(values)) if r not in odd]} returned a "
            f"DistributedTable but rank(s) {odd} returned {type(values[odd[0]]).__name__}: "
            "every rank must return the table for it to be handed over")
    parts = tuple(sorted(values, key=lambda p: p.position))
    if [p.position for p in parts] != list(range(len(parts))):
        raise TableHandoffError(f"{origin}: the returned tables' ranks were "
                                f"{[p.position for p in values]}, not one table over the task")
    first = parts[0].schema
    for part in parts[1:]:
        if not part.schema.equals(first):
            raise TableHandoffError(
                f"{origin}: the returned table's partitions disagree on their schema: "
                f"partition 0 has {first}, partition {part.position} has {part.schema}")
    return TableHandle(parts, origin)


def prepare(executor, resources, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """A task's arguments as its ranks can take them: a pool's table stays a handle only
    for a task of the same size on that same pool (which then runs on its ranks);
    anywhere else it is read once through the client and carried inline."""
    if not _any_table(args, kwargs, (TableHandle,)):
        return args, kwargs
    uid = getattr(executor, "uid", None)

    def convert(handle: TableHandle):
        if not handle.pool or (handle.pool == uid and handle.ranks == resources.ranks):
            return handle
        return InlineTable.of(_from_pool(handle), handle.rows, handle.origin)

    return _replace(args, kwargs, convert, (TableHandle,))


def _from_pool(handle: TableHandle):
    """A pool's table gathered on its own ranks and brought to the client."""
    from parsl.dataflow.dflow import DataFlowKernelLoader

    from hetflow._task import MPITask
    from hetflow.spec import Resources

    try:
        executors = DataFlowKernelLoader.dfk().executors.values()
    except Exception:   # noqa: BLE001 - Parsl says "no DFK loaded" in its own words
        executors = ()
    for executor in executors:
        if getattr(executor, "uid", None) == handle.pool:
            spec = Resources(ranks=handle.ranks).to_spec()
            return executor.submit(MPITask(_gather), spec, handle).result()
    raise TableHandoffError(f"{handle!r}: the pool holding it is no longer loaded (a pool's "
                            "tables live as long as its ranks; to_arrow() it before its "
                            "runtime ends)")


def _gather(comm, table):
    return table.gather()


def _any_table(args, kwargs, kinds) -> bool:
    def hit(value, depth):
        if isinstance(value, kinds):
            return True
        if depth and isinstance(value, (list, tuple)):
            return any(hit(item, 0) for item in value)
        if depth and isinstance(value, dict):
            return any(hit(item, 0) for item in value.values())
        return False

    return any(hit(v, 1) for v in args) or any(hit(v, 1) for v in kwargs.values())


def _replace(args, kwargs, convert, kinds) -> Tuple[tuple, dict]:
    def swap(value, depth):
        if isinstance(value, kinds):
            return convert(value)
        if depth and isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(swap(item, 0) for item in value)
        if depth and isinstance(value, dict):
            return {k: swap(item, 0) for k, item in value.items()}
        return value

    return (tuple(swap(v, 1) for v in args), {k: swap(v, 1) for k, v in kwargs.items()})


__all__ = ["TableHandle", "TableHandoffError", "Partition", "InlineTable", "TABLES_DIR"]
