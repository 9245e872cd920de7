"""Local sort kernels: a stable LSD radix argsort for one numeric key, and Arrow's sort otherwise.

NumPy's comparison argsort of a few million int64 keys costs several times more than polars'
sort; NumPy's stable argsort of 16-bit keys, though, is a counting/radix sort (O(n)). Sorting a
64-bit key as 16-bit digits, least significant first, after subtracting the minimum (so the
paper's keys, below 2**32, need two passes), gives a stable argsort several times faster.
"""
from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa

from hetflow.frame._arrays import cast, empty, gather, to_numpy

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


def key_values(column) -> np.ndarray:
    """The values :func:`numeric_key` maps, as NumPy (zero-copy for null-free fixed-width)."""
    return _to_numpy(column)


def _to_numpy(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    t = arr.type
    if pa.types.is_temporal(t):
        arr = arr.view(pa.int64() if t.bit_width == 64 else pa.int32())
    return to_numpy(arr)


def radix_argsort(key: np.ndarray) -> np.ndarray:
    """Stable argsort of an unsigned-integer array (int32 indices below 2**31 rows, else int64).

    Temporaries are kept narrow (32-bit keys and indices where they fit): peak memory matters
    as much as speed when the table nearly fills a rank's share of the node.
    """
    return _radix_consume([key])


def sort_order(xp, column, descending: bool = False) -> np.ndarray:
    """Stable sort order (host indices) of a null-free numeric column, on xp's device.

    On the CPU the 64-bit sort key exists only until it is narrowed to the digits the radix
    passes read, so the key and the passes' temporaries never coexist.
    """
    if xp is not np:
        return xp.asnumpy(xp.argsort(xp.asarray(numeric_key(column, descending))))
    if not descending:
        values = key_values(column)
        if values.dtype == np.int64:
            # int64 (and 64-bit temporals) ascending: the radix passes read the differences
            # from the minimum, which are the same from the values as from the uint64 key, so
            # no key is built (a 64-bit copy of the column)
            return _radix_consume([values])
    box = [numeric_key(column, descending)]
    return _radix_consume(box)


def _radix_consume(box: list) -> np.ndarray:
    """Radix argsort of ``box[0]``, which it takes out of the list (the caller keeps no other
    reference when it wants the key freed as soon as it has been narrowed)."""
    key = box.pop()
    n = len(key)
    it = np.int32 if n < 2**31 - 1 else np.int64
    if n <= 1:
        return np.arange(n, dtype=it)
    lo, hi = key.min(), key.max()
    span = int(hi) - int(lo)
    if span == 0:
        return np.arange(n, dtype=it)
    if key.dtype == np.uint32:  # narrow already: its own digits, no shifted copy (<= 2 passes)
        lo, span = 0, int(hi)
    passes = (span.bit_length() + 15) // 16
    if passes > 2 and n < 1 << 16:
        return np.argsort(key, kind="stable").astype(it)
    if passes <= 2 and key.dtype.itemsize > 4:
        shifted = empty(n, np.uint32)  # subtract straight into 32 bits: no 64-bit temporary
        np.subtract(key, lo, out=shifted, casting="unsafe")
    else:
        shifted = key - lo if lo else key  # read only: aliasing the caller's key is fine
    del key
    if sys.byteorder == "little":
        # digit p of every key, as a strided view: no shifted and masked temporaries
        digits = shifted.view(np.uint16).reshape(n, shifted.itemsize // 2)
        digit_of = lambda p: digits[:, p]  # noqa: E731 - one closure per branch
    else:  # pragma: no cover - big-endian hosts
        digit_of = lambda p: ((shifted >> (16 * p)) & 0xFFFF).astype(np.uint16)  # noqa: E731 - one closure per branch
    order = None
    for p in range(passes):
        # contiguous first: np.take copies a strided source whole on every call
        digit = np.ascontiguousarray(digit_of(p))
        if order is not None:
            digit = gather(digit, order)
        if p == passes - 1:
            del digit_of, shifted
            digits = None
        step = np.argsort(digit, kind="stable")  # 16-bit keys: NumPy's radix sort, O(n)
        del digit
        order = cast(step, it) if order is None else gather(order, step)
        del step
    return order


def narrow_kinds(dtype: np.dtype) -> bool:
    """Whether :func:`narrow` and :func:`widen` handle ``dtype`` (integers; temporals come as
    their integer view from :func:`key_values`)."""
    return dtype.kind in "iu"


def key_range(values: np.ndarray, descending: bool):
    """(min, max) of :func:`numeric_key` over ``values`` (non-empty), without building the key
    when the values are int64 ascending."""
    if values.dtype == np.int64 and not descending:
        lo, hi = np.array([values.min(), values.max()], np.int64).view(np.uint64) ^ _SIGN
        return lo, hi
    key = numeric_key(values, descending)
    return key.min(), key.max()


def narrow(values: np.ndarray, descending: bool, lo) -> np.ndarray:
    """``numeric_key(values) - lo`` as uint32 (the caller knows every key is in [lo, lo + 2**32)):
    half the bytes of the key to move and to sort, in the same order."""
    out = empty(len(values), np.uint32)
    if values.dtype == np.int64 and not descending:
        np.subtract(values, (lo ^ _SIGN).view(np.int64), out=out, casting="unsafe")
    else:
        np.subtract(numeric_key(values, descending), lo, out=out, casting="unsafe")
    return out


def widen(narrowed: np.ndarray, descending: bool, lo, dtype: np.dtype) -> np.ndarray:
    """The values whose :func:`narrow` is ``narrowed`` (the inverse, for :func:`narrow_kinds`)."""
    if dtype == np.int64 and not descending:
        return np.add(narrowed, (lo ^ _SIGN).view(np.int64), dtype=np.int64,
                      out=empty(len(narrowed), np.int64))
    key = np.add(narrowed, lo, dtype=np.uint64)
    if descending:
        np.invert(key, out=key)
    if dtype.kind == "u":
        return key.astype(dtype)
    return (key ^ _SIGN).view(np.int64).astype(dtype, copy=False)
