"""The local join run after the shuffle (:func:`join`), and the output built from its
row-index pairs (:func:`assemble`, :func:`take`).

One integer or temporal key without nulls is matched by :mod:`hetflow.frame._intmatch`; one
string or binary key through its 64-bit hash, or Arrow's set lookup against a small unique right
side (:mod:`hetflow.frame._strmatch`). Every other case (floats, several keys, nulls in an
integer key) runs Arrow's hash join (``Table.join``). Both give the same rows, columns and
names: the left columns, then the right non-key columns, colliding names suffixed, keys
coalesced under the left names; row order is unspecified. A left join on unique right keys
keeps its left columns uncopied (``identity`` in :func:`hetflow.frame._intmatch.match`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.frame._arrays import _single, from_values, gather, plain_values, validity_bitmap
from hetflow.frame._intmatch import KEEPS_LEFT, KEEPS_RIGHT, match
from hetflow.frame._strmatch import SET_LOOKUP_ROWS, match_unique_binary

ARROW_JOIN_TYPE = {"inner": "inner", "left": "left outer", "right": "right outer",
                   "outer": "full outer", "full": "full outer", "semi": "left semi",
                   "anti": "left anti"}

#: The joins :func:`match` serves (the others run Arrow's hash join).
FAST_HOW = ("inner", "left", "right", "outer", "full")

#: pyarrow < 12 (pycylon's environments pin 9-10) waits for its hash join holding the GIL
#: while a worker thread frees a NumPy-backed buffer, which needs the GIL: a deadlock. Run it
#: on the calling thread there.
_ARROW_JOIN_OPTIONS = {"use_threads": False} if int(pa.__version__.split(".")[0]) < 12 else {}


def _one_key_ok(lschema: pa.Schema, rschema: pa.Schema, lk, rk, how, type_ok) -> bool:
    """One key of a type ``type_ok`` accepts, an equi-join that returns columns of both sides,
    and no name clash between one side's key and the other's non-key columns."""
    if len(lk) != 1 or how not in FAST_HOW or not type_ok(lschema.field(lk[0]).type):
        return False
    lnames, rnames = set(lschema.names), set(rschema.names)
    return not ((rk[0] != lk[0]) and (rk[0] in lnames or lk[0] in rnames))


def fast_key_ok(lschema: pa.Schema, rschema: pa.Schema, lk, rk, how) -> bool:
    """Whether the join can run on :func:`hetflow.frame._intmatch.match` (given that neither
    key column has nulls): one integer or temporal key (see :func:`_one_key_ok`)."""
    return _one_key_ok(lschema, rschema, lk, rk, how, lambda t: pa.types.is_integer(t) or (
        pa.types.is_temporal(t) and not pa.types.is_interval(t)))


def binary_key_ok(lschema: pa.Schema, rschema: pa.Schema, lk, rk, how) -> bool:
    """Whether the join can match on its key's 64-bit hash
    (:func:`hetflow.frame._strmatch.match_by_hash`): one string or binary key, nulls allowed
    (see :func:`_one_key_ok`)."""
    return _one_key_ok(lschema, rschema, lk, rk, how, lambda t: (
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)))


def join(left: pa.Table, right: pa.Table, lk: Sequence[str], rk: Sequence[str], how: str,
         suffixes: Tuple[str, str]) -> pa.Table:
    """Local join of two tables (see the module docstring for the output's shape)."""
    if (how in ("inner", "left") and right.num_rows <= SET_LOOKUP_ROWS
            and binary_key_ok(left.schema, right.schema, lk, rk, how)):
        keys = {"left": _single(left.column(lk[0])), "right": _single(right.column(rk[0]))}
        found = match_unique_binary(keys["left"], keys["right"], how)
        if found is not None:
            return assemble(left.schema, right.schema, lk[0], rk[0], *found, how, suffixes,
                            left.column, right.column, keys)
    if (not fast_key_ok(left.schema, right.schema, lk, rk, how)
            or left.column(lk[0]).null_count or right.column(rk[0]).null_count):
        return left.join(right, keys=list(lk), right_keys=list(rk),
                         join_type=ARROW_JOIN_TYPE[how], left_suffix=suffixes[0],
                         right_suffix=suffixes[1], coalesce_keys=True,
                         **_ARROW_JOIN_OPTIONS)
    keys = {"left": _single(left.column(lk[0])), "right": _single(right.column(rk[0]))}
    li, ri = match(keys["left"], keys["right"], how, identity=True)
    return assemble(left.schema, right.schema, lk[0], rk[0], li, ri, how, suffixes,
                    left.column, right.column, keys)


def take(arr, idx: Optional[np.ndarray], may_miss: bool):
    """``arr[idx]``, null where ``idx`` is -1 when ``may_miss``: NumPy for plain values, Arrow's
    take otherwise. ``idx`` None: every row in order (:func:`match`'s ``identity``), ``arr``
    itself, chunks and all, not copied."""
    if idx is None:
        return arr
    arr = _single(arr)
    values = plain_values(arr)
    valid = (idx >= 0) if may_miss else None
    if valid is not None and valid.all():
        valid = None
    if valid is not None:
        # -1 is the only negative index: row 0 read there (masked), cheaper than np.where
        idx = np.maximum(idx, 0)
    index_type = pa.from_numpy_dtype(idx.dtype)
    if values is not None:
        if valid is not None and len(values) == 0:
            return pa.nulls(len(idx), arr.type)
        return from_values(arr.type, gather(values, idx), valid)
    if valid is None:
        return arr.take(from_values(index_type, idx))
    if len(arr) and not arr.null_count and _bitmap_only(arr.type):
        # the rows taken whole, then the misses' validity bits cleared: Arrow's take with
        # null indices took twice as long (5M strings from 10k: 44 ms against 23)
        got = arr.take(from_values(index_type, idx))
        return pa.Array.from_buffers(arr.type, len(got), [validity_bitmap(valid), *got.buffers()[1:]])
    return arr.take(from_values(index_type, idx, valid))


def _bitmap_only(t: pa.DataType) -> bool:
    """Types whose nulls are only their validity bitmap (no child arrays, no views)."""
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_boolean(t))


