"""Moving Arrow data between ranks as Arrow buffers, never by pickling.

:class:`RowExchange` is the all-to-all at the heart of shuffle, join and sort. The row routing
(which rows go to which rank) is fixed once; columns then move one ``Alltoallv`` at a time
(byte counts and formats first, with an ``Alltoall``), so an operation exchanges its keys first,
plans on them, and fetches each payload column only when it consumes it. Small partitions
(latency-bound) instead move all their columns in one ``Alltoallv`` (:func:`fetch_together`).
Two formats:
- plain value buffers, for null-free fixed-width columns (integers, floats, temporals): rows
  are gathered with ``np.take`` straight into the send buffer and received straight into the
  result column, zero-copy from there on;
- fixed-width columns with nulls (on any rank) as two such buffers: the values, whatever a
  null slot holds, and the validity as one byte a row;
- otherwise an Arrow IPC stream per destination (Arrow's wire format: strings, booleans, nulls,
  anything), read back zero-copy from the receive buffer.
mpi4py >= 4 switches to MPI-4 large-count calls when a count exceeds 2**31 - 1, so a rank may
exchange more than 2 GiB with a peer (MPICH >= 4.0).

MPI itself (the lazy import, sleeping waits, the raw byte collectives) is :mod:`._mpi`; whole
tables as IPC streams (gather, allgather) are :mod:`._ipc`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import pyarrow as pa

from hetflow.frame._arrays import (_raw_width, _single, arrow_of, destination_dtype, empty,
                                   from_values, plain_values, take_into, to_numpy,
                                   value_buffer)
from hetflow.frame._ipc import deserialize, write_stream
from hetflow.frame._mpi import MPI, alltoallv, check_large_counts, starts, wait_all
from hetflow.frame._phases import phase

_RAW, _IPC = 0, 1  # a column's wire format: plain value buffers, or an IPC stream


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

    With ``table`` (the partition the routing is for), the row counts and which of its columns
    are plain on each rank travel in the one small ``Alltoall`` made here, and a column asked
    for by name (``column("value")``) that is plain everywhere moves with no further control
    message: its byte counts follow from the row counts.
    """

    def __init__(self, comm, order: np.ndarray, offsets: Sequence[int],
                 table: Optional[pa.Table] = None, *, _control: Optional[np.ndarray] = None):
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.order = order
        self.offsets = [int(o) for o in offsets]
        self.table = table
        ncols = table.num_columns if table is not None else 0
        self.plain_everywhere = [False] * ncols
        if self.size > 1:
            send = self._control_block()
            if _control is None:  # received already when built by :meth:`several`
                _control = np.empty_like(send)
                wait_all([comm.Ialltoall(send, _control)])
            self.recv_rows = _control[:, 0].copy()
            self.plain_everywhere = [not _control[:, 1 + c].any() and not send[0, 1 + c]
                                     for c in range(ncols)]
        else:
            self.recv_rows = self.send_rows
        self.num_rows = int(self.recv_rows.sum())

    @property
    def send_rows(self) -> np.ndarray:
        """Rows this rank sends to each destination (a new array each time)."""
        return np.diff(np.asarray(self.offsets, np.int64))

    def _control_block(self) -> np.ndarray:
        """Per destination: the rows sent there, then one flag per column of ``table`` (1 if it
        is not plain here: the test plain_values makes, without combining a chunked column)."""
        table = self.table
        ncols = table.num_columns if table is not None else 0
        send = np.empty((self.size, 1 + ncols), np.int64)
        send[:, 0] = self.send_rows
        if ncols:
            send[:, 1:] = [[_raw_width(c.type) is None or c.null_count > 0
                            for c in table.columns]]
        return send

    @classmethod
    def several(cls, comm, routes) -> List["RowExchange"]:
        """One exchange per ``(order, offsets, table)`` of ``routes`` (collective), their row
        counts and column flags moved by a single ``Alltoall``: one wait for the peers instead
        of one per table (on a loaded node every wait may cost a peer's time slice)."""
        if comm.Get_size() == 1 or len(routes) == 1:
            return [cls(comm, *r) for r in routes]
        probes = [cls.__new__(cls) for _ in routes]
        blocks = []
        for probe, (_order, offsets, table) in zip(probes, routes):
            probe.size, probe.table = comm.Get_size(), table
            probe.offsets = [int(o) for o in offsets]
            blocks.append(probe._control_block())
        send = np.ascontiguousarray(np.concatenate(blocks, axis=1))
        recv = np.empty_like(send)
        wait_all([comm.Ialltoall(send, recv)])
        out, c = [], 0
        for (order, offsets, table), block in zip(routes, blocks):
            width = block.shape[1]
            out.append(cls(comm, order, offsets, table, _control=recv[:, c:c + width]))
            c += width
        return out

    def release(self) -> None:
        """Drop the routing (the row order) once the last column has been fetched."""
        self.order = None
        self.table = None

    def _rows(self, d: int) -> np.ndarray:
        return self.order[self.offsets[d]:self.offsets[d + 1]]

    def _index(self, col) -> int:
        i = col if isinstance(col, int) else self.table.schema.get_field_index(col)
        if i < 0:  # a missing or repeated name: Arrow's own KeyError
            self.table.column(col)
        return i

    def column(self, col) -> pa.Array:
        """Exchange one column of the partition the routing was built for (collective): an
        array, or the name or index of a column of the ``table`` given at construction."""
        with phase("pack"):
            known = nullable_fixed = False
            if isinstance(col, (str, int)):
                i = self._index(col)
                known = self.size > 1 and self.plain_everywhere[i]
                # fixed-width with nulls on some rank (the type is the same on every rank)
                nullable_fixed = (self.size > 1 and not known and
                                  _raw_width(self.table.schema.field(i).type) is not None)
                col = self.table.column(i)
            arr = _single(col)
            if self.size == 1:
                idx = self._rows(0)
                if len(idx) == len(arr) and _is_identity(idx):
                    return arr
                return arr.take(arrow_of(idx))
            values = plain_values(arr)
            if known:
                return self._plain(arr.type, values)
            if nullable_fixed:
                return self._with_validity(arr)
            return self._column(arr, values)

    def _pack_plain(self, values: np.ndarray) -> np.ndarray:
        """Every other destination's rows gathered, in destination order, into one buffer."""
        size, rank = self.size, self.rank
        n = sum(self.offsets[d + 1] - self.offsets[d] for d in range(size) if d != rank)
        send = empty(n, values.dtype)
        pos = 0
        for d in range(size):
            if d != rank:
                idx = self._rows(d)
                take_into(values, idx, send[pos:pos + len(idx)])
                pos += len(idx)
        return send

    def _with_validity(self, arr: pa.Array) -> pa.Array:
        """A fixed-width column with nulls on some rank: its value buffer (whatever a null
        slot holds) and its validity as one byte a row, each moved as a plain column, instead
        of Arrow IPC streams (a take per destination, the stream's copy, a take of the own rows
        and a concatenation)."""
        values = value_buffer(arr)
        valid = (to_numpy(arr.is_valid()) if arr.null_count else np.ones(len(arr), bool))
        got = self._plain_values(values)
        got_valid = self._plain_values(valid.view(np.uint8)).view(bool)
        return from_values(arr.type, got, got_valid)

    def _plain(self, t, values: np.ndarray) -> pa.Array:
        """A column plain on every rank (see :meth:`_plain_values`), as an Arrow array."""
        return from_values(t, self._plain_values(values))

    def _plain_values(self, values: np.ndarray) -> np.ndarray:
        """Plain values of every rank's routed rows: gathered into one send buffer and
        received straight into the result (one contiguous buffer, zero-copy into Arrow);
        this rank's own rows are copied into their slot while the transfer runs."""
        w = values.dtype.itemsize
        send_rows = self.send_rows
        send_rows[self.rank] = 0
        recv_rows = self.recv_rows.copy()
        recv_rows[self.rank] = 0
        send = self._pack_plain(values)
        check_large_counts(np.concatenate([send_rows, recv_rows]) * w)
        out = empty(self.num_rows, values.dtype)
        row_displs = starts(self.recv_rows)
        send_displs = starts(send_rows)
        req = self.comm.Ialltoallv(
            [send.view(np.uint8), (send_rows * w, send_displs * w), MPI.BYTE],
            [out.view(np.uint8), (recv_rows * w, row_displs * w), MPI.BYTE])
        with phase("reassemble"):
            own = self._rows(self.rank)
            lo = int(row_displs[self.rank])
            take_into(values, own, out[lo:lo + len(own)])
        wait_all([req])
        del send
        return out

    def _column(self, arr, values) -> pa.Array:
        size, rank = self.size, self.rank
        meta = np.zeros((size, 2), np.int64)  # per destination: bytes, format
        if values is not None:
            meta[:, 1] = _RAW
        else:
            meta[:, 1] = _IPC
        recv_meta = np.zeros((size, 2), np.int64)
        if values is not None:
            w = values.dtype.itemsize
            for d in range(size):
                if d != rank:
                    meta[d, 0] = (self.offsets[d + 1] - self.offsets[d]) * w
            wait_all([self.comm.Ialltoall(meta, recv_meta)])
            if (recv_meta[:, 1] == _RAW).all():
                return self._plain(arr.type, values)
            send = self._pack_plain(values)
        else:
            one = pa.schema([pa.field("c", arr.type)])
            sink = pa.BufferOutputStream()
            for d in range(size):
                idx = self._rows(d)
                if d == rank or not len(idx):
                    continue
                start = sink.tell()
                write_stream(sink, one, pa.Table.from_arrays([arr.take(arrow_of(idx))],
                                                              schema=one))
                meta[d, 0] = sink.tell() - start
            buf = sink.getvalue()
            del sink
            send = np.frombuffer(buf, np.uint8) if buf.size else np.empty(0, np.uint8)
            wait_all([self.comm.Ialltoall(meta, recv_meta)])
        send_bytes = send.view(np.uint8) if send.size else np.empty(0, np.uint8)
        recv = alltoallv(self.comm, send_bytes, meta[:, 0].copy(), recv_meta[:, 0].copy())
        del send, send_bytes
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


