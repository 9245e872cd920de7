"""Moving Arrow data between ranks as Arrow buffers, never by pickling.

``exchange_rows`` is the all-to-all at the heart of shuffle and sort. Each rank packs the rows
bound for every other rank back to back in one send buffer and a single ``Alltoallv`` of bytes
moves them (byte counts, formats and row counts first, with an ``Alltoall``). Two formats:
- plain column buffers, when every column is fixed-width (integers, floats, temporals) and this
  rank has no nulls: rows are gathered with ``np.take`` straight into the send buffer (no
  intermediate table) and received as zero-copy Arrow arrays over the receive buffer;
- otherwise an Arrow IPC stream per destination (Arrow's wire format: strings, booleans, nulls,
  anything), read back zero-copy from the receive buffer.
Rows a rank keeps stay in memory. mpi4py >= 4 switches to MPI-4 large-count calls when a count
exceeds 2**31 - 1, so a rank may exchange more than 2 GiB with a peer (MPICH >= 4.0).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

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


_RAW, _IPC = 0, 1
_ALIGN = 64


def _raw_widths(schema: pa.Schema):
    """Byte width of each column when every column is a fixed-width primitive (not bit-packed
    booleans), else None: such rows, when null-free, travel as plain column buffers."""
    widths = []
    for field in schema:
        t = field.type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or
                (pa.types.is_temporal(t) and not pa.types.is_interval(t))):
            return None
        widths.append(t.bit_width // 8)
    return widths if widths else None


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _raw_block_size(rows: int, widths) -> int:
    return sum(_padded(rows * w) for w in widths)


def _column_numpy(col: pa.ChunkedArray, width: int) -> np.ndarray:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    buf = arr.buffers()[1]
    dtype = np.dtype(f"u{width}")
    return np.frombuffer(buf, dtype, count=len(arr), offset=arr.offset * width)


def _read_raw(schema: pa.Schema, widths, block, rows: int) -> pa.Table:
    """Zero-copy columns over one raw block (``block``: a pa.Buffer of ``rows`` rows)."""
    arrays, offset = [], 0
    for field, w in zip(schema, widths):
        arrays.append(pa.Array.from_buffers(field.type, rows,
                                            [None, block.slice(offset, rows * w)]))
        offset += _padded(rows * w)
    return pa.Table.from_arrays(arrays, schema=schema)


def exchange_rows(comm, table: pa.Table, order: np.ndarray, offsets: Sequence[int]) -> pa.Table:
    """All-to-all of ``table``'s rows: rank d gets rows ``order[offsets[d]:offsets[d+1]]``.

    Returns the rows this rank receives, ordered by source rank, each source's rows in the
    order sent. When every column is fixed-width without nulls, rows are gathered straight
    into the send buffer as plain Arrow column buffers (no intermediate table, read back
    zero-copy); otherwise each destination's rows go as an Arrow IPC stream.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    offsets = [int(o) for o in offsets]
    schema = table.schema

    def rows_for(d: int) -> Optional[pa.Table]:
        lo, hi = offsets[d], offsets[d + 1]
        if hi == lo:
            return None
        if hi - lo == table.num_rows and _is_identity(order[lo:hi]):
            return table  # every row goes to d, in order: no copy
        return table.take(pa.array(order[lo:hi]))

    if size == 1:
        kept = rows_for(0)
        return kept if kept is not None else schema.empty_table()
    widths = _raw_widths(schema)
    raw = widths is not None and not any(col.null_count for col in table.columns)
    meta = np.zeros((size, 3), np.int64)  # per destination: bytes, format, rows
    meta[:, 2] = np.diff(offsets)
    if raw:
        meta[:, 1] = _RAW
        for d in range(size):
            if d != rank:
                meta[d, 0] = _raw_block_size(offsets[d + 1] - offsets[d], widths)
        send = np.empty(int(meta[:, 0].sum()), np.uint8)
        columns = [_column_numpy(table.column(i), w) for i, w in enumerate(widths)]
        pos = 0
        for d in range(size):
            if d == rank or not meta[d, 0]:
                continue
            idx = order[offsets[d]:offsets[d + 1]]
            for values, w in zip(columns, widths):
                out = send[pos:pos + len(idx) * w].view(values.dtype)
                np.take(values, idx, out=out)
                pos += _padded(len(idx) * w)
        del columns
    else:
        meta[:, 1] = _IPC
        sink = pa.BufferOutputStream()
        for d in range(size):
            if d == rank:
                continue
            rows = rows_for(d)
            if rows is None or rows.num_rows == 0:
                continue
            start = sink.tell()
            _write_stream(sink, schema, rows)
            del rows
            meta[d, 0] = sink.tell() - start
        buf = sink.getvalue()
        del sink
        send = np.frombuffer(buf, np.uint8) if buf.size else np.empty(0, np.uint8)
    kept = rows_for(rank)
    recv_meta = np.zeros((size, 3), np.int64)
    comm.Alltoall(meta, recv_meta)
    recv = _alltoallv(comm, send, meta[:, 0].copy(), recv_meta[:, 0].copy())
    del send
    recv_buf = pa.py_buffer(recv)
    parts: List[pa.Table] = []
    displ = 0
    for src in range(size):
        count = int(recv_meta[src, 0])
        if src == rank:
            if kept is not None and kept.num_rows:
                parts.append(kept)
        elif count:
            block = recv_buf.slice(displ, count)
            parts.append(_read_raw(schema, widths, block, int(recv_meta[src, 2]))
                         if recv_meta[src, 1] == _RAW else deserialize(block, schema))
        displ += count
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


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
    counts = np.bincount(dest, minlength=parts)
    offsets = np.zeros(parts + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    small = dest.astype(np.uint16 if parts <= 2**16 else np.int64, copy=False)
    order = np.argsort(small, kind="stable")  # radix sort for 16-bit keys: O(n)
    return order, offsets
