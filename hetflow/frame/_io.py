"""Reading and writing distributed tables: each rank reads or writes its own share."""
from __future__ import annotations

import glob
import os
from typing import List, Sequence, Tuple, Union

import pyarrow as pa
import pyarrow.parquet as pq

from hetflow.errors import InputError
from hetflow.frame import _check
from hetflow.frame._table import DistributedTable

PathLike = Union[str, os.PathLike]


def _expand(paths, suffixes: Tuple[str, ...]) -> List[str]:
    """A directory (its files with ``suffixes``, sorted), a glob, a path, or a list of those."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: List[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p)
                           if f.endswith(suffixes) and not f.startswith((".", "_")))
            if not found:
                raise InputError(f"no {'/'.join(suffixes)} files in directory {p!r}")
            out += found
        elif any(ch in p for ch in "*?["):
            found = sorted(glob.glob(p))
            if not found:
                raise InputError(f"no files match {p!r}")
            out += found
        elif os.path.exists(p):
            out.append(p)
        else:
            raise InputError(f"no such file or directory: {p!r}")
    if not out:
        raise InputError("no input files given")
    return out


def read_parquet(comm, paths, *, columns=None) -> DistributedTable:
    """Read Parquet files, each rank taking a contiguous share of the row groups (balanced by
    row count), so one large file is split over ranks as well as many small ones."""
    rank, size = comm.Get_rank(), comm.Get_size()
    error, table, schema = None, None, None
    try:
        files = _expand(paths, (".parquet", ".pq"))
        pieces = []  # (file index, row group, rows), in file order
        schema = None
        for i, f in enumerate(files):
            try:
                meta = pq.ParquetFile(f)
            except (OSError, pa.ArrowException) as exc:
                raise InputError(f"read_parquet: cannot read {f!r}: "
                                 f"{type(exc).__name__}: {exc}") from None
            file_schema = meta.schema_arrow
            if schema is None:
                schema = file_schema
            elif not file_schema.equals(schema, check_metadata=False):
                raise InputError(f"Parquet file {f!r} has schema {file_schema} but "
                                 f"{files[0]!r} has {schema}")
            pieces += [(i, g, meta.metadata.row_group(g).num_rows)
                       for g in range(meta.num_row_groups)]
        total = sum(p[2] for p in pieces)
        mine, start = {}, 0
        for i, g, rows in pieces:
            # a piece belongs to the rank whose equal share holds its first row
            owner = min(size - 1, (start * size) // total) if total else 0
            if owner == rank:
                mine.setdefault(i, []).append(g)
            start += rows
        parts = [pq.ParquetFile(files[i]).read_row_groups(gs, columns=columns)
                 for i, gs in sorted(mine.items())]
        if columns is not None:
            schema = pa.schema([schema.field(c) for c in columns])
        parts = [p.cast(schema) if not p.schema.equals(schema) else p for p in parts]
        table = pa.concat_tables(parts) if parts else schema.empty_table()
    except (OSError, pa.ArrowException, KeyError) as exc:
        error = InputError(f"read_parquet: {type(exc).__name__}: {exc}")
    except InputError as exc:
        error = exc
    _check.agree(comm, [table.schema if table is not None else pa.schema([])], error=error)
    return DistributedTable(comm, table)


def read_csv(comm, paths, **csv_options) -> DistributedTable:
    """Read CSV files, each rank taking a contiguous share of the files (a single file is read
    by rank 0 alone; use Parquet row groups or several files to spread one dataset).

    Column types are inferred per file; files whose inferred types differ raise
    :class:`~hetflow.errors.SchemaMismatch` on every rank (pass ``convert_options`` to fix them).
    The other ranks' empty partitions take the schema of the files read.
    """
    import pyarrow.csv as pcsv

    rank, size = comm.Get_rank(), comm.Get_size()
    error, table = None, None
    try:
        files = _expand(paths, (".csv", ".csv.gz", ".tsv"))
        lo, hi = (rank * len(files)) // size, ((rank + 1) * len(files)) // size
        parts = [pcsv.read_csv(f, **csv_options) for f in files[lo:hi]]
        table = pa.concat_tables(parts) if parts else None
        if table is not None and len(parts) > 1:
            table = table.combine_chunks()
    except pa.ArrowInvalid as exc:
        error = InputError(f"read_csv: {exc}")
    except (OSError, pa.ArrowException) as exc:
        error = InputError(f"read_csv: {type(exc).__name__}: {exc}")
    except InputError as exc:
        error = exc
    # Ranks without a file borrow the schema of the lowest rank that read one.
    schemas = comm.allgather(None if table is None else table.schema.serialize().to_pybytes())
    if table is None and error is None:
        first = next((s for s in schemas if s is not None), None)
        schema = pa.ipc.read_schema(pa.py_buffer(first)) if first else pa.schema([])
        table = schema.empty_table()
    _check.agree(comm, [table.schema if table is not None else pa.schema([])], error=error)
    return DistributedTable(comm, table)


def to_parquet(table: DistributedTable, directory: PathLike, *, compression: str = "snappy"
               ) -> str:
    """Write each rank's partition to ``directory/part-RRRRR.parquet`` (collective); returns the
    directory. Empty partitions are written too, so the schema survives a round trip."""
    comm = table.comm
    directory = os.fspath(directory)
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"part-{comm.Get_rank():05d}.parquet")
        pq.write_table(table.local, path, compression=compression)
    except (OSError, pa.ArrowException) as exc:
        error = InputError(f"to_parquet: cannot write {directory!r}: {type(exc).__name__}: {exc}")
    _check.agree(comm, [table.local.schema], error=error)
    return directory