def _pad8(nbytes):
    """Byte counts rounded up to whole 8-byte words: every column's segment of a shared buffer
    starts aligned for any fixed-width type."""
    return (nbytes + 7) // 8 * 8


def fetch_together(requests) -> List[pa.Array]:
    """Exchange several columns, of one or more :class:`RowExchange` routings built together,
    in one ``Alltoallv`` (collective; ``requests``: ``(exchange, column name or index)``).

    For small partitions the exchange is bound by latency, not bandwidth: one wait for the
    peers instead of one per column (on a loaded node each wait may cost a peer's time slice).
    Each destination's block holds every requested column's rows for it, back to back, each
    segment 8-byte aligned; received segments are copied into their columns (one memcpy per
    column and source), this rank's own rows gathered into place while the transfer runs.
    Every rank must make the same requests; columns not plain on every rank (or a single
    rank) go one at a time through :meth:`RowExchange.column`.
    """
    if not requests:
        return []
    ex0 = requests[0][0]
    comm, size, rank = ex0.comm, ex0.size, ex0.rank
    items = []
    with phase("pack"):
        for ex, col in requests:
            i = ex._index(col)
            if size == 1 or not ex.plain_everywhere[i]:
                items = None
                break
            arr = _single(ex.table.column(i))
            items.append((ex, arr.type, plain_values(arr)))
    if items is None:
        return [ex.column(col) for ex, col in requests]
    with phase("pack"):
        send_counts = np.zeros(size, np.int64)
        recv_counts = np.zeros(size, np.int64)
        for ex, _, values in items:
            w = values.dtype.itemsize
            sent = ex.send_rows * w
            got = ex.recv_rows * w
            sent[rank] = got[rank] = 0
            send_counts += _pad8(sent)
            recv_counts += _pad8(got)
        check_large_counts(np.concatenate([send_counts, recv_counts]))
        send = empty(int(send_counts.sum()), np.uint8)
        pos = 0
        for d in range(size):
            if d == rank:
                continue
            for ex, _, values in items:
                idx = ex._rows(d)
                nbytes = len(idx) * values.dtype.itemsize
                take_into(values, idx, send[pos:pos + nbytes].view(values.dtype))
                pos += _pad8(nbytes)
        send_displs = starts(send_counts)
        recv_displs = starts(recv_counts)
        recv = empty(int(recv_counts.sum()), np.uint8)
    req = comm.Ialltoallv([send, (send_counts, send_displs), MPI.BYTE],
                          [recv, (recv_counts, recv_displs), MPI.BYTE])
    with phase("reassemble"):
        outs, row_displs = [], []
        for ex, _, values in items:
            out = empty(ex.num_rows, values.dtype)
            displs = starts(ex.recv_rows)
            own = ex._rows(rank)
            lo = int(displs[rank])
            take_into(values, own, out[lo:lo + len(own)])
            outs.append(out)
            row_displs.append(displs)
    wait_all([req])
    del send
    with phase("reassemble"):
        pos = 0
        for s in range(size):
            if s == rank:
                continue
            for (ex, _, values), out, displs in zip(items, outs, row_displs):
                n = int(ex.recv_rows[s])
                nbytes = n * values.dtype.itemsize
                lo = int(displs[s])
                out[lo:lo + n] = recv[pos:pos + nbytes].view(values.dtype)
                pos += _pad8(nbytes)
        return [from_values(t, out) for (_, t, _), out in zip(items, outs)]


