"""Local join kernels run after the shuffle.

For the common case (one integer or temporal key without nulls) a vectorized sort-merge join:
both key columns are ordered with the radix argsort, the matching range of every left key in the
right side is found with ``searchsorted``, and the output index pairs are expanded with
``repeat``; Arrow's ``take`` then gathers the columns. On one core this is several times faster
than Arrow's hash join. Every other case (floats, strings, several keys, nulls in the key) runs
Arrow's hash join (``Table.join``). Both give the same rows, columns and names: the left
columns, then the right non-key columns, colliding names suffixed, keys coalesced under the
left names; row order is unspecified.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.frame import _localsort

ARROW_JOIN_TYPE = {"inner": "inner", "left": "left outer", "right": "right outer",
                   "outer": "full outer", "full": "full outer", "semi": "left semi",
                   "anti": "left anti"}


def _fast_key_ok(left: pa.Table, right: pa.Table, lk, rk, how) -> bool:
    if len(lk) != 1 or how not in ("inner", "left", "right", "outer", "full"):
        return False
    t = left.schema.field(lk[0]).type
    if not (pa.types.is_integer(t) or (pa.types.is_temporal(t) and not pa.types.is_interval(t))):
        return False
    if left.column(lk[0]).null_count or right.column(rk[0]).null_count:
        return False
    # name clashes between one side's key and the other's non-key columns: leave to Arrow
    lnames, rnames = set(left.column_names), set(right.column_names)
    return not ((rk[0] != lk[0]) and (rk[0] in lnames or lk[0] in rnames))


def join(left: pa.Table, right: pa.Table, lk: Sequence[str], rk: Sequence[str], how: str,
         suffixes: Tuple[str, str]) -> pa.Table:
    """Local join of two tables (see the module docstring for the output's shape)."""
    if not _fast_key_ok(left, right, lk, rk, how):
        return left.join(right, keys=list(lk), right_keys=list(rk),
                         join_type=ARROW_JOIN_TYPE[how], left_suffix=suffixes[0],
                         right_suffix=suffixes[1], coalesce_keys=True)
    li, ri = _match(_localsort.numeric_key(left.column(lk[0])),
                    _localsort.numeric_key(right.column(rk[0])), how)
    return _assemble(left, right, lk[0], rk[0], li, ri, how, suffixes)


def _runs(sorted_keys: np.ndarray):
    """Start of each run of equal values in a sorted array, and the run lengths."""
    n = len(sorted_keys)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1])))
    lengths = np.diff(np.append(starts, n))
    return starts, lengths


def _match(a: np.ndarray, b: np.ndarray, how: str):
    """Row-index pairs (left, right) of the join of uint64 keys ``a`` and ``b``; -1 = no row."""
    if len(a) and len(b):
        span = int(b.max() - b.min()) + 1
        if span <= 4 * (len(a) + len(b)) + 4096:
            return _match_dense(a, b, how)
    return _match_sorted(a, b, how)


def _index_type(*sizes: int):
    """int32 row indices while they fit: half the memory of int64 for every index array."""
    return np.int32 if max(sizes, default=0) < 2**31 - 1 else np.int64


def _expand(row_count: np.ndarray, row_first: np.ndarray, right_order: np.ndarray):
    """Left row i pairs with right_order[row_first[i] : row_first[i] + row_count[i]]."""
    total = int(row_count.sum(dtype=np.int64))
    it = _index_type(total, len(row_count), len(right_order))
    left_rows = np.repeat(np.arange(len(row_count), dtype=it), row_count)
    out_start = np.cumsum(row_count, dtype=np.int64)
    out_start -= row_count
    shift = (row_first - out_start).astype(it)
    del out_start
    right_pos = np.repeat(shift, row_count)
    del shift
    right_pos += np.arange(total, dtype=it)
    right_rows = right_order[right_pos]
    return left_rows, right_rows


