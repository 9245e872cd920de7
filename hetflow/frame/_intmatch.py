"""Integer-key matching, the local join's kernel after the shuffle: row-index pairs of two
null-free integer or temporal key arrays (:func:`match`).

The right side's rows are ordered by key (the radix argsort) and counted per key in a
direct-address table over the keys' range (:func:`_match_dense`), or over hash buckets of the
keys when their range is wide (:func:`_match_hashed`, the pairs of different keys in a bucket
then dropped); each left row reads its run of right rows there, and the output index pairs are
expanded (:func:`_expand`). Where every right key occurs once (a dimension table) the table
holds each key's right row instead and no run is expanded (:func:`_match_unique`). A heavy key
sharing its bucket with others goes to a sort-merge of both sides (:func:`_match_sorted`). On
one core this is several times faster than Arrow's hash join. The output's columns are built
from the pairs by :func:`hetflow.frame._localjoin.assemble`.
"""
from __future__ import annotations

from typing import Optional

import pyarrow as pa

import numpy as np

from hetflow.frame import _localsort
from hetflow.frame._arrays import _CHUNK, arange, cast, empty, gather, to_numpy

#: The joins whose output keeps a side's rows that matched nothing.
KEEPS_LEFT, KEEPS_RIGHT = ("left", "outer", "full"), ("right", "outer", "full")


def match(left_key: pa.Array, right_key: pa.Array, how: str, stride: int = 1,
          identity: bool = False):
    """Row-index pairs (left, right) of the join of two null-free integer/temporal key arrays;
    -1 marks the missing side of an outer join's unmatched row.

    ``identity``: the left index may be None, meaning every left row once, in its own order
    (a left join, or an inner join where every left row matches, on unique right keys): the
    caller then keeps the left columns as they are (:func:`take`, :func:`assemble`).

    ``stride``: every key of both arrays leaves the same remainder modulo ``stride`` (one
    rank's rows of :func:`hetflow.frame._hash.modular_partition`), so keys are told apart by
    their quotient and the direct-address table spans the keys' range divided by ``stride``."""
    a, b = to_numpy(left_key), to_numpy(right_key)
    if len(a) and len(b):
        if stride > 1 and b.dtype == np.uint64:
            # the partition took remainders of the int64 representation: quotients of it too
            a, b = a.view(np.int64), b.view(np.int64)
        span = int(b.max()) // stride - int(b.min()) // stride + 1
        if span <= 4 * (len(a) + len(b)) + 4096:
            return _match_dense(a, b, how, stride, identity=identity)
        found = _match_hashed(a, b, how)
        if found is not None:
            return found
    return _match_sorted(_localsort.numeric_key(a), _localsort.numeric_key(b), how)


#: An odd 64-bit multiplier for :func:`_buckets`, not the hashed partition's: the partition
#: gives a rank the keys whose product with its multiplier has certain top bits, and buckets
#: taken from those same bits would leave most of the table empty.
_BUCKET_MULTIPLIER = np.uint64(0xD6E8FEB86659FD93)


def _buckets(x: np.ndarray, bits: int) -> np.ndarray:
    """Each integer key's bucket in ``[0, 2**bits)``: the top ``bits`` bits of its 64-bit
    value times an odd constant (multiplicative hashing: every bit of the key reaches the top
    ones), as int32, by slices."""
    out = empty(len(x), np.int32)
    shift = np.uint64(64 - bits)
    for i in range(0, len(x), _CHUNK):
        part = x[i:i + _CHUNK]
        wide = part.view(np.uint64) if part.itemsize == 8 else part.astype(np.int64).view(np.uint64)
        h = wide * _BUCKET_MULTIPLIER
        h >>= shift
        out[i:i + _CHUNK] = h
    return out


