"""The engine's operations run by pycylon (Cylon's own C++ engine) on the table's communicator.

Asked for with ``backend="pycylon"`` (argument, :func:`~hetflow.frame.set_backend` or
``$HETFLOW_FRAME_BACKEND``). Whether pycylon runs an operation is decided before, once, in
:func:`~hetflow.frame._prepare.prepare` (:mod:`hetflow.frame._cylon_rules`); an operation pycylon
runs calls one function here, which gets the rank's partitions and returns its result
partition, reshaped to exactly the CPU engine's columns, names and types. Nothing here calls
the CPU engine: where Cylon cannot finish (a sort whose rank share is empty), :class:`Declined`
is raised on every rank and the operation goes on on the CPU engine.

Each rank's partition goes into a ``pycylon.DataFrame``; the distributed call gets a
``CylonEnv`` built on a private duplicate of the table's communicator; the answer comes back
with ``to_arrow()``. Only here is pycylon imported: if it is missing,
:class:`~hetflow.errors.BackendUnavailable` carries the import error. The pycylon facts relied on
(cylondata/cylon at 03e0338): ``MPIConfig(comm)`` wraps an mpi4py communicator
(python/pycylon/pycylon/net/mpi_config.pyx) and Cylon never finalizes an MPI it did not
initialize (cpp/src/cylon/net/mpi/mpi_communicator.cpp, ``MPICommunicator::Finalize``); passing
``env=`` makes ``DataFrame.merge``/``sort_values``/``groupby``/``drop_duplicates`` distributed
(python/pycylon/pycylon/frame.py); join output is all left columns then all right columns,
prefixes applied only to colliding names (cpp/src/cylon/join/join_utils.cpp,
``build_final_table_schema``); Cylon's row comparator treats two nulls as equal and compares
values with ``==`` (cpp/src/cylon/arrow/arrow_comparator.cpp).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import BackendUnavailable, HetflowError, PartitionFailed
from hetflow.frame import _backend
from hetflow.frame._agreement import step
from hetflow.frame._arrays import unsigned_zero
from hetflow.frame._cylon_rules import AGG


class Declined(Exception):
    """Cylon could not finish an operation it was given, on every rank alike: the CPU engine
    runs it instead (the message says why, for the log)."""


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
        try:
            with step(comm, "pycylon: creating a CylonEnv"):
                from pycylon.net import MPIConfig
                self.env = self.pycylon.CylonEnv(config=MPIConfig(self.dup), distributed=True)
        except HetflowError:
            self.close()
            raise

    def run(self, op: str, fn: Callable[[], pa.Table]) -> pa.Table:
        """``fn()`` on every rank; a failure on any rank raises the same
        :class:`~hetflow.errors.PartitionFailed` on all ranks."""
        with step(self.comm, f"pycylon {op}"):
            result = fn()
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


def _zeroed(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Float keys with -0.0 made 0.0: Cylon groups and matches floats by their bits (-0.0 and
    0.0 two keys), the CPU engine as values."""
    for name in keys:
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, unsigned_zero(table.column(i)))
    return table


# -- join --------------------------------------------------------------------------------------
def join(comm, left: pa.Table, right: pa.Table, lk: List[str], rk: List[str],
         schema: pa.Schema) -> pa.Table:
    """This rank's part of an inner join on Cylon's sort join (3-4x faster than its hash join
    here); ``schema``: the CPU engine's result schema for these inputs.

    Differences converted: key columns are coalesced under the left names and colliding
    non-key names get the CPU engine's suffixes (pycylon keeps both key columns and applies its
    "suffixes" as prefixes); null keys never match (Cylon matches null with null), so rows with
    a null key are kept out of pycylon; -0.0 keys are 0.0.
    """
    L, R = _zeroed(left, lk), _zeroed(right, rk)
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
    return _conform([got.column(i) for i in range(L.num_columns)]
                    + [got.column(L.num_columns + j) for j in r_rest], schema)


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