def _match_dense(a: np.ndarray, b: np.ndarray, how: str):
    """Keys in a dense range (the common case after hashing integer ids): a direct-address
    table over the right keys' range replaces sorting the left side and binary search."""
    lo, hi = b.min(), b.max()
    span = int(hi - lo) + 1
    it = _index_type(span, len(a), len(b))
    bk = (b - lo).astype(it)
    bo = _localsort.radix_argsort(bk.view(np.uint32 if it is np.int32 else np.uint64)
                                  ).astype(it)
    counts64 = np.bincount(bk, minlength=span)
    first = np.zeros(span, it)
    np.cumsum(counts64[:-1], out=first[1:])
    counts = counts64.astype(it)
    del counts64
    ak = a - lo  # keys below lo wrap around to huge values: outside
    inside = ak <= np.uint64(span - 1)
    ak = np.where(inside, ak, np.uint64(0)).astype(it)
    row_count = counts[ak]
    row_count[~inside] = 0
    del counts
    row_first = first[ak]
    del first
    left_rows, right_rows = _expand(row_count, row_first, bo)
    del row_first, bo
    parts_l, parts_r = [left_rows], [right_rows]
    if how in ("left", "outer", "full"):
        lonely = np.flatnonzero(row_count == 0).astype(left_rows.dtype)
        parts_l.append(lonely)
        parts_r.append(np.full(len(lonely), -1, right_rows.dtype))
    if how in ("right", "outer", "full"):
        seen = np.zeros(span, bool)
        seen[ak[inside]] = True
        lonely = np.flatnonzero(~seen[bk]).astype(right_rows.dtype)
        parts_l.append(np.full(len(lonely), -1, left_rows.dtype))
        parts_r.append(lonely)
    if len(parts_l) == 1:
        return left_rows, right_rows
    return np.concatenate(parts_l), np.concatenate(parts_r)


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
    parts_l, parts_r = [left_rows], [right_rows]
    if how in ("left", "outer", "full"):
        lonely = ao[row_count == 0]
        parts_l.append(lonely)
        parts_r.append(np.full(len(lonely), -1, np.int64))
    if how in ("right", "outer", "full"):
        # right keys with no left match
        posb = np.searchsorted(ua, ub)
        posb_c = np.minimum(posb, max(len(ua) - 1, 0))
        hitb = (posb < len(ua)) & (ua[posb_c] == ub) if len(ua) else np.zeros(len(ub), bool)
        lonely = bo[np.repeat(~hitb, b_len)]
        parts_l.append(np.full(len(lonely), -1, np.int64))
        parts_r.append(lonely)
    if len(parts_l) == 1:
        return left_rows, right_rows
    return np.concatenate(parts_l), np.concatenate(parts_r)


def _take(table: pa.Table, idx: np.ndarray, may_miss: bool) -> pa.Table:
    if may_miss:
        return table.take(pa.array(idx, mask=idx < 0))
    return table.take(pa.array(idx))


def _assemble(left, right, lkey, rkey, li, ri, how, suffixes) -> pa.Table:
    left_misses = how in ("right", "outer", "full")
    right_misses = how in ("left", "outer", "full")
    if how == "right":
        # Arrow's (and polars') right join: the left's non-key columns, then all of the
        # right's, key under the right's name
        lt = _take(left.select([c for c in left.column_names if c != lkey]), li, True)
        rt = _take(right, ri, False)
        clash = set(lt.column_names) & (set(right.column_names) - {rkey})
    else:
        lt = _take(left, li, left_misses)
        rt = _take(right.select([c for c in right.column_names if c != rkey]), ri, right_misses)
        if how != "inner" and how != "left":  # full outer: coalesce the key
            key_from_right = _take(right.select([rkey]), ri, right_misses).column(0)
            i = lt.schema.get_field_index(lkey)
            lt = lt.set_column(i, lkey, pc.coalesce(lt.column(i), key_from_right))
        clash = set(lt.column_names) & set(rt.column_names)
    names = [c + suffixes[0] if c in clash else c for c in lt.column_names]
    rnames = [c + suffixes[1] if c in clash else c for c in rt.column_names]
    return pa.Table.from_arrays(list(lt.columns) + list(rt.columns), names=names + rnames)