def _match_hashed(a: np.ndarray, b: np.ndarray, how: str):
    """Integer keys spread over a wide range: the direct-address match of their buckets (a
    table of at least twice the right side's rows), then the candidate pairs whose keys differ
    (other keys in the same bucket, about one for every two left rows) dropped. 2.4x faster
    than sorting both sides by their 64-bit keys (2M x 2M random int64 keys: 143 ms against
    345). None where the buckets would make more than 4 pairs per input row (a heavy key that
    shares its bucket with others): the sort-merge match then does it."""
    bits = min(max((2 * len(b) - 1).bit_length(), 12), 31)
    pairs = _match_dense(_buckets(a, bits), _buckets(b, bits), "inner",
                         limit=4 * (len(a) + len(b)))
    if pairs is None:
        return None
    li, ri = pairs
    same = empty(len(li), bool)
    for i in range(0, len(li), _CHUNK):
        np.equal(gather(a, li[i:i + _CHUNK]), gather(b, ri[i:i + _CHUNK]),
                 out=same[i:i + _CHUNK])
    li, ri = li[same], ri[same]
    del same
    return with_unmatched(li, ri,
                          unmatched(len(a), li) if how in KEEPS_LEFT else None,
                          unmatched(len(b), ri) if how in KEEPS_RIGHT else None)


def unmatched(n: int, matched: np.ndarray) -> np.ndarray:
    """The rows of ``range(n)`` not in ``matched``."""
    seen = np.zeros(n, bool)
    seen[matched] = True
    return np.flatnonzero(~seen)


def with_unmatched(left_rows: np.ndarray, right_rows: np.ndarray,
                   left_lonely: Optional[np.ndarray] = None,
                   right_lonely: Optional[np.ndarray] = None):
    """The matched pairs, then each side's rows that matched nothing (None: not kept), paired
    with -1, all at the matched pairs' index types."""
    parts_l, parts_r = [left_rows], [right_rows]
    if left_lonely is not None:
        parts_l.append(left_lonely.astype(left_rows.dtype, copy=False))
        parts_r.append(np.full(len(left_lonely), -1, right_rows.dtype))
    if right_lonely is not None:
        parts_l.append(np.full(len(right_lonely), -1, left_rows.dtype))
        parts_r.append(right_lonely.astype(right_rows.dtype, copy=False))
    if len(parts_l) == 1:
        return left_rows, right_rows
    return np.concatenate(parts_l), np.concatenate(parts_r)


def _runs(sorted_keys: np.ndarray):
    """Start of each run of equal values in a sorted array, and the run lengths."""
    n = len(sorted_keys)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))
    lengths = np.diff(np.append(starts, n))
    return starts, lengths


def _index_type(*sizes: int):
    """int32 row indices while they fit: half the memory of int64 for every index array."""
    return np.int32 if max(sizes, default=0) < 2**31 - 1 else np.int64


def _expand(row_count: np.ndarray, row_first: np.ndarray, right_order: np.ndarray):
    """Left row i pairs with right_order[row_first[i] : row_first[i] + row_count[i]].

    ``row_first`` is overwritten. Every temporary is an index array of the output's length
    at the narrow index type, made in slices where NumPy would widen it."""
    total = int(row_count.sum(dtype=np.int64))
    it = _index_type(total, len(row_count), len(right_order))
    left_rows = np.repeat(arange(len(row_count), it), row_count)
    out_start = np.cumsum(row_count, dtype=it, out=empty(len(row_count), it))
    out_start -= row_count.astype(it, copy=False)
    shift = row_first.astype(it, copy=False)
    shift -= out_start  # right position = output position + shift, within a left row's run
    del out_start
    # each output row's shift, read through its left row: NumPy's repeat copies element by
    # element (13 ms for 2M rows here), the gather of the (ascending) left rows 2 ms
    right_pos = gather(shift, left_rows)
    del shift
    for i in range(0, total, _CHUNK):
        right_pos[i:i + _CHUNK] += np.arange(i, min(i + _CHUNK, total), dtype=it)
    right_rows = gather(right_order, right_pos)
    return left_rows, right_rows


