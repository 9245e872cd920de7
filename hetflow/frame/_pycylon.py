"""The engine's operations run by pycylon (Cylon's own C++ engine) on the table's communicator.

Asked for with ``backend="pycylon"`` (argument, :func:`~hetflow.frame.set_backend` or
``$HETFLOW_FRAME_BACKEND``). Each operation goes one of three ways, decided from facts every rank
agrees on, so all ranks take the same way and none is left in a collective:

* pycylon runs it, and the result's ``backend`` is ``"pycylon"``: inner join (Cylon's sort
  join), sort, group-by-aggregate (sum, count, min, max, mean) and unique over all columns.
  Each rank's partition goes into a ``pycylon.DataFrame``; the distributed call gets a
  ``CylonEnv`` built on a private duplicate of the table's communicator; the answer comes back
  with ``to_arrow()`` and is reshaped to exactly the CPU engine's columns, names and types.
* pycylon has no such operation (semi/anti join; a shuffle co-partitioned with the CPU
  engine's; the group-by functions of ``_NO_CYLON_AGG``), gets it wrong (``_CYLON_WRONG``:
  left, right and outer joins; string and binary keys of a join, group-by or unique on more
  than one rank), or cannot carry a column of the table (a join or sort with a dictionary,
  decimal or duration column, ``_cylon_table_type``; on more than one rank also a bool or
  large_string column, which Cylon cannot split between ranks, ``_cylon_split_type``): the
  CPU engine runs it, the result's ``backend`` is ``"cpu"``, and a warning on the
  ``hetflow.frame`` logger says why.
  This does not need pycylon to be installed.
* pycylon has the operation but its semantics differ from the CPU engine's in a way the adapter
  cannot convert (NaN keys, null sort keys, null aggregated values, NaN under a min or max,
  unique over a subset):
  :class:`~hetflow.errors.NotSupported` names the difference.

Only then is pycylon imported: if it is missing, :class:`~hetflow.errors.BackendUnavailable`
carries the import error. The pycylon facts relied on (cylondata/cylon at 03e0338):
``MPIConfig(comm)`` wraps an mpi4py communicator (python/pycylon/pycylon/net/mpi_config.pyx) and
Cylon never finalizes an MPI it did not initialize (cpp/src/cylon/net/mpi/mpi_communicator.cpp,
``MPICommunicator::Finalize``); passing ``env=`` makes ``DataFrame.merge``/``sort_values``/
``groupby``/``drop_duplicates`` distributed (python/pycylon/pycylon/frame.py); join output is all
left columns then all right columns, prefixes applied only to colliding names
(cpp/src/cylon/join/join_utils.cpp, ``build_final_table_schema``); Cylon's row comparator treats
two nulls as equal and compares values with ``==`` (cpp/src/cylon/arrow/arrow_comparator.cpp).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import BackendUnavailable, HetflowError, NotSupported
from hetflow.frame import _backend
from hetflow.frame._table import DistributedTable

log = logging.getLogger("hetflow.frame")

# pycylon's join types (python/pycylon/pycylon/common/join_config.pyx, StrToJoinType)
_JOIN_HOW = {"inner": "inner", "left": "left", "right": "right", "outer": "outer",
             "full": "outer"}
# The aggregations run on pycylon, by their names there (python/pycylon/pycylon/data/
# aggregates.pyx, AggregationOpString); the others run on the CPU engine (_NO_CYLON_AGG).
_AGG = {"sum": "sum", "count": "cnt", "min": "min", "max": "max", "mean": "mean"}
# What Cylon (cylondata/cylon at 03e0338, run beside the CPU engine on the same data) computes
# wrong, and so never runs here: the CPU engine does, and the log says why.
_CYLON_WRONG = {
    "outer joins": "Cylon's left, right and outer joins give an unmatched row's cells of the "
                   "other side 0 instead of null (and crash when such a column holds nulls)",
    "string keys": "on more than one rank Cylon partitions string and binary keys by the "
                   "address of each value, not its bytes (a join loses rows, a group-by or "
                   "unique returns a group more than once)",
}


# The CPU engine's modules are imported late: each of them imports this module lazily too.
def _groupby():
    from hetflow.frame import _groupby
    return _groupby


def _unique_cpu(table: DistributedTable, names: List[str]) -> DistributedTable:
    from hetflow.frame._unique import unique
    return unique(table, names, backend="cpu")


def _sort_cpu(table: DistributedTable, names: List[str], asc: List[bool]) -> DistributedTable:
    from hetflow.frame._sort import sort
    return sort(table, names, asc, backend="cpu")


def _shuffle_cpu(table: DistributedTable, names: List[str]) -> DistributedTable:
    from hetflow.frame._shuffle import shuffle
    return shuffle(table, names, backend="cpu")


# -- checks every rank agrees on ---------------------------------------------------------------
def _cylon_split_type(t: pa.DataType) -> bool:
    """Types Cylon can split between ranks (partition.cpp fails with "splitter not implemented"
    on any other column: arrow_kernels.cpp's CreateSplitter): integers, float32/64, string,
    binary, fixed-size binary, dates, timestamps, times. No bool, large_string, large_binary,
    float16, decimal or nested types."""
    return ((pa.types.is_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t)
             or pa.types.is_string(t) or pa.types.is_binary(t)
             or pa.types.is_fixed_size_binary(t) or pa.types.is_date(t)
             or pa.types.is_timestamp(t) or pa.types.is_time(t)))


def _cylon_key_type(t: pa.DataType) -> bool:
    """Types Cylon's row hash, comparator and sort kernels all handle: the splittable ones
    (arrow_comparator.cpp's and CreateSorter's switches also lack bool and large_string,
    which fail at one rank too: "unknown type large_string")."""
    return _cylon_split_type(t)


def _cylon_table_type(t: pa.DataType) -> bool:
    """Types a pycylon Table can hold at all (arrow_types.cpp's CheckSupportedTypes; any other
    column fails ``DataFrame(table)`` with "unsupported type", on one rank too): the
    splittable ones, bool, float16, large_string, large_binary, and lists of numbers. No
    dictionary, decimal, duration, interval, struct or null column."""
    if pa.types.is_list(t):
        return pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)
    return (_cylon_split_type(t) or pa.types.is_boolean(t) or pa.types.is_float16(t)
            or pa.types.is_large_string(t) or pa.types.is_large_binary(t))


def _uncarried(comm, op: str, *schemas: pa.Schema) -> Optional[str]:
    """Why Cylon cannot carry the tables' columns, key or not, through ``op``: a type a pycylon
    Table cannot hold, or (on more than one rank) one Cylon cannot split between ranks; None if
    it can."""
    def named(ok) -> List[str]:
        return [f"{f.name!r} ({f.type})" for schema in schemas for f in schema
                if not ok(f.type)]
    unheld = named(_cylon_table_type)
    if unheld:
        return (f"column {', '.join(unheld)}: a pycylon Table cannot hold this type (making "
                "one fails with 'unsupported type')")
    unsplit = named(_cylon_split_type) if comm.Get_size() > 1 else []
    if unsplit:
        return (f"column {', '.join(unsplit)}: Cylon has no splitter for this type (a {op} on "
                "more than one rank fails with 'splitter not implemented')")
    return None


def _require_key_types(op: str, schema: pa.Schema, names: Sequence[str], side: str = "") -> None:
    for n in names:
        t = schema.field(n).type
        if not _cylon_key_type(t):
            where = f" of the {side} table" if side else ""
            raise NotSupported(f"{op} on pycylon: key column {n!r}{where} is {t}, a type Cylon's "
                               f"row comparator does not handle; use backend='cpu'")


def _address_hashed(comm, schema: pa.Schema, names: Sequence[str]) -> List[str]:
    """The ``names`` whose values Cylon would partition by address (``_CYLON_WRONG``): string
    and binary columns, when the table spans more than one rank."""
    if comm.Get_size() == 1:
        return []
    return [n for n in names if _bytes_type(schema.field(n).type)]


def _bytes_type(t: pa.DataType) -> bool:
    """String and binary types (large and fixed-size too)."""
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t))


def _counts(comm, parts: Sequence[Tuple[pa.Table, Sequence[str]]]) -> List[Tuple[int, int]]:
    """(nulls, NaNs) of every named column, summed over all ranks (collective)."""
    local = []
    for table, names in parts:
        for n in names:
            col = table.column(n)
            nan = 0
            if pa.types.is_floating(col.type) and len(col):
                nan = pc.sum(pc.is_nan(col)).as_py() or 0
            local += [col.null_count, int(nan)]
    total = comm.allreduce(np.array(local, dtype=np.int64)) if local else np.zeros(0, np.int64)
    return [(int(total[i]), int(total[i + 1])) for i in range(0, len(total), 2)]


def _negative_zeros(comm, table: pa.Table, names: Sequence[str]) -> List[str]:
    """The float columns among ``names`` holding -0.0 on any rank (collective)."""
    local = []
    for n in names:
        col = table.column(n)
        found = False
        if pa.types.is_floating(col.type) and len(col):
            v = np.asarray(pc.fill_null(col, 1.0).to_numpy(), dtype=np.float64)
            found = bool((np.signbit(v) & (v == 0)).any())
        local.append(int(found))
    total = comm.allreduce(np.array(local, dtype=np.int64)) if local else []
    return [n for n, k in zip(names, total) if k]


def _on_cpu(op: str, why: str, run: Callable[[], DistributedTable]) -> DistributedTable:
    log.warning("hetflow.frame: %s ran on the CPU engine, not pycylon: %s", op, why)
    return run()


# -- one pycylon session per operation ---------------------------------------------------------
class _Session:
    """A ``pycylon.CylonEnv`` on a private duplicate of ``comm`` for one operation.

    The duplicate keeps Cylon's messages and the ``MPI_ERRORS_RETURN`` handler Cylon installs
    (MPICommunicator::Make) off the caller's communicator. Closing finalizes the Cylon context
    (Cylon leaves MPI itself initialized since it did not initialize it) and frees the duplicate.
    """

    def __init__(self, comm):
        # Agreed over the ranks, so a rank where pycylon imports never waits in Dup for one
        # where it does not; each rank raises its own import error, or names the failing rank.
        mine = None
        try:
            self.pycylon = _backend.pycylon_module()
        except BackendUnavailable as exc:
            mine = str(exc)
        failed = [(r, e) for r, e in enumerate(comm.allgather(mine)) if e]
        if failed:
            raise BackendUnavailable(mine or f"pycylon cannot run on rank {failed[0][0]}: "
                                     f"{failed[0][1]}")
        self.comm = comm
        self.dup = comm.Dup()
        self.env = None
        error = None
        try:
            from pycylon.net import MPIConfig
            self.env = self.pycylon.CylonEnv(config=MPIConfig(self.dup), distributed=True)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        try:
            _agree_no_error(comm, error, "could not create a CylonEnv")
        except HetflowError:
            self.close()
            raise

    def run(self, op: str, fn: Callable[[], pa.Table]) -> pa.Table:
        """``fn()`` on every rank; a failure on any rank raises the same error on all ranks."""
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        _agree_no_error(self.comm, error, f"{op} failed")
        return result

    def close(self) -> None:
        if self.env is not None:
            self.env.finalize()
            self.env = None
        if self.dup is not None:
            self.dup.Free()
            self.dup = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _agree_no_error(comm, error, what: str) -> None:
    errors = comm.allgather(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad[:4])
        raise HetflowError(f"pycylon {what} ({detail})")


def _renamed(table: pa.Table, prefix: str) -> pa.Table:
    """Columns renamed ``<prefix>0..`` so no name collides between the sides (Cylon would then
    prefix them) or with Cylon's aggregate names, and chunks combined (Cylon's group-by reads
    only a column's first chunk, hash_groupby.cpp)."""
    return table.rename_columns([f"{prefix}{i}" for i in range(table.num_columns)]) \
        .combine_chunks()


def _conform(columns, schema: pa.Schema) -> pa.Table:
    """The CPU engine's names and types (Cylon may widen, e.g. a sum's result type)."""
    cast = []
    for col, field in zip(columns, schema):
        cast.append(col if col.type == field.type else col.cast(field.type, safe=True))
    return pa.Table.from_arrays(cast, schema=schema)


# -- join --------------------------------------------------------------------------------------
def join(left: DistributedTable, right: DistributedTable, lk: List[str], rk: List[str], how: str,
         suffixes) -> DistributedTable:
    """:func:`hetflow.frame.join` on pycylon (inputs already validated by the caller): inner
    joins, on Cylon's sort join (3-4x faster than its hash join here); the other kinds run on
    the CPU engine (``_CYLON_WRONG``).

    Differences converted: key columns are coalesced under the left names and colliding
    non-key names get ``suffixes`` (pycylon keeps both key columns and applies its "suffixes" as
    prefixes); null keys never match (Cylon matches null with null), so rows with a null key
    are kept out of pycylon.
    """
    comm = left.comm

    def on_cpu():
        from hetflow.frame._join import join as cpu_join
        return cpu_join(left, right, how=how, left_on=lk, right_on=rk,
                        suffixes=tuple(suffixes), backend="cpu")

    if how not in _JOIN_HOW:
        return _on_cpu(f"{how} join", "pycylon has no semi or anti join (JoinConfig knows inner, "
                       "left, right and outer)", on_cpu)
    if how != "inner":
        return _on_cpu(f"{how} join", _CYLON_WRONG["outer joins"], on_cpu)
    _require_key_types("join", left.local.schema, lk, "left")
    _require_key_types("join", right.local.schema, rk, "right")
    why = _uncarried(comm, "join", left.local.schema, right.local.schema)
    if why:
        return _on_cpu("join", why, on_cpu)
    strings = (_address_hashed(comm, left.local.schema, lk)
               + _address_hashed(comm, right.local.schema, rk))
    if strings:
        return _on_cpu("join", f"key {', '.join(map(repr, strings))}: "
                       f"{_CYLON_WRONG['string keys']}", on_cpu)
    counts = _counts(comm, [(left.local, lk), (right.local, rk)])
    names = [f"left {n!r}" for n in lk] + [f"right {n!r}" for n in rk]
    nan_keys = [n for n, (_, nans) in zip(names, counts) if nans]
    if nan_keys:
        raise NotSupported(f"join on pycylon: float key {', '.join(nan_keys)} holds NaN; Cylon "
                           "compares keys with == (NaN never matches NaN) while the CPU engine's "
                           "Arrow join matches NaN keys; use backend='cpu' or drop the NaN rows")
    from hetflow.frame import _localjoin
    from hetflow.frame._join import canonical_zero
    # the CPU engine's exact output schema: its local kernel on empty inputs
    schema = _localjoin.join(left.local.slice(0, 0), right.local.slice(0, 0), lk, rk, how,
                             tuple(suffixes)).schema
    L = canonical_zero(left.local, lk)
    R = canonical_zero(right.local, rk)
    l_ok = L.filter(pc.invert(_null_key_mask(L, lk))) if L.num_rows else L
    r_ok = R.filter(pc.invert(_null_key_mask(R, rk))) if R.num_rows else R
    li = [L.schema.get_field_index(n) for n in lk]
    ri = [R.schema.get_field_index(n) for n in rk]
    r_rest = [j for j in range(R.num_columns) if j not in ri]

    with _Session(comm) as s:
        def work() -> pa.Table:
            ldf = s.pycylon.DataFrame(_renamed(l_ok, "l"))
            rdf = s.pycylon.DataFrame(_renamed(r_ok, "r"))
            out = ldf.merge(rdf, how="inner", algorithm="sort",
                            left_on=[f"l{i}" for i in li], right_on=[f"r{j}" for j in ri],
                            suffixes=("", ""), env=s.env)
            return out.to_arrow()
        got = s.run("join", work)

    if got.column_names != ([f"l{i}" for i in range(L.num_columns)]
                            + [f"r{j}" for j in range(R.num_columns)]):
        raise HetflowError(f"pycylon join returned columns {got.column_names}, not the left "
                           f"then right columns this adapter expects; not using its result")
    # the CPU engine's column order (see _localjoin.assemble): all of the left's columns, then
    # the right's non-key columns
    out = _conform([got.column(i) for i in range(L.num_columns)]
                   + [got.column(L.num_columns + j) for j in r_rest], schema)
    return DistributedTable(comm, out, backend="pycylon")


def _null_key_mask(table: pa.Table, keys: Sequence[str]) -> pa.Array:
    """True where any key is null (such a row never matches, as in SQL and the CPU engine)."""
    mask = pa.array(np.zeros(table.num_rows, dtype=bool))
    for n in keys:
        col = table.column(n)
        if col.null_count:
            mask = pc.or_(mask, pc.is_null(col))
    return mask


# -- sort --------------------------------------------------------------------------------------
#: Cylon's sample sort fails with this when a rank is to receive no rows (every key equal, on
#: 2 ranks: 20 rows as well as 3; Cylon 03e03387): the CPU engine then sorts.
_EMPTY_MERGE = "empty vector passed onto merge"


def sort(table: DistributedTable, names: List[str], asc: List[bool]) -> DistributedTable:
    """:func:`hetflow.frame.sort` on pycylon's distributed sample sort.

    Like the CPU engine, rank i's rows sort before rank i+1's. Unlike it, rows with equal keys
    may come out in another order (Cylon's sort is not stable). Null or NaN keys are refused:
    the CPU engine puts them last in both directions, Cylon takes one null order for the sort.
    """
    comm = table.comm
    _require_key_types("sort", table.local.schema, names)
    why = _uncarried(comm, "sort", table.local.schema)
    if why:
        return _on_cpu("sort", why, lambda: _sort_cpu(table, names, asc))
    counts = _counts(comm, [(table.local, names)])
    bad = [n for n, (nulls, nans) in zip(names, counts) if nulls or nans]
    if bad:
        raise NotSupported(f"sort on pycylon: key {', '.join(map(repr, bad))} holds nulls or "
                           "NaN; the CPU engine sorts them last in both directions, which "
                           "pycylon's sort does not promise; use backend='cpu'")
    idx = [table.local.schema.get_field_index(n) for n in names]
    try:
        with _Session(comm) as s:
            def work() -> pa.Table:
                df = s.pycylon.DataFrame(_renamed(table.local, "c"))
                return df.sort_values(by=[f"c{i}" for i in idx], ascending=list(asc),
                                      env=s.env).to_arrow()
            got = s.run("sort", work)
    except HetflowError as exc:   # the same error on every rank (Session.run agrees on it)
        if _EMPTY_MERGE not in str(exc):
            raise
        return _on_cpu("sort", "Cylon's sample sort failed where a rank's share of the rows "
                       f"is empty (many equal keys, few rows): {exc}",
                       lambda: _sort_cpu(table, names, asc))
    out = _conform([got.column(i) for i in range(got.num_columns)], table.local.schema)
    return DistributedTable(comm, out, backend="pycylon")


# -- group-by / unique -------------------------------------------------------------------------
def groupby_agg(table: DistributedTable, by: List[str], planned: Sequence) -> DistributedTable:
    """``GroupBy.agg`` on pycylon's distributed hash group-by. ``planned``: the CPU engine's
    aggregations (:class:`hetflow.frame._aggregate.Planned`), columns grouped in order.

    Sums and means are asked of Cylon over the column widened to 64 bits (Cylon sums in the
    column's own type, so an int32 sum past 2**31 would wrap, and a float32 mean would be
    computed at float32 precision); the CPU engine sums integers as int64 and means at
    float64 too. Float keys go with -0.0 made 0.0 (one group, as on the CPU engine)."""
    comm = table.comm
    schema = table.local.schema
    spec: Dict[str, list] = {}
    for p in planned:
        spec.setdefault(p.column, []).append(p.source)

    def on_cpu():
        return _groupby().GroupBy(table, by).agg(spec, backend="cpu")

    for p in planned:
        if p.name not in _AGG:
            return _on_cpu(f"groupby {p.name}", _NO_CYLON_AGG.get(p.name, _NO_CYLON_AGG[None])
                           .format(name=p.name), on_cpu)
    _require_key_types("groupby", schema, by)
    strings = _address_hashed(comm, schema, by)
    if strings:
        return _on_cpu("groupby", f"key {', '.join(map(repr, strings))}: "
                       f"{_CYLON_WRONG['string keys']}", on_cpu)
    for p in planned:
        if p.column in by:
            raise NotSupported(f"groupby.agg on pycylon: column {p.column!r} is also a group "
                               "key, which Cylon's group-by does not take; use backend='cpu'")
        t = schema.field(p.column).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)) or pa.types.is_float16(t):
            raise NotSupported(f"groupby.agg on pycylon: column {p.column!r} is {t}; Cylon's "
                               "aggregation kernels take integer and float columns only")
    values = list(dict.fromkeys(p.column for p in planned))
    counts = _counts(comm, [(table.local, by), (table.local, values)])
    key_counts, value_counts = counts[:len(by)], counts[len(by):]
    bad_keys = [n for n, (nulls, nans) in zip(by, key_counts) if nulls or nans]
    if bad_keys:
        raise NotSupported(f"groupby on pycylon: key {', '.join(map(repr, bad_keys))} holds nulls "
                           "or NaN; the CPU engine makes each one group, Cylon compares NaN with "
                           "== (every NaN its own group); use backend='cpu'")
    bad_values = [n for n, (nulls, _) in zip(values, value_counts) if nulls]
    if bad_values:
        raise NotSupported(f"groupby.agg on pycylon: column {', '.join(map(repr, bad_values))} "
                           "holds nulls; Cylon's kernels give an all-null group 0 or the "
                           "kernel's start value where the CPU engine gives null; use "
                           "backend='cpu'")
    extremes = {p.column for p in planned if p.name in ("min", "max")}
    nan_values = [n for n, (_, nans) in zip(values, value_counts) if nans and n in extremes]
    if nan_values:
        raise NotSupported(f"groupby.agg on pycylon: column {', '.join(map(repr, nan_values))} "
                           "holds NaN; Cylon's min and max compare with <, so a group's result "
                           "is NaN or a number depending on where its NaN falls, where the CPU "
                           "engine skips NaN; use backend='cpu'")
    # the CPU engine's exact result schema: its own kernels on an empty partition
    out_schema = _groupby().result_schema(schema, by, planned)
    # What Cylon is asked for, per column in first-use order (its output's order): the plan's
    # functions, except the mean of an integer column, which Cylon returns truncated to an
    # integer; it is asked for that column's sum and count, and divided here.
    asks: Dict[str, List[str]] = {}
    for p in planned:
        want = asks.setdefault(p.column, [])
        for g in (("sum", "count") if p.name == "mean" and _integer_mean(schema, p.column)
                  else (p.name,)):
            if g not in want:
                want.append(g)
    position = {}
    for col, funcs in asks.items():
        for g in funcs:
            position[(col, g)] = len(by) + len(position)
    # only the keys and aggregated columns go to Cylon, those summed widened to 64 bits, and
    # float keys with -0.0 as 0.0: Cylon groups floats by their bits (-0.0 and 0.0 two groups),
    # the CPU engine as values
    from hetflow.frame._join import canonical_zero
    sent = canonical_zero(table.local.select(by + values), by)
    for col, funcs in asks.items():
        if "sum" in funcs or "mean" in funcs:
            i = sent.schema.get_field_index(col)
            sent = sent.set_column(i, col, sent.column(i).cast(_wide(schema.field(col).type)))
    index = {n: i for i, n in enumerate(sent.schema.names)}
    agg = {f"c{index[col]}": [_AGG[g] for g in funcs] for col, funcs in asks.items()}
    with _Session(comm) as s:
        def work() -> pa.Table:
            df = s.pycylon.DataFrame(_renamed(sent, "c"))
            return df.groupby([f"c{index[n]}" for n in by], env=s.env).agg(agg).to_arrow()
        got = s.run("groupby", work)
    if got.num_columns != len(by) + len(position):
        raise HetflowError(f"pycylon groupby returned {got.num_columns} columns, expected "
                           f"{len(by)} keys and {len(position)} aggregates; not using its result")
    columns = [got.column(i) for i in range(len(by))]
    for p in planned:
        if p.name == "mean" and _integer_mean(schema, p.column):
            total = got.column(position[(p.column, "sum")]).cast(pa.float64())
            count = got.column(position[(p.column, "count")]).cast(pa.float64())
            columns.append(pc.divide(total, count))     # no nulls here: count >= 1
        else:
            columns.append(got.column(position[(p.column, p.name)]))
    out = _conform(columns, out_schema)
    return DistributedTable(comm, out, backend="pycylon")