def assemble(lschema: pa.Schema, rschema: pa.Schema, lkey: str, rkey: str,
             li: Optional[np.ndarray], ri: np.ndarray, how: str, suffixes: Tuple[str, str],
             fetch_left: Callable[[str], pa.Array], fetch_right: Callable[[str], pa.Array],
             keys: Dict[str, pa.Array]) -> pa.Table:
    """The join's output table from its row-index pairs, built one column at a time.

    ``keys`` holds the two key columns (``"left"``, ``"right"``); it is emptied as they are used.
    Every other column is asked for with ``fetch_left``/``fetch_right`` when it is gathered and
    dropped right after, so a caller that streams columns in (a shuffle) never holds more than
    one of them beside the output. Columns: for ``how="right"`` the left's non-key columns then
    all of the right's (key under the right's name, Arrow's and polars' layout); otherwise all
    of the left's (key coalesced from both sides for a full outer join), then the right's
    non-key columns; names on both sides get ``suffixes``. ``li`` None: the left columns as
    they are (see :func:`match`'s ``identity``).

    Where a column's local work raises (after data has moved), the rest of the columns are
    still fetched and dropped, so a fetch that is a collective exchange completes on every
    rank, and the error is raised after the last one: the caller agrees on it with
    :func:`hetflow.frame._agreement.step` around this call.
    """
    left_misses = how in KEEPS_RIGHT   # left cells of the right side's unmatched rows
    right_misses = how in KEEPS_LEFT
    if how == "right":
        plan = [("L", c) for c in lschema.names if c != lkey] + [("R", c) for c in rschema.names]
        clash = {c for s, c in plan if s == "L"} & (set(rschema.names) - {rkey})
        keys.pop("left")
    else:
        plan = [("L", c) for c in lschema.names] + [("R", c) for c in rschema.names if c != rkey]
        clash = {c for s, c in plan if s == "L"} & {c for s, c in plan if s == "R"}
        if how in ("inner", "left"):
            keys.pop("right")
    names = [c + suffixes[0 if s == "L" else 1] if c in clash else c for s, c in plan]
    columns = [None] * len(plan)
    is_key = lambda s, c: (s, c) in (("L", lkey), ("R", rkey))  # noqa: E731 - a one-line predicate
    error: Optional[Exception] = None
    # keys first: the key arrays are freed before any payload column arrives
    for i in sorted(range(len(plan)), key=lambda i: not is_key(*plan[i])):
        side, name = plan[i]
        # a payload column's fetch is collective in a shuffle: made on every rank, failed or not
        col = None if is_key(side, name) else (fetch_left if side == "L" else fetch_right)(name)
        if error is not None:
            continue
        try:
            if side == "L" and name == lkey:
                if how in ("outer", "full"):
                    col = _coalesced_key(keys.pop("left"), keys.pop("right"), li, ri)
                else:
                    col = take(keys.pop("left"), li, left_misses)
            elif side == "R" and name == rkey:
                col = take(keys.pop("right"), ri, False)
            else:
                col = take(col, li if side == "L" else ri,
                           left_misses if side == "L" else right_misses)
        except Exception as exc:  # noqa: BLE001 - raised below, after the last fetch
            error, col = exc, None
            keys.clear()
        columns[i] = col
        del col
    if error is not None:
        raise error
    return pa.Table.from_arrays(columns, names=names)


def _coalesced_key(left_key, right_key, li: np.ndarray, ri: np.ndarray) -> pa.Array:
    """A full outer join's key column: the left key where the row has a left side, else the
    right key (one gather per side, no intermediate null-masked columns for plain values)."""
    left_key, right_key = _single(left_key), _single(right_key)
    lv, rv = plain_values(left_key), plain_values(right_key)
    if lv is None or rv is None:
        return pc.coalesce(take(left_key, li, True), take(right_key, ri, True))
    has_left = li >= 0
    if not len(lv):
        return from_values(left_key.type, gather(rv, ri))
    out = gather(lv, np.where(has_left, li, 0))
    missing = np.flatnonzero(~has_left)
    out[missing] = gather(rv, ri[missing])
    return from_values(left_key.type, out)