def exchange_rows(comm, table: pa.Table, order: np.ndarray, offsets: Sequence[int]) -> pa.Table:
    """All-to-all of ``table``'s rows: rank d gets rows ``order[offsets[d]:offsets[d+1]]``.

    Returns the rows this rank receives, ordered by source rank, each source's rows in the
    order sent; each column is moved separately (see :class:`RowExchange`).
    """
    ex = RowExchange(comm, order, offsets, table)
    columns = [ex.column(i) for i in range(table.num_columns)]
    return pa.Table.from_arrays(columns, schema=table.schema)


def _is_identity(idx: np.ndarray) -> bool:
    return bool(len(idx) == 0 or (idx[0] == 0 and np.all(np.diff(idx) == 1)))


def split_by(dest: np.ndarray, parts: int, counts: Optional[np.ndarray] = None):
    """Stable grouping of row indices by destination: (order, offsets) with rows for d at
    ``order[offsets[d]:offsets[d+1]]`` in their original relative order. ``counts``: the rows
    per destination, where the caller has them (else counted here: a pass over ``dest``)."""
    with phase("split"):
        return _split_by(dest, parts, counts)


def _split_by(dest: np.ndarray, parts: int, counts: Optional[np.ndarray] = None):
    it = np.int32 if len(dest) < 2**31 - 1 else np.int64  # half the memory of the routing
    offsets = np.zeros(parts + 1, np.int64)
    np.cumsum(destination_counts(dest, parts) if counts is None else counts, out=offsets[1:])
    if parts <= _SCAN_PARTS:
        # a few ranks: per slice of the 1-byte destinations, one scan per rank finds its rows
        # and writes them straight into its slot of the order (4x cheaper than a sort at 2
        # ranks). By slices, every temporary stays in cache and on the heap: whole-array masks
        # and NumPy's int64 row numbers were fresh pages for the kernel to zero, as much as
        # the order itself, on every operation.
        order = empty(len(dest), it)
        fill = [int(o) for o in offsets[:-1]]
        for i in range(0, len(dest), _SCAN_SLICE):
            part = dest[i:i + _SCAN_SLICE]
            for d in range(parts):
                rows = np.flatnonzero(part == d)
                end = fill[d] + len(rows)
                np.add(rows, i, out=order[fill[d]:end], casting="unsafe")
                fill[d] = end
        return order, offsets
    small = destination_dtype(parts)
    # NumPy's stable argsort of 8/16-bit keys is a counting (radix) sort: one O(n) pass per
    # byte, so 8-bit destinations (up to 256 ranks) take half the time of 16-bit ones
    order = np.argsort(dest.astype(small, copy=False), kind="stable")
    return order.astype(it, copy=False), offsets


_SCAN_PARTS = 8  # up to this many ranks, per-rank scans of the destinations beat the radix sort
_SCAN_SLICE = 1 << 16  # rows per slice of those scans (their temporaries: ~0.6 MiB)


def destination_counts(dest: np.ndarray, parts: int) -> np.ndarray:
    """Rows per destination (int64, ``parts`` long) of small-int destinations: up to
    :data:`_SCAN_PARTS` ranks a scan per rank, by slices (bincount would widen every
    destination to 8 bytes; a whole-array mask is a fresh array per rank), else bincount."""
    if parts > _SCAN_PARTS:
        return np.bincount(dest, minlength=parts).astype(np.int64, copy=False)
    counts = np.zeros(parts, np.int64)
    for i in range(0, len(dest), _SCAN_SLICE):
        part = dest[i:i + _SCAN_SLICE]
        for d in range(parts):
            counts[d] += np.count_nonzero(part == d)
    return counts
