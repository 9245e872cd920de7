"""Reading and writing distributed tables: each rank reads or writes its own share."""
from __future__ import annotations

import glob
import os
from typing import List, Sequence, Tuple, Union

import pyarrow as pa

from hetflow.errors import InputError, SchemaMismatch
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
    import pyarrow.parquet as pq   # here, not at import: it loads libparquet (like read_csv's csv)

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


_UNSPLITTABLE = (".gz", ".bz2", ".zst", ".xz", ".lz4")


def read_csv(comm, paths, **csv_options) -> DistributedTable:
    """Read CSV files, each rank taking an equal share of their bytes: files are split at line
    boundaries, each piece parsed with its file's header line, so one large file is spread
    over the ranks as evenly as many small ones.

    Compressed files (``.gz`` and the like) cannot be split and are shared out whole, as are
    all files when ``read_options`` is given (it may skip rows or name the columns, and the
    header line cannot then be found). Byte splitting assumes no newline inside a quoted field:
    for such data pass ``split="files"``. Column types are inferred per piece and then promoted
    to a common type across ranks (int64 with double gives double); types with no common
    promotion raise :class:`~hetflow.errors.SchemaMismatch` on every rank (pass
    ``convert_options`` to fix them).
    """
    import pyarrow.csv as pcsv

    split = csv_options.pop("split", "bytes")
    if split not in ("bytes", "files"):
        raise InputError(f"read_csv: split must be 'bytes' or 'files', got {split!r}")
    rank, size = comm.Get_rank(), comm.Get_size()
    error, table = None, None
    try:
        files = _expand(paths, (".csv", ".csv.gz", ".tsv"))
        by_bytes = (split == "bytes" and "read_options" not in csv_options
                    and not any(f.endswith(_UNSPLITTABLE) for f in files))
        if by_bytes:
            sources = [pa.BufferReader(piece) for piece in _csv_pieces(files, rank, size)]
        else:
            lo, hi = (rank * len(files)) // size, ((rank + 1) * len(files)) // size
            sources = files[lo:hi]
        parts = [pcsv.read_csv(src, **csv_options) for src in sources]
        table = _concat_permissive(parts) if parts else None
        if table is not None and len(parts) > 1:
            table = table.combine_chunks()
    except pa.ArrowInvalid as exc:
        error = InputError(f"read_csv: {exc}")
    except (OSError, pa.ArrowException) as exc:
        error = InputError(f"read_csv: {type(exc).__name__}: {exc}")
    except InputError as exc:
        error = exc
    # Promote every rank's inferred types to common ones; ranks with no rows take them too.
    schemas = comm.allgather(None if table is None else table.schema.serialize().to_pybytes())
    if error is None:
        known = [pa.ipc.read_schema(pa.py_buffer(b)) for b in schemas if b is not None]
        try:
            common = _unify_permissive(known) if known else pa.schema([])
            table = common.empty_table() if table is None else table.cast(common)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            error = SchemaMismatch(f"read_csv: the pieces' inferred column types cannot be "
                                   f"promoted to common types ({exc}); pass "
                                   "convert_options=pyarrow.csv.ConvertOptions(column_types=...)")
    _check.agree(comm, [table.schema if table is not None and error is None
                        else pa.schema([])], error=error)
    return DistributedTable(comm, table)


def _csv_pieces(files: Sequence[str], rank: int, size: int) -> List[bytes]:
    """This rank's share of the files' data bytes (header lines excluded), cut at line ends:
    the data of all files is one byte range split equally, and a line belongs to the rank whose
    share holds the line's first byte. Each piece comes with its file's header line in front."""
    spans = []  # (file, header bytes, data start, data end)
    for f in files:
        with open(f, "rb") as fh:
            header = fh.readline()
        spans.append((f, header, len(header), os.path.getsize(f)))
    total = sum(end - start for _, _, start, end in spans)
    lo, hi = (rank * total) // size, ((rank + 1) * total) // size
    pieces, offset = [], 0
    for f, header, start, end in spans:
        a, b = max(lo - offset, 0) + start, min(hi - offset, end - start) + start
        offset += end - start
        if a >= b:
            continue
        with open(f, "rb") as fh:
            first = start if a == start else _line_end(fh, a - 1)
            last = end if b == end else _line_end(fh, b - 1)
            if first < last:
                fh.seek(first)
                pieces.append(header + fh.read(last - first))
    return pieces


