"""Moving Arrow data between ranks in Arrow's own wire format (IPC streams), never by pickling.

``exchange`` is the all-to-all at the heart of shuffle and sort: each rank serialises the rows
bound for every other rank as one Arrow IPC stream, all streams back to back in one send buffer,
and a single ``Alltoallv`` of bytes moves them (byte counts first, with an ``Alltoall``). Received
streams are read zero-copy from the receive buffer. Rows a rank keeps stay in memory untouched.
mpi4py >= 4 switches to MPI-4 large-count calls when a count exceeds 2**31 - 1, so a rank may
send or receive more than 2 GiB (MPICH >= 4 / Open MPI >= 5 provide them).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from mpi4py import MPI

_INT_MAX = 2**31 - 1


def _write_stream(sink, schema: pa.Schema, table: pa.Table) -> None:
    with ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)


def serialize(table: pa.Table) -> pa.Buffer:
    """One table as an Arrow IPC stream in a buffer."""
    sink = pa.BufferOutputStream()
    _write_stream(sink, table.schema, table)
    return sink.getvalue()


def deserialize(buf, schema: Optional[pa.Schema] = None) -> pa.Table:
    """Read an IPC stream (zero-copy from ``buf``); an empty buffer gives ``schema``'s empty table."""
    if len(buf) == 0:
        return schema.empty_table()
    return ipc.open_stream(pa.py_buffer(buf) if not isinstance(buf, pa.Buffer) else buf).read_all()


def _check_large_counts(counts: np.ndarray) -> None:
    if counts.max(initial=0) > _INT_MAX and MPI.Get_version() < (4, 0):
        from hetflow.errors import NotSupported
        raise NotSupported(f"a rank would exchange {int(counts.max())} bytes with one peer, "
                           "more than 2**31-1, and this MPI library predates MPI-4 large counts")


def exchange(comm, schema: pa.Schema, part: Callable[[int], Optional[pa.Table]]) -> pa.Table:
    """All-to-all: ``part(d)`` gives the rows for rank ``d``; returns the rows received, in rank order.

    ``part`` is called once per destination, in order, so the caller can build each slice lazily
    and let it be freed once serialised (peak memory: one send buffer plus one receive buffer).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    kept = part(rank)
    if size == 1:
        return kept if kept is not None else schema.empty_table()
    sink = pa.BufferOutputStream()
    send_counts = np.zeros(size, np.int64)
    for dest in range(size):
        if dest == rank:
            continue
        rows = part(dest)
        if rows is None or rows.num_rows == 0:
            continue
        start = sink.tell()
        _write_stream(sink, schema, rows)
        del rows
        send_counts[dest] = sink.tell() - start
    send = sink.getvalue()
    del sink
    recv_counts = np.zeros(size, np.int64)
    comm.Alltoall(send_counts, recv_counts)
    _check_large_counts(np.concatenate([send_counts, recv_counts]))
    send_displs = np.zeros(size, np.int64)
    np.cumsum(send_counts[:-1], out=send_displs[1:])
    recv_displs = np.zeros(size, np.int64)
    np.cumsum(recv_counts[:-1], out=recv_displs[1:])
    recv = np.empty(int(recv_counts.sum()), np.uint8)
    send_view = np.frombuffer(send, np.uint8) if send.size else np.empty(0, np.uint8)
    comm.Alltoallv([send_view, (send_counts, send_displs), MPI.BYTE],
                   [recv, (recv_counts, recv_displs), MPI.BYTE])
    del send_view, send
    recv_buf = pa.py_buffer(recv)
    parts: List[pa.Table] = []
    for src in range(size):
        if src == rank:
            if kept is not None and kept.num_rows:
                parts.append(kept)
            continue
        if recv_counts[src]:
            parts.append(deserialize(recv_buf.slice(int(recv_displs[src]),
                                                    int(recv_counts[src])), schema))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def gather(comm, table: pa.Table, root: int = 0) -> Optional[pa.Table]:
    """The concatenation of every rank's table (in rank order) on ``root``; ``None`` elsewhere."""
    payload = serialize(table) if table.num_rows else pa.py_buffer(b"")
    counts = comm.gather(payload.size, root=root)
    if comm.Get_rank() == root:
        counts = np.asarray(counts, np.int64)
        _check_large_counts(counts)
        displs = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        recv = np.empty(int(counts.sum()), np.uint8)
        comm.Gatherv(np.frombuffer(payload, np.uint8) if payload.size else np.empty(0, np.uint8),
                     [recv, (counts, displs), MPI.BYTE], root=root)
        buf = pa.py_buffer(recv)
        parts = [deserialize(buf.slice(int(d), int(c)), table.schema)
                 for d, c in zip(displs, counts) if c]
        parts = [p for p in parts if p.num_rows]
        if not parts:
            return table.schema.empty_table()
        return pa.concat_tables(parts).combine_chunks()
    comm.Gatherv(np.frombuffer(payload, np.uint8) if payload.size else np.empty(0, np.uint8),
                 None, root=root)
    return None


def split_by(dest: np.ndarray, parts: int):
    """Stable grouping of row indices by destination: (order, offsets) with rows for d at
    ``order[offsets[d]:offsets[d+1]]`` in their original relative order."""
    counts = np.bincount(dest, minlength=parts)
    offsets = np.zeros(parts + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    small = dest.astype(np.uint16 if parts <= 2**16 else np.int64, copy=False)
    order = np.argsort(small, kind="stable")  # radix sort for 16-bit keys: O(n)
    return order, offsets


def take_ranges(table: pa.Table, order: np.ndarray, offsets: Sequence[int]):
    """``part(d)`` for :func:`exchange`: the rows ``order[offsets[d]:offsets[d+1]]``."""
    def part(d: int) -> Optional[pa.Table]:
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        if hi == lo:
            return None
        if hi - lo == table.num_rows:
            return table  # every row goes to d, in order: no copy
        return table.take(pa.array(order[lo:hi]))
    return part
