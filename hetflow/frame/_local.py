"""Row-wise operations on each rank's partition: filter, select, drop, rename, add computed
columns, cast, fill nulls; and conversions to and from pandas and polars.

No rows move, but each operation is still collective: a bad argument or a value that fails on
one rank only (a cast that overflows there) must fail every rank, or the others would wait in
their next collective. Each rank runs the operation on its partition, then one small allgather
(:func:`hetflow.frame._check.agree`) carries every rank's error, input schema and result
schema: every rank raises the same typed error, or none, and the results agree on their schema.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.compute as pc

from hetflow.errors import ConfigError, HetflowError, InputError, KeyColumnError, NotSupported
from hetflow.frame import _check, _engine
from hetflow.frame._prepare import require_table
from hetflow.frame._table import DistributedTable

Computed = Union[pc.Expression, Callable[[pa.Table], Any], Any]


def _typed(op: str, exc: BaseException, schema: pa.Schema) -> HetflowError:
    """A pyarrow or Python error of an operation as the engine's typed error."""
    if isinstance(exc, HetflowError):
        return exc
    text = str(exc).strip("'\"")
    if isinstance(exc, KeyError) or "No match for FieldRef" in text:
        return KeyColumnError(f"{op}: a column named is not in the table "
                              f"({text.splitlines()[0]}); its columns are {schema.names}")
    if isinstance(exc, pa.ArrowNotImplementedError):
        return NotSupported(f"{op}: {text}")
    return InputError(f"{op}: {type(exc).__name__}: {text}")


def _run(op: str, table: DistributedTable, fn: Callable[[pa.Table], pa.Table]
         ) -> DistributedTable:
    """``fn`` on this rank's partition, then the collective verdict (see the module)."""
    table = require_table(table, f"{op}: table")
    out, error = None, None
    try:
        out = fn(table.local)
    except Exception as exc:  # noqa: BLE001 - a user function may raise anything
        error = _typed(op, exc, table.local.schema)
    schemas = [table.local.schema, out.schema if out is not None else table.local.schema]
    _check.agree(table.comm, schemas, error=error, what=("input", f"{op} result"))
    return DistributedTable(table.comm, out, backend="cpu")


def _columns_of(schema: pa.Schema, names: Sequence[str], op: str) -> None:
    for name in names:
        if schema.get_field_index(name) < 0:
            raise KeyColumnError(f"{op}: column {name!r} is not in the table; its columns are "
                                 f"{schema.names}")


def _names(value, op: str):
    names = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{op}: columns must be names, got {value!r}")
    return names


def _evaluate(local: pa.Table, exprs: Sequence[pc.Expression], names: Sequence[str]) -> pa.Table:
    """Project ``exprs`` over ``local`` in its row order (one thread: a threaded plan need
    not keep it)."""
    try:
        from pyarrow import acero
    except ImportError:  # pyarrow < 12 (pycylon's environments): the dataset scanner
        import pyarrow.dataset as ds
        return ds.dataset(local).to_table(columns=dict(zip(names, exprs)), use_threads=False)
    plan = acero.Declaration.from_sequence([
        acero.Declaration("table_source", acero.TableSourceNodeOptions(local)),
        acero.Declaration("project", acero.ProjectNodeOptions(list(exprs), list(names)))])
    return plan.to_table(use_threads=False)


# -- the operations --------------------------------------------------------------------------
def filter_rows(table: DistributedTable, predicate: pc.Expression) -> DistributedTable:
    """The rows where ``predicate`` (a ``pyarrow.compute`` expression, e.g.
    ``pc.field("v") > 0``) is true; rows where it is null are dropped, as in polars."""
    if not isinstance(predicate, pc.Expression):
        raise ConfigError(f"filter: the predicate must be a pyarrow.compute.Expression (e.g. "
                          f"pc.field('v') > 0), got {type(predicate).__name__}")

    def run(local):
        mask = _evaluate(local, [predicate], ["mask"]).column(0)
        if not pa.types.is_boolean(mask.type):
            raise InputError(f"filter: the predicate gives {mask.type} values, not booleans")
        return local.filter(mask)
    return _run("filter", table, run)


def select(table: DistributedTable, columns) -> DistributedTable:
    """Only the ``columns`` named, in that order."""
    return _keep_columns("select", table, columns, lambda names, present: names)


def drop(table: DistributedTable, columns) -> DistributedTable:
    """Every column but those named."""
    return _keep_columns("drop", table, columns,
                         lambda names, present: [n for n in present if n not in names])


def _keep_columns(op: str, table: DistributedTable, columns, kept) -> DistributedTable:
    """The columns ``kept(names, local.column_names)``, once every name is checked."""
    names = _names(columns, op)

    def run(local):
        _columns_of(local.schema, names, op)
        return local.select(kept(names, local.column_names))
    return _run(op, table, run)


