"""String and binary keys, the local join's other kernel: row-index pairs matched through each
key's 64-bit hash, the matched pairs' keys then compared (:func:`match_by_hash`); against a
small right side with unique values, Arrow's set lookup (:func:`match_unique_binary`). The
pairs have :func:`hetflow.frame._intmatch.match`'s form.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.frame._arrays import _CHUNK, _single, empty, gather, to_numpy
from hetflow.frame._hash import _KEEP_BYTES, _binary_parts, _words
from hetflow.frame._intmatch import KEEPS_LEFT, KEEPS_RIGHT, match, unmatched, with_unmatched

#: The most right rows whose string or binary key :func:`hetflow.frame._localjoin.join` looks
#: up with Arrow's ``index_in`` (one rank, 5M left rows, a left join: 10, 10k and 100k right
#: rows faster than Arrow's join, 1M rows not).
SET_LOOKUP_ROWS = 1 << 17


def match_by_hash(left_hash: pa.Array, right_hash: pa.Array, left_key: pa.Array,
                  right_key: pa.Array, how: str):
    """Row-index pairs (left, right) of the join of two string/binary key arrays, given each
    row's 64-bit hash of its key (:func:`hetflow.frame._hash.hash_rows`): the integer match of
    the hashes, then the pairs whose keys differ (a hash collision) or are null (a null key
    matches nothing) dropped; a row whose every candidate was dropped is then unmatched, kept
    once where ``how`` keeps its side. -1 marks the missing side, as in :func:`match`."""
    li, ri = match(left_hash, right_hash, "inner")
    same = binary_equal_at(_single(left_key), li, _single(right_key), ri)
    if not same.all():
        li, ri = li[same], ri[same]
    del same
    return with_unmatched(li, ri,
                          unmatched(len(left_hash), li) if how in KEEPS_LEFT else None,
                          unmatched(len(right_hash), ri) if how in KEEPS_RIGHT else None)


def match_unique_binary(left_key: pa.Array, right_key: pa.Array, how: str):
    """An inner or left join's pairs on a string or binary key whose right values are all
    different (None where they are not), as :func:`match` gives them with ``identity``:
    Arrow's set lookup (``index_in``) gives each left row its right row, null keys matching
    nothing; no hashing of the left side into a join's table, no sort."""
    if pc.count_distinct(right_key).as_py() != len(right_key) - right_key.null_count:
        return None
    found = pc.index_in(left_key, value_set=right_key, skip_nulls=True)
    right_at = to_numpy(pc.fill_null(found, -1))
    del found
    if how == "left":
        return None, right_at
    hit = right_at >= 0
    if hit.all():
        return None, right_at
    left_rows = np.flatnonzero(hit).astype(right_at.dtype)
    return left_rows, gather(right_at, left_rows)


def binary_equal_at(a: pa.Array, ai: np.ndarray, b: pa.Array, bi: np.ndarray) -> np.ndarray:
    """``a[ai] == b[bi]`` pair by pair for two binary-like arrays, False where either is null,
    without gathering the values: lengths compared, then the bytes 8 at a time (unaligned
    little-endian words, the last one masked to the value's bytes), by slices of pairs."""
    out = empty(len(ai), bool)
    if not len(ai):
        return out
    sides = []
    for arr in (a, b):
        offsets, data = _binary_parts(arr)
        words = _words(data)
        valid = to_numpy(arr.is_valid()) if arr.null_count else None
        sides.append((offsets, words, valid))
    (ao, aw, av), (bo, bw, bv) = sides
    for i in range(0, len(ai), _CHUNK):
        x, y = ai[i:i + _CHUNK], bi[i:i + _CHUNK]
        sa, sb = ao[x], bo[y]
        length = ao[x + 1] - sa
        same = length == (bo[y + 1] - sb)
        if av is not None:
            same &= av[x]
        if bv is not None:
            same &= bv[y]
        rows = np.flatnonzero(same)
        j = 0
        while len(rows):
            left = length[rows] - j
            mask = _KEEP_BYTES[np.minimum(left, 8)]
            differ = (aw[sa[rows] + j] ^ bw[sb[rows] + j]) & mask
            same[rows[differ != 0]] = False
            j += 8
            rows = rows[(differ == 0) & (left > 8)]
        out[i:i + _CHUNK] = same
    return out