def _match_dense(a: np.ndarray, b: np.ndarray, how: str, stride: int = 1,
                 limit: Optional[int] = None, identity: bool = False):
    """Keys in a dense range (the common case for integer ids): a direct-address table over
    the right keys' range (of quotients by ``stride``, see :func:`match`) replaces sorting the
    left side and binary search. ``a`` and ``b`` are integer arrays of one dtype; only
    differences from the right's minimum are formed, so any integer type works without a
    widening copy. ``limit``: None instead of more pairs than that (counted before any is
    made). ``identity``: see :func:`match`."""
    if stride == 1:
        lo, hi = b.min(), b.max()
        a_lo, a_hi = lo, hi
    else:
        lo, hi = int(b.min()) // stride, int(b.max()) // stride
        # the left keys whose quotient is in [lo, hi] (clipped to the dtype: no overflow)
        info = np.iinfo(a.dtype)
        a_lo = a.dtype.type(max(lo * stride, info.min))
        a_hi = a.dtype.type(min(hi * stride + stride - 1, info.max))
    span = int(hi) - int(lo) + 1
    it = _index_type(span, len(a), len(b))
    bk = _offsets(b, lo, stride, it)
    # bincount reads intp: the cast made here, into a buffer mapped whole (see _arrays.empty)
    ends = np.bincount(cast(bk, np.intp) if bk.dtype != np.intp else bk, minlength=span)
    if ends.max() <= 1:   # unique right keys (a dimension table): no runs to expand
        del ends
        return _match_unique(a, bk, lo, stride, span, it, how, identity)
    bo = _localsort.radix_argsort(bk.view(np.uint32 if it is np.int32 else np.uint64)
                                  ).astype(it, copy=False)
    np.cumsum(ends, out=ends)  # ends[k]: right rows with key <= lo + k
    ends = cast(ends, it)
    inside = (a >= a_lo) & (a <= a_hi)
    ak = _offsets(a, lo, stride, it)  # outside the range they may wrap:
    ak[~inside] = 0                   # they are masked here
    row_first = gather(ends, ak - 1)  # ak - 1 == -1 is clipped to 0: fixed just below
    row_first[ak == 0] = 0
    row_count = gather(ends, ak)
    row_count -= row_first
    row_count[~inside] = 0
    del ends
    if limit is not None and int(row_count.sum(dtype=np.int64)) > limit:
        return None
    right_lonely = None
    if how in KEEPS_RIGHT:
        seen = np.zeros(span, bool)
        seen[ak[inside]] = True
        right_lonely = np.flatnonzero(~seen[bk]).astype(it)
        del seen
    del ak, bk, inside
    left_rows, right_rows = _expand(row_count, row_first, bo)
    del row_first, bo
    return with_unmatched(left_rows, right_rows,
                          np.flatnonzero(row_count == 0) if how in KEEPS_LEFT else None,
                          right_lonely)


def _match_unique(a: np.ndarray, bk: np.ndarray, lo, stride: int, span: int, it, how: str,
                  identity: bool):
    """:func:`_match_dense` for right keys that are all different (``bk``: their offsets in the
    table, see there): one table of each key's right row (-1: none) read once per left row,
    a left row's match or -1 with no sort and no expansion. A left join's left index is every
    row in order, None where ``identity`` allows it (see :func:`match`)."""
    pos = np.full(span + 1, -1, it)   # slot ``span``: every left key outside the range
    for i in range(0, len(bk), _CHUNK):
        pos[bk[i:i + _CHUNK]] = np.arange(i, min(i + _CHUNK, len(bk)), dtype=it)
    right_at = _lookup(a, pos, lo, stride, span, it)
    if how == "left":
        return (None if identity else arange(len(a), it)), right_at
    hit = right_at >= 0
    if identity and how == "inner" and hit.all():
        return None, right_at
    left_rows = np.flatnonzero(hit)
    left_rows = left_rows.astype(it, copy=False)
    right_rows = gather(right_at, left_rows)
    del right_at
    right_lonely = None
    if how in KEEPS_RIGHT:
        seen = np.zeros(len(bk), bool)
        seen[right_rows] = True
        right_lonely = np.flatnonzero(~seen)
    return with_unmatched(left_rows, right_rows,
                          np.flatnonzero(~hit) if how in KEEPS_LEFT else None, right_lonely)


