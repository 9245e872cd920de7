"""Deterministic, vectorized row hashing for hash partitioning.

Every rank must send a key to the same destination, so the hash may depend only on the key's
value and type: never on the process (Python's ``hash()`` of a string is salted per process) or on
how the column is chunked. Each column is mapped to a 64-bit integer representation (integers,
temporals and booleans as int64; floats by their bits with -0.0 and NaN canonicalised; strings and
binaries by their bytes, 8 at a time up to 64 bytes, byte by byte beyond), then
finalised with the splitmix64 mixer and combined column by column. Null keys hash to a constant.
One integer or temporal key takes a cheaper path (:func:`_int_partition`, Fibonacci hashing);
a join on one takes ``key mod P`` (:func:`modular_partition`) where that spreads evenly.
The mixing runs on ``xp`` = numpy or cupy (the GPU path).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import NotSupported
from hetflow.frame import _engine
from hetflow.frame._arrays import arrow_of, destination_dtype, plain_values, to_numpy
from hetflow.frame._phases import phase

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x5BD1E9955BD1E995)
_POLY = np.uint64(0x100000001B3)  # FNV-64 prime: odd, so multiplication is a bijection mod 2**64



def _is_view(t) -> bool:
    """A string_view/binary_view type (pyarrow >= 16; older pyarrow has neither)."""
    return getattr(pa.types, "is_string_view", lambda _: False)(t) or \
        getattr(pa.types, "is_binary_view", lambda _: False)(t)

def mix(xp, x):
    """splitmix64 finaliser, in place on a uint64 array; returns it."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _fill(arr: pa.Array, value) -> pa.Array:
    return pc.fill_null(arr, value) if arr.null_count else arr


def _int64_repr(arr: pa.Array) -> np.ndarray:
    """The array's values as int64 (nulls as 0), zero-copy where Arrow allows it."""
    t = arr.type
    if pa.types.is_boolean(t):
        return to_numpy(_fill(arr, False)).astype(np.int64)
    if pa.types.is_floating(t):
        values = to_numpy(_fill(arr, 0)).astype(np.float64)
        values = values + 0.0  # -0.0 == 0.0 must hash alike
        values[np.isnan(values)] = np.nan  # one canonical NaN bit pattern
        return values.view(np.int64)
    if pa.types.is_integer(t):
        return to_numpy(_fill(arr, 0)).astype(np.int64, copy=False)
    if (pa.types.is_temporal(t)) and not pa.types.is_interval(t):
        width = t.bit_width
        as_int = arr.view(pa.int64() if width == 64 else pa.int32())
        return to_numpy(_fill(as_int, 0)).astype(np.int64, copy=False)
    raise TypeError(t)


#: Values up to this many bytes are hashed 8 bytes at a time (:func:`_word_hash`); longer ones
#: byte by byte (:func:`_polynomial_hash`). The choice depends on the value alone, so every
#: rank hashes a value alike whatever else its column holds.
WORD_HASH_BYTES = 64


def _binary_parts(values: pa.Array):
    """(offsets as int64 relative to the first value, the values' bytes) of a binary-like array."""
    t = values.type
    if not (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
            or pa.types.is_large_binary(t)):
        values = values.cast(pa.large_binary())
        t = values.type
    wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    n = len(values)
    _, offsets_buf, data_buf = values.buffers()[:3]
    offsets = np.frombuffer(offsets_buf, np.int64 if wide else np.int32, count=n + 1,
                            offset=values.offset * (8 if wide else 4)).astype(np.int64)
    base = int(offsets[0])
    offsets -= base
    total = int(offsets[-1])
    data = (np.frombuffer(data_buf, np.uint8, count=total, offset=base) if total
            else np.zeros(0, np.uint8))
    return offsets, data