def _wide(t: pa.DataType) -> pa.DataType:
    """The 64-bit type a column is summed in: int64, uint64 or float64."""
    if pa.types.is_unsigned_integer(t):
        return pa.uint64()
    return pa.int64() if pa.types.is_integer(t) else pa.float64()


# Why each aggregation pycylon's DataFrame.groupby(...).agg does not run goes to the CPU engine.
_NO_CYLON_AGG = {
    None: "pycylon's group-by has no {name} aggregation (its names: sum, cnt, min, max, var, "
          "nunique, mean, quantile, std; python/pycylon/pycylon/data/aggregates.pyx)",
    "var": "pycylon's agg takes a name only, no ddof, and Cylon's defaults disagree (VarOp's "
           "ddof=1, VarKernelOptions' ddof=0), so the ddof it applies is not known here",
    "std": "pycylon's agg takes a name only, no ddof, and Cylon's defaults disagree (VarOp's "
           "ddof=1, VarKernelOptions' ddof=0), so the ddof it applies is not known here",
    "median": "pycylon's agg takes a name only: no q and no interpolation (Cylon's quantile "
              "kernel states neither polars' nearest nor its linear median)",
    "quantile": "pycylon's agg takes a name only: no q (Cylon's quantile is at 0.5) and no "
                "interpolation",
    "nunique": "Cylon's nunique has not been compared with the CPU engine's (a null and NaN each "
               "count as one value) on a pycylon build",
}