def _line_end(fh, pos: int) -> int:
    """Offset just past the first newline at or after ``pos`` (the file's size if none)."""
    fh.seek(pos)
    consumed = pos
    while True:
        block = fh.read(1 << 16)
        if not block:
            return consumed
        i = block.find(b"\n")
        if i >= 0:
            return consumed + i + 1
        consumed += len(block)


def to_parquet(table: DistributedTable, directory: PathLike, *, compression: str = "snappy"
               ) -> str:
    """Write each rank's partition to ``directory/part-RRRRR.parquet`` (collective); returns the
    directory. Empty partitions are written too, so the schema survives a round trip; part
    files left in the directory by an earlier write are removed first."""
    import pyarrow.parquet as pq

    comm = table.comm
    directory = os.fspath(directory)
    error = None
    try:
        if comm.Get_rank() == 0:
            # Part files of an earlier write with more ranks would be read back as data.
            os.makedirs(directory, exist_ok=True)
            for stale in glob.glob(os.path.join(glob.escape(directory), "part-*.parquet")):
                os.remove(stale)
    except OSError as exc:
        error = InputError(f"to_parquet: cannot prepare {directory!r}: {type(exc).__name__}: "
                           f"{exc}")
    _check.agree(comm, [], error=error)  # every rank waits for the directory to be ready
    try:
        path = os.path.join(directory, f"part-{comm.Get_rank():05d}.parquet")
        pq.write_table(table.local, path, compression=compression)
    except (OSError, pa.ArrowException) as exc:
        error = InputError(f"to_parquet: cannot write {directory!r}: {type(exc).__name__}: {exc}")
    _check.agree(comm, [table.local.schema], error=error)
    return directory


def _concat_permissive(parts):
    """``concat_tables`` promoting types (int32 + int64, int64 + double, null + anything)."""
    try:
        return pa.concat_tables(parts, promote_options="permissive")
    except TypeError:  # pyarrow < 14 (pycylon's environments pin pyarrow 9-10)
        names = parts[0].schema.names
        if all(p.schema.names == names for p in parts):
            common = _unify_permissive([p.schema for p in parts])
            parts = [p if p.schema == common else p.cast(common) for p in parts]
        return pa.concat_tables(parts, promote=True)


def _unify_permissive(schemas):
    """``unify_schemas`` with permissive promotion. pyarrow < 14 cannot promote: there
    null fields take the other's type, integer fields the widest integer type (int64 when
    signed and unsigned meet), integer and floating fields float64 (the promotions CSV
    type inference needs); other differing types raise ArrowTypeError (the caller's
    SchemaMismatch)."""
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except TypeError:  # pyarrow < 14
        pass
    types = {}
    for schema in schemas:
        for field in schema:
            types.setdefault(field.name, []).append(field.type)
    fields = []
    for name, seen in types.items():
        kinds = list(dict.fromkeys(t for t in seen if not pa.types.is_null(t)))
        if len(kinds) <= 1:
            fields.append(pa.field(name, kinds[0] if kinds else pa.null()))
        elif all(pa.types.is_integer(t) for t in kinds):
            signed = {pa.types.is_signed_integer(t) for t in kinds}
            widest = max(kinds, key=lambda t: t.bit_width)
            fields.append(pa.field(name, widest if len(signed) == 1 else pa.int64()))
        elif all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in kinds):
            fields.append(pa.field(name, pa.float64()))
        else:
            raise pa.ArrowTypeError(f"Unable to merge: Field {name} has incompatible types: "
                                    f"{' vs '.join(map(str, kinds))}")
    return pa.schema(fields)