def sort(comm, table: pa.Table, names: List[str], asc: List[bool]) -> pa.Table:
    """This rank's part of pycylon's distributed sample sort of ``table`` by ``names``.

    Like the CPU engine, rank i's rows sort before rank i+1's. Unlike it, rows with equal keys
    may come out in another order (Cylon's sort is not stable). Raises :class:`Declined` on
    every rank where Cylon's sort fails for an empty rank share.
    """
    idx = [table.schema.get_field_index(n) for n in names]
    try:
        with _Session(comm) as s:
            def work() -> pa.Table:
                df = s.pycylon.DataFrame(_renamed(table, "c"))
                return df.sort_values(by=[f"c{i}" for i in idx], ascending=list(asc),
                                      env=s.env).to_arrow()
            got = s.run("sort", work)
    except PartitionFailed as exc:   # the same error on every rank (Session.run agrees on it)
        if _EMPTY_MERGE not in str(exc):
            raise
        raise Declined("Cylon's sample sort failed where a rank's share of the rows is empty "
                       f"(many equal keys, few rows): {exc}") from exc
    return _conform([got.column(i) for i in range(got.num_columns)], table.schema)


# -- group-by / unique -------------------------------------------------------------------------
def groupby_agg(comm, table: pa.Table, by: List[str], planned: Sequence,
                schema: pa.Schema) -> pa.Table:
    """This rank's part of ``GroupBy.agg`` on pycylon's distributed hash group-by.
    ``planned``: the CPU engine's aggregations (:class:`hetflow.frame._aggregate.Planned`),
    columns grouped in order; ``schema``: the CPU engine's result schema.

    Sums and means are asked of Cylon over the column widened to 64 bits (Cylon sums in the
    column's own type, so an int32 sum past 2**31 would wrap, and a float32 mean would be
    computed at float32 precision); the CPU engine sums integers as int64 and means at
    float64 too. Float keys go with -0.0 made 0.0 (one group, as on the CPU engine)."""
    source = table.schema
    values = list(dict.fromkeys(p.column for p in planned))
    # What Cylon is asked for, per column in first-use order (its output's order): the plan's
    # functions, except the mean of an integer column, which Cylon returns truncated to an
    # integer; it is asked for that column's sum and count, and divided here.
    asks: Dict[str, List[str]] = {}
    for p in planned:
        want = asks.setdefault(p.column, [])
        for g in (("sum", "count") if p.name == "mean" and _integer_mean(source, p.column)
                  else (p.name,)):
            if g not in want:
                want.append(g)
    position = {}
    for col, funcs in asks.items():
        for g in funcs:
            position[(col, g)] = len(by) + len(position)
    # only the keys and aggregated columns go to Cylon, those summed widened to 64 bits
    sent = _zeroed(table.select(by + values), by)
    for col, funcs in asks.items():
        if "sum" in funcs or "mean" in funcs:
            i = sent.schema.get_field_index(col)
            sent = sent.set_column(i, col, sent.column(i).cast(_wide(source.field(col).type)))
    index = {n: i for i, n in enumerate(sent.schema.names)}
    agg = {f"c{index[col]}": [AGG[g] for g in funcs] for col, funcs in asks.items()}
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
        if p.name == "mean" and _integer_mean(source, p.column):
            total = got.column(position[(p.column, "sum")]).cast(pa.float64())
            count = got.column(position[(p.column, "count")]).cast(pa.float64())
            columns.append(pc.divide(total, count))     # no nulls here: count >= 1
        else:
            columns.append(got.column(position[(p.column, p.name)]))
    return _conform(columns, schema)


def _wide(t: pa.DataType) -> pa.DataType:
    """The 64-bit type a column is summed in: int64, uint64 or float64."""
    if pa.types.is_unsigned_integer(t):
        return pa.uint64()
    return pa.int64() if pa.types.is_integer(t) else pa.float64()


def _integer_mean(schema: pa.Schema, col: str) -> bool:
    return pa.types.is_integer(schema.field(col).type)


def unique(comm, table: pa.Table) -> pa.Table:
    """This rank's part of pycylon's distributed unique over all of ``table``'s columns
    (duplicates are then identical rows, and Cylon and the CPU engine keep the same rows)."""
    with _Session(comm) as s:
        def work() -> pa.Table:
            df = s.pycylon.DataFrame(_renamed(table, "c"))
            return df.drop_duplicates(subset=[f"c{i}" for i in range(table.num_columns)],
                                      env=s.env).to_arrow()
        got = s.run("unique", work)
    return _conform([got.column(i) for i in range(got.num_columns)], table.schema)