def _integer_mean(schema: pa.Schema, col: str) -> bool:
    return pa.types.is_integer(schema.field(col).type)


def unique(table: DistributedTable, names: List[str]) -> DistributedTable:
    """:func:`hetflow.frame.unique` on pycylon's distributed unique, over all columns only.

    With a subset the CPU engine keeps each key's first occurrence in rank order; Cylon keeps
    whichever occurrence its shuffle delivers first, so a subset is refused. Over all columns
    duplicates are identical rows and both give the same rows.
    """
    comm = table.comm
    schema = table.local.schema
    if set(names) != set(schema.names):
        raise NotSupported("unique on pycylon: a subset of columns is not supported; the CPU "
                           "engine keeps each key's first occurrence in rank order, pycylon an "
                           "unspecified one; use backend='cpu' or unique over all columns")
    _require_key_types("unique", schema, schema.names)
    strings = _address_hashed(comm, schema, schema.names)
    if strings:
        return _on_cpu("unique", f"column {', '.join(map(repr, strings))}: "
                       f"{_CYLON_WRONG['string keys']}",
                       lambda: _unique_cpu(table, names))
    counts = _counts(comm, [(table.local, schema.names)])
    bad = [n for n, (nulls, nans) in zip(schema.names, counts) if nulls or nans]
    if bad:
        raise NotSupported(f"unique on pycylon: column {', '.join(map(repr, bad))} holds nulls or "
                           "NaN; Cylon compares NaN with == (never a duplicate) and its null "
                           "hashing is unverified here; use backend='cpu'")
    zeros = _negative_zeros(comm, table.local, schema.names)
    if zeros:
        return _on_cpu("unique", f"column {', '.join(map(repr, zeros))} holds -0.0: Cylon keeps "
                       "-0.0 and 0.0 apart, the CPU engine (as polars) counts them one value",
                       lambda: _unique_cpu(table, names))
    with _Session(comm) as s:
        def work() -> pa.Table:
            df = s.pycylon.DataFrame(_renamed(table.local, "c"))
            return df.drop_duplicates(subset=[f"c{i}" for i in range(len(schema))],
                                      env=s.env).to_arrow()
        got = s.run("unique", work)
    out = _conform([got.column(i) for i in range(got.num_columns)], schema)
    return DistributedTable(comm, out, backend="pycylon")


# -- shuffle -----------------------------------------------------------------------------------
def shuffle(table: DistributedTable, names: List[str]) -> DistributedTable:
    """Always the CPU engine's shuffle: pycylon's ``Table.shuffle`` places rows by Cylon's own
    hash, so its partitions would not line up with tables the CPU engine shuffles or joins."""
    return _on_cpu("shuffle", "pycylon's shuffle uses Cylon's own hash, so its partitions would "
                   "not be co-partitioned with the CPU engine's",
                   lambda: _shuffle_cpu(table, names))
