"""Bridging NumPy and Arrow without copies (or pandas), and index operations in slices.

pyarrow's ``pa.array(ndarray)`` and ``Array.to_numpy`` import pandas on first use (~40 MiB of
resident memory and about a second per process), and NumPy casts int32 index arrays to intp
(an 8-byte-per-row temporary): the engine's hot paths use these helpers instead.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.frame._backend import MMAP_THRESHOLD, libc_function


def _raw_width(t: pa.DataType) -> Optional[int]:
    """Byte width of a fixed-width primitive type (not bit-packed booleans), else None: such a
    column, when null-free, travels as its plain value buffer."""
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or
            (pa.types.is_temporal(t) and not pa.types.is_interval(t))):
        return t.bit_width // 8
    return None


def _single(col) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def plain_values(col) -> Optional[np.ndarray]:
    """A zero-copy NumPy view (unsigned ints of the type's width) of a null-free fixed-width
    column, or None when the column has nulls or is not fixed-width."""
    arr = _single(col)
    if _raw_width(arr.type) is None or arr.null_count:
        return None
    return value_buffer(arr)


def unsigned_zero(col: pa.Array) -> pa.Array:
    """A float column with -0.0 made 0.0 (adding 0.0 changes nothing else), so that the two
    are one key, as in polars; any other column as it is."""
    if pa.types.is_floating(col.type):
        return pc.add(col, pa.scalar(0.0, col.type))
    return col


def value_buffer(col) -> np.ndarray:
    """A zero-copy NumPy view (unsigned ints of the type's width) of a fixed-width column's
    value buffer, whatever its null slots hold."""
    arr = _single(col)
    w = _raw_width(arr.type)
    if len(arr) == 0:
        return np.empty(0, np.dtype(f"u{w}"))
    return np.frombuffer(arr.buffers()[1], np.dtype(f"u{w}"), count=len(arr),
                         offset=arr.offset * w)


def _numpy_dtype(t: pa.DataType) -> np.dtype:
    w = t.bit_width // 8
    if pa.types.is_floating(t):
        return np.dtype(f"f{w}")
    if pa.types.is_unsigned_integer(t):
        return np.dtype(f"u{w}")
    return np.dtype(f"i{w}")  # signed integers, and temporals as their integer counts


def to_numpy(col) -> np.ndarray:
    """``to_numpy(zero_copy_only=False)`` without importing pandas where it can: null-free
    fixed-width arrays (temporals as their integer counts) are viewed zero-copy, null-free
    booleans unpacked; anything else goes through Arrow."""
    arr = _single(col)
    raw = plain_values(arr)
    if raw is not None:
        return raw.view(_numpy_dtype(arr.type))
    if pa.types.is_boolean(arr.type) and not arr.null_count:
        if len(arr) == 0:
            return np.zeros(0, bool)
        bits = np.frombuffer(arr.buffers()[1], np.uint8)
        return np.unpackbits(bits, count=arr.offset + len(arr),
                             bitorder="little")[arr.offset:].astype(bool)
    return arr.to_numpy(zero_copy_only=False)


def from_values(t: pa.DataType, values: np.ndarray, valid: Optional[np.ndarray] = None) -> pa.Array:
    """An Arrow array of type ``t`` over ``values`` (zero-copy; ``valid``: a bool mask, nulls
    where False)."""
    bitmap = None
    if valid is not None and not valid.all():
        bitmap = validity_bitmap(valid)
    return pa.Array.from_buffers(t, len(values), [bitmap, pa.py_buffer(values)])


def validity_bitmap(valid: np.ndarray) -> pa.Buffer:
    """Arrow's validity bitmap (LSB first) of a bool mask."""
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def arrow_of(values: np.ndarray) -> pa.Array:
    """A zero-copy Arrow array over a 1-D NumPy numeric array (``pa.array`` of a NumPy array
    imports pandas, ~40 MiB and a second, to check whether it was given a Series)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values),
                                 [None, pa.py_buffer(values)])


_CHUNK = 1 << 18


def destination_dtype(parts: int) -> type:
    """The narrowest integer type for rank numbers below ``parts``: a shuffle's destinations
    (1 byte up to 256 ranks, whose stable argsort is one counting-sort pass)."""
    return np.uint8 if parts <= 256 else np.uint16 if parts <= 2**16 else np.int64


#: Large buffers are mapped whole 2 MiB pages at a time (see :func:`empty`).
_HUGE_PAGE = 2 << 20
_GLIBC_MMAP_SLACK = 32       # a request this far below a page multiple maps exactly that multiple


def empty(n: int, dtype) -> np.ndarray:
    """``np.empty(n, dtype)`` for the engine's large buffers, mapped so that the kernel backs
    them with 2 MiB pages from the first byte to the last whole 2 MiB.

    glibc maps a buffer of 4 MiB or more (the engine's allocator setting) with a length of its
    size plus a 16-byte header, rounded up to 4 KiB; Linux places a mapping on a 2 MiB
    boundary only when its length is a whole number of 2 MiB. So every such buffer began and
    ended in partial 2 MiB regions that the kernel faulted in 4 KiB at a time: ~330-540 faults a
    buffer whatever its size (~2 ms in this VM, about as long as gathering 1M rows), as many on a
    rank with half the rows, so a cost that grew with the rank count. Asked for 32 bytes short
    of a whole number of 2 MiB, glibc maps exactly that number, on a 2 MiB boundary. A huge
    page over the last, partial 2 MiB is resident whole: where the data fills less than half
    of it, it is kept on 4 KiB pages instead (``MADV_NOHUGEPAGE``), so a buffer holds at most
    1 MiB more than its data and takes at most ~256 small faults."""
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    if nbytes < MMAP_THRESHOLD:   # from the heap: glibc maps buffers from this size
        return np.empty(n, dtype)
    whole = -(-(nbytes + _GLIBC_MMAP_SLACK) // _HUGE_PAGE) * _HUGE_PAGE
    buf = np.empty(whole - _GLIBC_MMAP_SLACK, np.uint8)
    start = buf.ctypes.data
    body_end = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE  # where the partial 2 MiB begins
    if (_madvise is not None and start + nbytes - body_end < _HUGE_PAGE // 2 and
            body_end > start and start % _HUGE_PAGE == _GLIBC_HEADER):
        _madvise(body_end, start - _GLIBC_HEADER + whole - body_end, _MADV_NOHUGEPAGE)
    return buf[:nbytes].view(dtype)


_GLIBC_HEADER = 16          # where glibc's mapped chunk puts the data: past its header
_MADV_NOHUGEPAGE = 15


#: The C library's madvise (None elsewhere: the tail then stays as the kernel chooses).
_madvise = libc_function("madvise", ctypes.c_int,
                         [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int])


def cast(values: np.ndarray, dtype) -> np.ndarray:
    """``values.astype(dtype)`` into an :func:`empty` buffer (a new array even if the dtype is
    the same)."""
    out = empty(len(values), dtype)
    np.copyto(out, values, casting="unsafe")
    return out


def arange(n: int, dtype) -> np.ndarray:
    """``np.arange(n, dtype=dtype)`` into an :func:`empty` buffer, by slices."""
    out = empty(n, dtype)
    for i in range(0, n, _CHUNK):
        out[i:i + _CHUNK] = np.arange(i, min(i + _CHUNK, n), dtype=dtype)
    return out


def gather(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``values[idx]`` in slices: NumPy casts an index array to intp, so a whole int32 index
    of n rows would cost an 8n-byte temporary."""
    out = empty(len(idx), values.dtype)
    take_into(values, idx, out)
    return out


def take_into(values: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = values[idx]``, in slices (see :func:`gather`); indices must be in range
    (out-of-range ones are clipped, negative ones read element 0)."""
    if idx.dtype == np.uint64:
        # NumPy < 2 refuses uint64 indices ("safe" cast to intp); they are row numbers, far
        # below 2**63, so the same bytes read as int64 are the same indices (no copy).
        idx = idx.view(np.int64)
    for i in range(0, len(idx), _CHUNK):
        # mode="clip": with the default "raise", NumPy buffers ``out`` (a copy per call)
        np.take(values, idx[i:i + _CHUNK], out=out[i:i + _CHUNK], mode="clip")