def _lookup(a: np.ndarray, pos: np.ndarray, lo, stride: int, span: int, it) -> np.ndarray:
    """``pos`` read at each left key's offset (``a // stride - lo``), at slot ``span`` (-1) for
    the keys outside ``[0, span)``; by slices, the offsets' temporaries staying in cache. The
    offset is formed modulo 2**64: two keys of one width differ by less than 2**64, so a key
    below the range wraps past it, and one unsigned minimum sends every outside key to
    ``span``, at any width and without overflow."""
    out = empty(len(a), it)
    low = np.uint64(int(lo) % 2**64)
    shift = stride.bit_length() - 1 if stride & (stride - 1) == 0 else None
    cap = np.uint64(span)
    for i in range(0, len(a), _CHUNK):
        part = a[i:i + _CHUNK]
        if stride > 1:
            part = part >> shift if shift is not None else part // stride
        off = np.subtract(part, low, dtype=np.uint64, casting="unsafe")
        np.minimum(off, cap, out=off)
        np.take(pos, off.view(np.int64), out=out[i:i + _CHUNK], mode="clip")
    return out


def _offsets(x: np.ndarray, lo, stride: int, it) -> np.ndarray:
    """``x // stride - lo`` as index type ``it`` (one pass; by slices of :data:`_CHUNK` rows
    with a ``stride``, so the quotients' temporary stays in cache)."""
    out = empty(len(x), it)
    wide = np.uint64 if x.dtype.kind == "u" else np.int64  # narrow types would overflow
    if stride == 1:
        np.subtract(x, lo, out=out, dtype=wide, casting="unsafe")
        return out
    shift = stride.bit_length() - 1 if stride & (stride - 1) == 0 else None
    for i in range(0, len(x), _CHUNK):
        part = x[i:i + _CHUNK]
        q = part >> shift if shift is not None else part // stride  # floor, like the remainder
        np.subtract(q, lo, out=out[i:i + _CHUNK], dtype=wide, casting="unsafe")
    return out


def _match_sorted(a: np.ndarray, b: np.ndarray, how: str):
    """Sort-merge matching for keys spread over a wide range."""
    ao = _localsort.radix_argsort(a)
    bo = _localsort.radix_argsort(b)
    sa, sb = a[ao], b[bo]
    a_start, a_len = _runs(sa)
    b_start, b_len = _runs(sb)
    ua, ub = sa[a_start], sb[b_start]
    # for every distinct left key, its run in the right side (if any)
    pos = np.searchsorted(ub, ua)
    pos_c = np.minimum(pos, max(len(ub) - 1, 0))
    hit = (pos < len(ub)) & (ub[pos_c] == ua) if len(ub) else np.zeros(len(ua), bool)
    # per left row (in sorted order): how many right rows it pairs with, and where they start
    per_key_count = np.where(hit, b_len[pos_c] if len(ub) else 0, 0)
    row_count = np.repeat(per_key_count, a_len)
    row_bstart = np.repeat(np.where(hit, b_start[pos_c] if len(ub) else 0, 0), a_len)
    total = int(row_count.sum())
    left_rows = np.repeat(ao, row_count)
    out_start = np.cumsum(row_count) - row_count
    within = np.arange(total, dtype=np.int64) - np.repeat(out_start, row_count)
    right_rows = bo[np.repeat(row_bstart, row_count) + within]
    right_lonely = None
    if how in KEEPS_RIGHT:
        # right keys with no left match
        posb = np.searchsorted(ua, ub)
        posb_c = np.minimum(posb, max(len(ua) - 1, 0))
        hitb = (posb < len(ua)) & (ua[posb_c] == ub) if len(ua) else np.zeros(len(ub), bool)
        right_lonely = bo[np.repeat(~hitb, b_len)]
    return with_unmatched(left_rows, right_rows,
                          ao[row_count == 0] if how in KEEPS_LEFT else None, right_lonely)
