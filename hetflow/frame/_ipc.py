"""Whole tables between ranks as Arrow IPC streams: one table to a buffer and back, every
rank's partition to one rank (:func:`gather`) or to all of them (:func:`allgather`)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from hetflow.frame._mpi import MPI, check_large_counts, starts, wait_all


def write_stream(sink, schema: pa.Schema, table: pa.Table) -> None:
    with ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)


def serialize(table: pa.Table) -> pa.Buffer:
    """One table as an Arrow IPC stream in a buffer."""
    sink = pa.BufferOutputStream()
    write_stream(sink, table.schema, table)
    return sink.getvalue()


def deserialize(buf, schema: Optional[pa.Schema] = None) -> pa.Table:
    """Read an IPC stream (zero-copy from ``buf``); an empty buffer gives ``schema``'s empty table."""
    if len(buf) == 0:
        return schema.empty_table()
    return ipc.open_stream(pa.py_buffer(buf) if not isinstance(buf, pa.Buffer) else buf).read_all()



def gather(comm, table: pa.Table, root: int = 0) -> Optional[pa.Table]:
    """The concatenation of every rank's table (in rank order) on ``root``; ``None`` elsewhere."""
    payload = serialize(table) if table.num_rows else pa.py_buffer(b"")
    counts = comm.gather(payload.size, root=root)
    if comm.Get_rank() == root:
        counts = np.asarray(counts, np.int64)
        check_large_counts(counts)
        displs = starts(counts)
        recv = np.empty(int(counts.sum()), np.uint8)
        comm.Gatherv(np.frombuffer(payload, np.uint8) if payload.size else np.empty(0, np.uint8),
                     [recv, (counts, displs), MPI.BYTE], root=root)
        return _concat_streams(recv, counts, displs, table.schema)
    comm.Gatherv(np.frombuffer(payload, np.uint8) if payload.size else np.empty(0, np.uint8),
                 None, root=root)
    return None


def allgather(comm, table: pa.Table) -> pa.Table:
    """The concatenation of every rank's table (in rank order) on every rank (collective):
    one ``Allgatherv`` of Arrow IPC streams."""
    payload = serialize(table) if table.num_rows else pa.py_buffer(b"")
    counts = np.asarray(comm.allgather(payload.size), np.int64)
    check_large_counts(counts)
    displs = starts(counts)
    recv = np.empty(int(counts.sum()), np.uint8)
    send = np.frombuffer(payload, np.uint8) if payload.size else np.empty(0, np.uint8)
    wait_all([comm.Iallgatherv(send, [recv, (counts, displs), MPI.BYTE])])
    return _concat_streams(recv, counts, displs, table.schema)


def _concat_streams(recv: np.ndarray, counts, displs, schema: pa.Schema) -> pa.Table:
    """One table of the Arrow IPC streams received back to back in ``recv`` (rank order)."""
    buf = pa.py_buffer(recv)
    parts = [deserialize(buf.slice(int(d), int(c)), schema) for d, c in zip(displs, counts) if c]
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts).combine_chunks()

