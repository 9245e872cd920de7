"""Collective validation: every rank reaches the same verdict before any data moves.

A rank that finds a problem on its own (a missing column, a file it cannot read) and raised
at once would leave the others blocked in the next collective. Instead each operation first
allgathers a small descriptor (each partition's schema, any local error, a few facts such as
null counts), and every rank then raises the same typed error, or none.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Sequence

import numpy as np
import pyarrow as pa

from hetflow import errors
from hetflow.errors import HetflowError, InputError, KeyColumnError, SchemaMismatch
from hetflow.frame._mpi import wait_all
from hetflow.frame._phases import phase


def _describe_error(exc: Optional[BaseException]):
    if exc is None:
        return None
    return (type(exc).__name__, str(exc))


def _rebuild_error(rank: int, described, size: int) -> HetflowError:
    name, message = described
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, HetflowError)):
        cls, message = InputError, f"{name}: {message}"
    where = f" (on rank {rank} of {size})" if size > 1 else ""
    return cls(message + where)


def agree(comm, schemas: Sequence[pa.Schema], *, error: Optional[BaseException] = None,
          facts: Any = None, what: Sequence[str] = ()) -> List[Any]:
    """Allgather schemas, local errors and facts; raise the same error on every rank, or
    return every rank's ``facts`` (in rank order).

    ``what`` names each schema's table in messages (e.g. ``("left", "right")``).
    """
    with phase("check"):
        return _agree(comm, schemas, error, facts, what)


def _agree(comm, schemas, error, facts, what):
    blobs = [s.serialize().to_pybytes() for s in schemas]
    if comm.Get_size() > 1:
        agreed = _agree_quickly(comm, blobs, error, facts)
        if agreed is not None:
            return agreed
    payload = (blobs, _describe_error(error), facts)
    if comm.Get_size() > 1:
        # wait for the slowest rank asleep (a busy-wait in allgather would take the CPU it
        # needs on a full node); the allgather then finds every rank there
        wait_all([comm.Ibarrier()])
        gathered = comm.allgather(payload)
    else:
        gathered = [payload]
    size = len(gathered)
    for rank, (_, err, _) in enumerate(gathered):
        if err is not None:
            raise _rebuild_error(rank, err, size)
    for i in range(len(schemas)):
        label = what[i] if i < len(what) else "table"
        ref = pa.ipc.read_schema(pa.py_buffer(gathered[0][0][i]))
        for rank in range(1, size):
            other = pa.ipc.read_schema(pa.py_buffer(gathered[rank][0][i]))
            if not other.equals(ref, check_metadata=False):
                raise SchemaMismatch(
                    f"the {label} partitions disagree on schema: rank 0 has "
                    f"{_fmt(ref)} but rank {rank} has {_fmt(other)}; every rank's partition "
                    "must have the same column names and types (cast, or build empty "
                    "partitions from the same schema)")
    return [facts for (_, _, facts) in gathered]


def _int_facts(facts) -> bool:
    return isinstance(facts, (list, tuple)) and all(
        isinstance(f, int) and -2**63 <= f < 2**63 for f in facts)


def _agree_quickly(comm, blobs, error, facts):
    """The common case in one small non-blocking ``Allgather`` (waited for asleep): per rank a
    64-bit digest of each serialized schema, an error flag and the integer facts. When every
    rank reports no error and the same digests, that is the verdict: every rank's facts (as
    lists). Otherwise None, and every rank (each saw the same vector) takes the full exchange,
    which names the error or the difference; so does a call whose facts are not integers.
    """
    if facts is not None and not _int_facts(facts):
        return None
    nf = len(facts) if facts is not None else 0
    mine = np.empty(len(blobs) + 1 + nf, np.int64)
    for i, blob in enumerate(blobs):
        mine[i] = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little",
                                 signed=True)
    mine[len(blobs)] = error is not None
    mine[len(blobs) + 1:] = facts if nf else []
    every = np.empty((comm.Get_size(), len(mine)), np.int64)
    wait_all([comm.Iallgather(mine, every)])
    if every[:, len(blobs)].any() or (every[:, :len(blobs)] != every[0, :len(blobs)]).any():
        return None
    if facts is None:
        return [None] * len(every)
    return [[int(f) for f in row[len(blobs) + 1:]] for row in every]


def _fmt(schema: pa.Schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def key_names(value, what: str) -> List[str]:
    """Normalise a key argument (a name or a list of names) to a non-empty list of str."""
    if isinstance(value, str):
        return [value]
    if value is None:
        raise InputError(f"{what}: no key columns given")
    names = list(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise InputError(f"{what}: key columns must be a column name or a non-empty list of "
                         f"names, got {value!r}")
    return names


def check_columns(schema: pa.Schema, names: Sequence[str], what: str, side: str = "table"):
    """Raise KeyColumnError naming the first column of ``names`` missing from ``schema``."""
    for name in names:
        if schema.get_field_index(name) < 0:
            raise KeyColumnError(f"{what}: key column {name!r} is not in the {side}; its columns "
                                 f"are {schema.names}")
        if schema.names.count(name) > 1:
            raise InputError(f"{what}: column name {name!r} appears more than once in the {side}")
