"""Local sort kernels: a stable LSD radix argsort for one numeric key, and Arrow's sort otherwise.

NumPy's comparison argsort of a few million int64 keys costs several times more than polars'
sort; NumPy's stable argsort of 16-bit keys, though, is a counting/radix sort (O(n)). Sorting a
64-bit key as 16-bit digits, least significant first, after subtracting the minimum (so the
paper's keys, below 2**32, need two passes), gives a stable argsort several times faster.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

_SIGN = np.uint64(1 << 63)


def numeric_key(arr, descending: bool = False) -> np.ndarray:
    """A uint64 array whose unsigned order is the sort order of ``arr`` (no nulls).

    Ascending order of the result = ascending (or, with ``descending``, descending) order of
    the values; NaN sorts after every number in both directions, as Arrow and pandas place it.
    """
    if isinstance(arr, (pa.Array, pa.ChunkedArray)):
        arr = _to_numpy(arr)
    dt = arr.dtype
    if dt.kind == "f":
        bits = arr.astype(np.float64).view(np.uint64)
        nan = np.isnan(arr)
        # IEEE trick: flip all bits of negatives, the sign bit of positives -> unsigned order
        neg = (bits & _SIGN) != 0
        key = np.where(neg, ~bits, bits | _SIGN)
        key[(arr == 0)] = _SIGN  # -0.0 == 0.0
        if descending:
            key = ~key
        key[nan] = np.uint64(0xFFFFFFFFFFFFFFFF)  # last either way
        return key
    if dt.kind == "b":
        key = arr.astype(np.uint64)
    elif dt.kind == "u":
        key = arr.astype(np.uint64)
    elif dt.kind in "iMm":
        key = arr.view(np.int64) if dt.kind in "Mm" else arr.astype(np.int64, copy=False)
        key = key.view(np.uint64) ^ _SIGN  # order-preserving map of int64 onto uint64
    else:
        raise TypeError(dt)
    return ~key if descending else key


def _to_numpy(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    t = arr.type
    if pa.types.is_temporal(t):
        arr = arr.view(pa.int64() if t.bit_width == 64 else pa.int32())
    return arr.to_numpy(zero_copy_only=False)


def radix_argsort(key: np.ndarray) -> np.ndarray:
    """Stable argsort of an unsigned-integer array (int32 indices below 2**31 rows, else int64).

    Temporaries are kept narrow (32-bit keys and indices where they fit): peak memory matters
    as much as speed when the table nearly fills a rank's share of the node.
    """
    n = len(key)
    it = np.int32 if n < 2**31 - 1 else np.int64
    if n <= 1:
        return np.arange(n, dtype=it)
    lo = key.min()
    span = int(key.max()) - int(lo)
    if span == 0:
        return np.arange(n, dtype=it)
    passes = (span.bit_length() + 15) // 16
    if passes > 2 and n < 1 << 16:
        return np.argsort(key, kind="stable").astype(it)
    if passes <= 2 and key.dtype.itemsize > 4:
        shifted = np.empty(n, np.uint32)  # subtract straight into 32 bits: no 64-bit temporary
        np.subtract(key, lo, out=shifted, casting="unsafe")
    else:
        shifted = key - lo if lo else key
    order = None
    for p in range(passes):
        digit = ((shifted >> (16 * p)) & 0xFFFF).astype(np.uint16)
        if order is None:
            order = np.argsort(digit, kind="stable").astype(it)
        else:
            step = np.argsort(digit[order], kind="stable")
            order = order[step]
            del step
        del digit
    return order


def argsort(xp, key):
    """Stable argsort of a uint64 key on xp (numpy: radix; cupy: its GPU radix sort)."""
    if xp is np:
        return radix_argsort(key)
    return xp.argsort(key)  # cupy sorts with CUB's radix sort, which is stable