def rename(table: DistributedTable, mapping: Mapping[str, str]) -> DistributedTable:
    """Columns renamed by ``{old: new}``; the others keep their names."""
    if not isinstance(mapping, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ConfigError(f"rename: expected a dict of old name -> new name, got {mapping!r}")

    def run(local):
        _columns_of(local.schema, list(mapping), "rename")
        names = [mapping.get(n, n) for n in local.column_names]
        if len(set(names)) != len(names):
            raise InputError(f"rename: the new names repeat a column name: {names}")
        return local.rename_columns(names)
    return _run("rename", table, run)


def with_columns(table: DistributedTable, columns: Optional[Mapping[str, Computed]] = None,
                 **named: Computed) -> DistributedTable:
    """Columns added or replaced (in place, as polars' ``with_columns``), each given as a
    ``pyarrow.compute`` expression (``pc.field("a") * 2``), a function of this rank's
    partition returning an array, or a scalar repeated on every row."""
    spec: Dict[str, Computed] = dict(columns or {})
    spec.update(named)
    if not spec or not all(isinstance(k, str) for k in spec):
        raise ConfigError(f"with_columns: expected column names with their values, got {spec!r}")

    def run(local):
        exprs = {}
        for name, value in spec.items():
            if isinstance(value, pc.Expression):
                exprs[name] = value
            elif callable(value):
                got = value(local)
                if isinstance(got, pa.ChunkedArray):
                    got = got.combine_chunks()
                got = pa.array(got) if not isinstance(got, pa.Array) else got
                if len(got) != local.num_rows:
                    raise InputError(f"with_columns: {name!r} gave {len(got)} values for "
                                     f"{local.num_rows} rows")
                temporary = f"__hetflow_new_{len(exprs)}"
                local = local.append_column(temporary, got)
                exprs[name] = pc.field(temporary)
            else:
                exprs[name] = pc.scalar(value)
        keep = [n for n in local.column_names if not n.startswith("__hetflow_new_")]
        out_names = keep + [n for n in spec if n not in keep]
        out_exprs = [exprs.get(n, pc.field(n)) for n in out_names]
        return _evaluate(local, out_exprs, out_names)
    return _run("with_columns", table, run)


def cast(table: DistributedTable, dtypes: Union[Mapping[str, pa.DataType], pa.Schema], *,
         safe: bool = True) -> DistributedTable:
    """Columns cast to new types: ``{name: pyarrow type}`` or a whole schema. ``safe`` (the
    default) fails on overflow or truncation, on every rank when any rank's values fail."""
    if isinstance(dtypes, pa.Schema):
        dtypes = {f.name: f.type for f in dtypes}
    if not isinstance(dtypes, Mapping) or not all(
            isinstance(t, pa.DataType) for t in dtypes.values()):
        raise ConfigError(f"cast: expected a dict of column -> pyarrow type or a schema, got "
                          f"{dtypes!r}")

    def run(local):
        _columns_of(local.schema, list(dtypes), "cast")
        for name, t in dtypes.items():
            i = local.schema.get_field_index(name)
            local = local.set_column(i, name, pc.cast(local.column(i), t, safe=safe))
        return local
    return _run("cast", table, run)


def fill_null(table: DistributedTable, value: Any = None, *,
              columns: Optional[Mapping[str, Any]] = None) -> DistributedTable:
    """Nulls replaced: by ``value`` in every column whose type it fits (a number fills
    numeric columns, a float turning integer ones into float64; a string fills string
    columns, a bool boolean ones: as polars does), or by ``columns={name: value}`` in the
    columns named (the value cast to the column's type)."""
    if (value is None) == (columns is None):
        raise ConfigError("fill_null: give either a value or columns={name: value}")
    if columns is not None and not isinstance(columns, Mapping):
        raise ConfigError(f"fill_null: columns must be a dict of name -> value, got {columns!r}")

    def fits(t: pa.DataType) -> bool:
        if isinstance(value, bool):
            return pa.types.is_boolean(t)
        if isinstance(value, (int, float)):
            return pa.types.is_integer(t) or pa.types.is_floating(t)
        if isinstance(value, str):
            return pa.types.is_string(t) or pa.types.is_large_string(t)
        return False

    def run(local):
        if columns is not None:
            _columns_of(local.schema, list(columns), "fill_null")
            todo = dict(columns)
        else:
            todo = {f.name: value for f in local.schema if fits(f.type)}
        for name, fill in todo.items():
            i = local.schema.get_field_index(name)
            col = local.column(i)
            if columns is None and isinstance(value, float) and pa.types.is_integer(col.type):
                col = col.cast(pa.float64())  # polars' supertype of an integer and a float
            local = local.set_column(i, name, pc.fill_null(col, pa.scalar(fill).cast(col.type)))
        return local
    return _run("fill_null", table, run)


# -- conversions -----------------------------------------------------------------------------
def to_pandas(table: DistributedTable, root: int = 0, **options):
    """The gathered table as a ``pandas.DataFrame`` on ``root`` (None elsewhere); ``options``
    go to ``pyarrow.Table.to_pandas``. Collective."""
    whole = require_table(table, "to_pandas: table").gather(root)
    return whole.to_pandas(**options) if whole is not None else None


def to_polars(table: DistributedTable, root: int = 0):
    """The gathered table as a ``polars.DataFrame`` on ``root`` (None elsewhere). Collective."""
    whole = require_table(table, "to_polars: table").gather(root)
    if whole is None:
        return None
    # through the engine's import: polars' threads and allocator set as its kernels' are
    return _engine.polars().from_arrow(whole)


def from_pandas(comm, df, *, schema: Optional[pa.Schema] = None,
                preserve_index: bool = False) -> DistributedTable:
    """This rank's ``pandas.DataFrame`` as its partition (local, like :func:`from_local`).
    Pass ``schema`` where a rank's frame is empty or its columns' types are ambiguous
    (pandas' object columns): types are inferred from each rank's values alone, and ranks
    that infer differently fail the next operation's check with ``SchemaMismatch``."""
    local = pa.Table.from_pandas(df, schema=schema, preserve_index=preserve_index)
    return DistributedTable(comm, local.replace_schema_metadata(None))
