"""Moving Arrow data between ranks as Arrow buffers, never by pickling.

:class:`RowExchange` is the all-to-all at the heart of shuffle, join and sort. The row routing
(which rows go to which rank) is fixed once; columns then move one ``Alltoallv`` at a time
(byte counts and formats first, with an ``Alltoall``), so an operation exchanges its keys first,
plans on them, and fetches each payload column only when it consumes it. Two formats:
- plain value buffers, for null-free fixed-width columns (integers, floats, temporals): rows
  are gathered with ``np.take`` straight into the send buffer and received straight into the
  result column, zero-copy from there on;
- otherwise an Arrow IPC stream per destination (Arrow's wire format: strings, booleans, nulls,
  anything), read back zero-copy from the receive buffer.
mpi4py >= 4 switches to MPI-4 large-count calls when a count exceeds 2**31 - 1, so a rank may
exchange more than 2 GiB with a peer (MPICH >= 4.0).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from mpi4py import MPI

from hetflow.frame._arrays import _single, arrow_of, from_values, plain_values, take_into
from hetflow.frame._phases import phase

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


_RAW, _IPC = 0, 1


class RowExchange:
    """One all-to-all routing of a partition's rows: rows ``order[offsets[d]:offsets[d+1]]`` go
    to rank d (collective to build: the row counts are exchanged here).

    Columns then move one at a time with :meth:`column`, so an operation can exchange its key
    columns, plan its work on them, and fetch each payload column only when it consumes it:
    at most one column's send and receive buffers exist at once, which keeps a rank's peak
    memory near its input plus its output. Null-free fixed-width columns travel as plain value
    buffers received straight into the result (no intermediate copy); others as an Arrow IPC
    stream per destination (strings, booleans, nulls, anything). Received rows are ordered by
    source rank, each source's rows in the order sent. Every rank must call :meth:`column` for
    the same columns in the same order.
    """

    def __init__(self, comm, order: np.ndarray, offsets: Sequence[int]):
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.order = order
        self.offsets = [int(o) for o in offsets]
        send_rows = np.diff(np.asarray(self.offsets, np.int64))
        if self.size > 1:
            self.recv_rows = np.zeros(self.size, np.int64)
            with phase("exchange"):
                comm.Alltoall(send_rows, self.recv_rows)
        else:
            self.recv_rows = send_rows
        self.num_rows = int(self.recv_rows.sum())

    def release(self) -> None:
        """Drop the routing (the row order) once the last column has been fetched."""
        self.order = None

    def _rows(self, d: int) -> np.ndarray:
        return self.order[self.offsets[d]:self.offsets[d + 1]]

    def column(self, col) -> pa.Array:
        """Exchange one column of the partition the routing was built for (collective)."""
        with phase("pack"):
            return self._column(col)

    def _column(self, col) -> pa.Array:
        arr = _single(col)
        if self.size == 1:
            idx = self._rows(0)
            if len(idx) == len(arr) and _is_identity(idx):
                return arr
            return arr.take(arrow_of(idx))
        size, rank = self.size, self.rank
        values = plain_values(arr)
        meta = np.zeros((size, 2), np.int64)  # per destination: bytes, format
        if values is not None:
            w = values.dtype.itemsize
            meta[:, 1] = _RAW
            for d in range(size):
                if d != rank:
                    meta[d, 0] = (self.offsets[d + 1] - self.offsets[d]) * w
            send = np.empty(int(meta[:, 0].sum()) // w, values.dtype)
            pos = 0
            for d in range(size):
                if d != rank and meta[d, 0]:
                    idx = self._rows(d)
                    take_into(values, idx, send[pos:pos + len(idx)])
                    pos += len(idx)
        else:
            meta[:, 1] = _IPC
            one = pa.schema([pa.field("c", arr.type)])
            sink = pa.BufferOutputStream()
            for d in range(size):
                idx = self._rows(d)
                if d == rank or not len(idx):
                    continue
                start = sink.tell()
                _write_stream(sink, one, pa.Table.from_arrays([arr.take(arrow_of(idx))], schema=one))
                meta[d, 0] = sink.tell() - start
            buf = sink.getvalue()
            del sink
            send = np.frombuffer(buf, np.uint8) if buf.size else np.empty(0, np.uint8)
        recv_meta = np.zeros((size, 2), np.int64)
        with phase("exchange"):
            self.comm.Alltoall(meta, recv_meta)
        send_bytes = send.view(np.uint8) if send.size else np.empty(0, np.uint8)
        if (recv_meta[:, 1] == _RAW).all() and values is not None:
            return self._receive_plain(arr.type, values, send_bytes, meta, recv_meta)
        return self._receive_mixed(arr, values, send_bytes, meta, recv_meta)

    def _receive_plain(self, t, values, send, meta, recv_meta) -> pa.Array:
        """Every source sent plain values: receive straight into the result, own rows copied
        into their slot, so the received column is one contiguous buffer."""
        w = values.dtype.itemsize
        out = np.empty(self.num_rows, values.dtype)
        row_displs = np.zeros(self.size, np.int64)
        np.cumsum(self.recv_rows[:-1], out=row_displs[1:])
        recv_counts = recv_meta[:, 0].copy()
        _check_large_counts(np.concatenate([meta[:, 0], recv_counts]))
        send_displs = np.zeros(self.size, np.int64)
        np.cumsum(meta[:-1, 0], out=send_displs[1:])
        with phase("exchange"):
            self.comm.Alltoallv([send, (meta[:, 0].copy(), send_displs), MPI.BYTE],
                                [out.view(np.uint8), (recv_counts, row_displs * w), MPI.BYTE])
        del send
        with phase("reassemble"):
            own = self._rows(self.rank)
            lo = int(row_displs[self.rank])
            take_into(values, own, out[lo:lo + len(own)])
            return from_values(t, out)

    def _receive_mixed(self, arr, values, send, meta, recv_meta) -> pa.Array:
        with phase("exchange"):
            recv = _alltoallv(self.comm, send, meta[:, 0].copy(), recv_meta[:, 0].copy())
        del send
        with phase("reassemble"):
            return self._assemble_mixed(arr, recv, recv_meta)

    def _assemble_mixed(self, arr, recv, recv_meta) -> pa.Array:
        recv_buf = pa.py_buffer(recv)
        one = pa.schema([pa.field("c", arr.type)])
        parts: List[pa.Array] = []
        displ = 0
        for src in range(self.size):
            count = int(recv_meta[src, 0])
            if src == self.rank:
                own = self._rows(src)
                if len(own):
                    parts.append(arr.take(arrow_of(own)))
            elif count:
                block = recv_buf.slice(displ, count)
                if recv_meta[src, 1] == _RAW:
                    parts.append(pa.Array.from_buffers(arr.type, int(self.recv_rows[src]),
                                                       [None, block]))
                else:
                    parts.extend(deserialize(block, one).column(0).chunks)
            displ += count
        if not parts:
            return arr.slice(0, 0)
        return pa.concat_arrays(parts) if len(parts) > 1 else parts[0]


def exchange_rows(comm, table: pa.Table, order: np.ndarray, offsets: Sequence[int]) -> pa.Table:
    """All-to-all of ``table``'s rows: rank d gets rows ``order[offsets[d]:offsets[d+1]]``.

    Returns the rows this rank receives, ordered by source rank, each source's rows in the
    order sent; each column is moved separately (see :class:`RowExchange`).
    """
    ex = RowExchange(comm, order, offsets)
    columns = [ex.column(c) for c in table.columns]
    return pa.Table.from_arrays(columns, schema=table.schema)


def _is_identity(idx: np.ndarray) -> bool:
    return bool(len(idx) == 0 or (idx[0] == 0 and np.all(np.diff(idx) == 1)))


def _alltoallv(comm, send: np.ndarray, send_counts: np.ndarray,
               recv_counts: np.ndarray) -> np.ndarray:
    _check_large_counts(np.concatenate([send_counts, recv_counts]))
    size = comm.Get_size()
    send_displs = np.zeros(size, np.int64)
    np.cumsum(send_counts[:-1], out=send_displs[1:])
    recv_displs = np.zeros(size, np.int64)
    np.cumsum(recv_counts[:-1], out=recv_displs[1:])
    recv = np.empty(int(recv_counts.sum()), np.uint8)
    comm.Alltoallv([send, (send_counts, send_displs), MPI.BYTE],
                   [recv, (recv_counts, recv_displs), MPI.BYTE])
    return recv


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
    with phase("split"):
        return _split_by(dest, parts)


def _split_by(dest: np.ndarray, parts: int):
    counts = np.bincount(dest, minlength=parts)
    offsets = np.zeros(parts + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    small = dest.astype(np.uint16 if parts <= 2**16 else np.int64, copy=False)
    order = np.argsort(small, kind="stable")  # radix sort for 16-bit keys: O(n)
    if len(order) < 2**31 - 1:
        order = order.astype(np.int32)  # half the memory of the routing, kept while columns move
    return order, offsets