def _binary_hash(values: pa.Array) -> np.ndarray:
    """A 64-bit hash of each (non-null) binary/string value's bytes, vectorized: values up to
    :data:`WORD_HASH_BYTES` 8 bytes at a time, longer ones byte by byte; by slices of
    :data:`_ROWS` rows, so the temporaries (a handful of 8-byte arrays a row) stay that size:
    2.5M strings of 26 MiB held about 150 MiB of them at once when hashed whole."""
    n = len(values)
    if n == 0:
        return np.zeros(0, np.uint64)
    offsets, data = _binary_parts(values)
    words = _words(data)
    out = np.empty(n, np.uint64)
    for i in range(0, n, _ROWS):
        starts = offsets[i:i + _ROWS + 1]
        lengths = np.diff(starts)
        starts = starts[:-1]
        part = lengths.astype(np.uint64) * _GOLDEN
        long_rows = np.flatnonzero(lengths > WORD_HASH_BYTES)
        if not len(long_rows):
            part ^= _word_hash(starts, lengths, words)
        else:
            short = np.flatnonzero(lengths <= WORD_HASH_BYTES)
            part[short] ^= _word_hash(starts[short], lengths[short], words)
            part[long_rows] += _polynomial_hash(starts[long_rows], lengths[long_rows], data)
        out[i:i + _ROWS] = part
    return out


#: Rows :func:`_binary_hash` hashes at a time.
_ROWS = 1 << 18


def _words(data: np.ndarray) -> np.ndarray:
    """Every byte position of ``data`` as the start of an (unaligned) little-endian 64-bit
    word, over a copy padded with 8 zero bytes (so every value's last word reads whole)."""
    padded = np.zeros(len(data) + 8, np.uint8)
    padded[:len(data)] = data
    return np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))


#: ``_KEEP_BYTES[k]``: the mask of a word's low ``k`` bytes.
_KEEP_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(9)], np.uint64)


def _word_hash(starts: np.ndarray, lengths: np.ndarray, word_at: np.ndarray) -> np.ndarray:
    """The values' bytes read as little-endian 64-bit words (``word_at``, :func:`_words`; the
    last one zero-padded), each folded in with a multiply and a shift: a few passes over the
    rows instead of one per byte. A value takes exactly as many folds as it has words,
    whatever the others' lengths."""
    h = np.zeros(len(starts), np.uint64)
    rows = None  # all of them
    longest = int(lengths.max()) if len(lengths) else 0
    for j in range(0, longest, 8):
        if j:
            rows = np.flatnonzero(lengths > j) if rows is None else rows[lengths[rows] > j]
        at = starts + j if rows is None else starts[rows] + j
        w = word_at[at]
        # keep the value's own bytes of this word: some (its last word) or all 8
        w &= _KEEP_BYTES[np.minimum(lengths - j if rows is None else lengths[rows] - j, 8)]
        g = h if rows is None else h[rows]
        g ^= w
        g *= _M1
        g ^= g >> np.uint64(29)
        if rows is not None:
            h[rows] = g
    return h


def _polynomial_hash(starts: np.ndarray, lengths: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Polynomial hash of each value's bytes (the values given by ``starts``/``lengths``)."""
    out = np.zeros(len(starts), np.uint64)
    total = int(lengths.sum())
    if not total:
        return out
    local = np.zeros(len(lengths), np.int64)   # each value's first position in the pieces
    np.cumsum(lengths[:-1], out=local[1:])
    pos = np.arange(total, dtype=np.int64) - np.repeat(local, lengths)
    values = data[np.repeat(starts, lengths) + pos].astype(np.uint64)
    powers = np.cumprod(np.full(int(lengths.max()), _POLY, np.uint64), dtype=np.uint64)
    contrib = (values + np.uint64(1)) * powers[pos]
    nonempty = lengths > 0
    out[nonempty] = np.add.reduceat(contrib, local[nonempty])
    return out


def _few_distinct(arr: pa.Array, sample: int = 4096) -> bool:
    """Whether a large column repeats its values much (a sample of its rows has under a
    quarter distinct): then encoding it and hashing the dictionary is the cheaper way to the
    same hashes."""
    n = len(arr)
    if n < 4 * sample:
        return False
    picked = arr.take(pa.array(np.linspace(0, n - 1, sample).astype(np.int64)))
    return len(pc.unique(picked)) * 4 < sample


def _through(xp, dict_hash: np.ndarray, indices: pa.Array):
    """Each row's hash through its dictionary index (null rows get 0 here, their own hash
    later); a chunk of nulls only has an empty dictionary."""
    if not len(dict_hash):
        return xp.zeros(len(indices), dtype=np.uint64)
    return xp.asarray(dict_hash[to_numpy(_fill(indices, 0))])


def _column_hash_chunk(xp, arr: pa.Array):
    """uint64 hash of one chunk of a key column (on xp's device)."""
    t = arr.type
    if pa.types.is_dictionary(t):
        dict_hash = _column_hash_chunk(np, arr.dictionary)
        out = _through(xp, dict_hash, arr.indices)
    elif pa.types.is_null(t):
        return xp.full(len(arr), _NULL, dtype=np.uint64)
    elif (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
          or pa.types.is_large_binary(t) or _is_view(t) or pa.types.is_fixed_size_binary(t)
          or pa.types.is_decimal(t)):
        if pa.types.is_decimal(t):
            arr = arr.cast(pa.string())
        if _few_distinct(arr):  # hash each distinct value once, then through the indices
            encoded = pc.dictionary_encode(arr)
            out = _through(xp, mix(np, _binary_hash(encoded.dictionary)), encoded.indices)
        else:
            out = xp.asarray(mix(np, _binary_hash(arr)))
    else:
        try:
            rep = _int64_repr(arr)
        except TypeError:
            raise NotSupported(f"cannot hash-partition on a column of type {t}: key columns must "
                               "be integers, floats, booleans, strings/binaries, decimals or "
                               "temporals") from None
        out = mix(xp, xp.asarray(rep).view(np.uint64) + _GOLDEN)
    if arr.null_count:
        valid = xp.asarray(to_numpy(arr.is_valid()))
        out = xp.where(valid, out, _NULL)
    return out


def hash_rows(xp, table: pa.Table, keys: Sequence[str]):
    """One uint64 hash per row of ``table`` over the ``keys`` columns (on xp's device)."""
    h = None
    for name in keys:
        col = table.column(name)
        chunks = [_column_hash_chunk(xp, c) for c in col.chunks if len(c)]
        if not chunks:
            ch = xp.zeros(0, dtype=np.uint64)
        elif len(chunks) == 1:
            ch = chunks[0]
        else:
            ch = xp.concatenate(chunks)
        if h is None:
            h = ch
        else:
            h = mix(xp, h * _POLY + ch)
    if h is None:
        h = xp.zeros(table.num_rows, dtype=np.uint64)
    return h


def partition_of(xp, table: pa.Table, keys: Sequence[str], parts: int) -> np.ndarray:
    """Destination partition (0..parts-1) of each row, as a small host integer array."""
    with phase("partition"):
        return _partition_of(xp, table, keys, parts)


def _partition_of(xp, table: pa.Table, keys: Sequence[str], parts: int) -> np.ndarray:
    small = destination_dtype(parts)
    if len(keys) == 1 and is_integer_like(table.schema.field(keys[0]).type):
        return _int_partition(xp, table.column(keys[0]), parts, small)
    h = hash_rows(xp, table, keys)
    dest = (h % np.uint64(parts)).astype(small)
    del h
    return dest if xp is np else xp.asnumpy(dest)


def local_partition_of(table: pa.Table, keys: Sequence[str], parts: int) -> np.ndarray:
    """Destinations of ``table``'s rows by the compiled engine's row hash of the ``keys``
    columns, or those of :func:`partition_of` where a key type is not hashed there by value.

    For one operation's tables only (a group-by, unique): polars' row hash is stable within
    one polars version, not across them, and it hashes int32 and int64 keys of one value
    apart, so two tables partitioned so are co-partitioned only when their key types are the
    same and every rank runs the same polars. One pass over the keys in compiled code, where
    :func:`hash_rows` makes a dozen NumPy passes (two int32 keys of 5M rows, one rank, a
    loaded machine: 0.03 s against 0.29 s CPU). Floats hash as their canonical int64 bits
    (:func:`_int64_repr`: -0.0 as 0.0, one NaN; a null as 0.0, so every null lands on one
    rank), dictionaries as their values."""
    with phase("partition"):
        cols = []
        for name in keys:
            col = _engine.decoded(table.column(name))
            if pa.types.is_floating(col.type):     # a null as 0.0: one rank, as every null
                col = arrow_of(_int64_repr(col))
            elif not _engine.native(col.type):
                return _partition_of(np, table, keys, parts)
            cols.append(col)
        h = _engine.frame(cols, [f"k{i}" for i in range(len(cols))]).hash_rows(seed=41)
        return (h.to_numpy() % np.uint64(parts)).astype(destination_dtype(parts))


def is_integer_like(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or (pa.types.is_temporal(t) and not pa.types.is_interval(t))


def _int_partition(xp, col, parts: int, small) -> np.ndarray:
    """Destinations of one integer (or temporal) key column: Fibonacci hashing (the key times
    2**64 / golden ratio, mod 2**64), whose high 32 bits are spread evenly even for keys in a
    narrow or strided range, mapped onto 0..parts-1 by a multiply-shift (no division). Four
    vectorised passes instead of the general mixer's dozen; nulls are read as 0, so they all
    land on one rank (they never match in a join, and form one group in a groupby). The value
    alone decides the destination (any integer width reads as int64), so tables keyed by equal
    values are co-partitioned whatever the process or chunking."""
    chunks = [c for c in col.chunks if len(c)] if isinstance(col, pa.ChunkedArray) else [col]
    # 2**k ranks: ((h >> 32) * 2**k) >> 32 is h >> (64 - k), the same destinations in two
    # passes fewer
    bits = parts.bit_length() - 1 if 1 < parts <= 2**32 and parts & (parts - 1) == 0 else None
    out = []
    for arr in chunks:
        h = xp.asarray(_int64_repr(arr)).view(np.uint64) * _GOLDEN  # a new array: safe in place
        if bits is not None:
            h >>= np.uint64(64 - bits)
        else:
            h >>= np.uint64(32)
            h *= np.uint64(parts)
            h >>= np.uint64(32)
        out.append(h.astype(small))
        del h
    dest = out[0] if len(out) == 1 else (xp.concatenate(out) if out else xp.zeros(0, small))
    return dest if xp is np else xp.asnumpy(dest)


#: Up to this many ranks, the modular partition's balance check travels as ``parts`` counts per
#: rank in the operation's collective check (an allgather); beyond, in an allreduce of its own.
MODULAR_MAX_PARTS = 64
#: The modular partition is used when no destination gets more than this share above an even
#: split of the rows (or :data:`MODULAR_SLACK_ROWS`, which decides for small tables).
MODULAR_TOLERANCE = 0.05
MODULAR_SLACK_ROWS = 1024


def modular_partition(col, parts: int) -> np.ndarray:
    """Destinations ``key mod parts`` of one null-free integer (or temporal) key column, as
    small ints: Cylon's partitioner for integer keys. Rank r then holds only keys ``q * parts +
    r``, so its join can address its keys by ``q`` in a table ``parts`` times smaller than the
    keys' range (:func:`hetflow.frame._intmatch.match`'s ``stride``), where a hashed partition
    leaves every rank keys spread over the whole range. Unlike hashing it is not spread evenly
    for keys on a stride (all even, timestamps in whole seconds): :func:`modular_balanced` says
    whether it is for the data at hand. The remainder is that of the key's int64
    representation (:func:`_int64_repr`), non-negative, so any width and signedness gives one
    destination per value; for 2**k ranks it is the key's low k bits, read from its low byte."""
    small = destination_dtype(parts)
    chunks = [c for c in col.chunks if len(c)] if isinstance(col, pa.ChunkedArray) else [col]
    pow2 = parts & (parts - 1) == 0
    out = []
    for arr in chunks:
        raw = plain_values(arr)
        if pow2 and parts <= 256 and raw is not None and sys.byteorder == "little":
            out.append(raw.view(np.uint8)[::raw.itemsize] & np.uint8(parts - 1))
        elif pow2:
            out.append((_int64_repr(arr) & (parts - 1)).astype(small))
        else:
            out.append(np.remainder(_int64_repr(arr), parts).astype(small))
    return out[0] if len(out) == 1 else (np.concatenate(out) if out else np.zeros(0, small))


def modular_balanced(counts: np.ndarray) -> bool:
    """Whether the modular partition's global rows per destination (``counts``, summed over
    the ranks and tables) are even enough: see :data:`MODULAR_TOLERANCE`."""
    counts = np.asarray(counts, np.int64)
    even = counts.sum() / len(counts)
    return bool(counts.max() <= even * (1 + MODULAR_TOLERANCE) + MODULAR_SLACK_ROWS)
