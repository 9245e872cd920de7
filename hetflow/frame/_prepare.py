"""What every collective operation does before its data moves, done once.

An operation names its input tables, their key columns and the facts each rank must share
(``{"small": 1, "rows": 812, "key_nulls": [0, 3]}``); :func:`prepare` then

1. checks the tables and agrees collectively (:func:`hetflow.frame._check.agree`): the ranks'
   schemas, any local error, and the facts, so every rank raises the same typed error or none;
2. checks the key columns exist, then any check of the operation's own (``check``);
3. chooses the backend once: where pycylon was asked for by name, the operation's
   :class:`~hetflow.frame._cylon_rules.Route` (``cylon``) decides, from counts summed over
   the ranks, whether pycylon runs it (the operation then calls :mod:`hetflow.frame._pycylon`),
   the CPU engine does (and the log says why), or it is refused (``NotSupported``); else
   ``cpu`` or ``cupy``, with the allocator padded for the input's size.

The facts come back by name on :class:`Agreed` (``agreed.total("rows")``,
``agreed.every("small")``), never by position.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa

from hetflow.errors import InputError
from hetflow.frame import _backend, _check
from hetflow.frame._agreement import step
from hetflow.frame._cylon_rules import Route
from hetflow.frame._mpi import MPI, wait_all
from hetflow.frame._table import DistributedTable

log = logging.getLogger("hetflow.frame")

Fact = Union[int, Sequence[int]]

#: Below this many bytes of partitions on a rank, an operation moves all their columns in one
#: exchange (a few MiB moves in well under a millisecond; each extra wait for the peers costs
#: more on a busy node); above it, columns move one at a time so a rank holds about one
#: column in flight beside its input and output (the memory bound of large partitions).
BATCH_BYTES = 8 << 20


def small(*tables: pa.Table) -> bool:
    """Whether this rank's ``tables`` are small enough to exchange in one go (see
    :data:`BATCH_BYTES`), and their column names unique (columns are then looked up by name).
    An operation moves its columns in one go only when this holds on every rank (its
    collective check gathers each rank's answer): the two ways make different collectives,
    and ranks whose partitions lie on both sides of the bound would mismatch them."""
    return (sum(t.nbytes for t in tables) <= BATCH_BYTES and
            all(len(set(t.schema.names)) == t.num_columns for t in tables))


def require_table(value, what: str) -> DistributedTable:
    """``value`` if it is a DistributedTable, else an InputError naming ``what``."""
    if not isinstance(value, DistributedTable):
        raise InputError(f"{what} must be a hetflow.frame.DistributedTable, got "
                         f"{type(value).__name__}")
    return value


class Agreed:
    """Every rank's facts, by name: ``per_rank(name)`` (a list in rank order), ``total(name)``
    (summed over the ranks; element by element for a list fact), ``every(name)``/``any(name)``
    (whether the fact holds on every / some rank)."""

    __slots__ = ("_ranks",)

    def __init__(self, ranks: List[Dict[str, Fact]]):
        self._ranks = ranks

    def per_rank(self, name: str) -> list:
        return [r[name] for r in self._ranks]

    def total(self, name: str):
        values = self.per_rank(name)
        if values and isinstance(values[0], list):
            return [sum(column) for column in zip(*values)]
        return sum(values)

    def every(self, name: str) -> bool:
        return all(self.per_rank(name))

    def any(self, name: str) -> bool:
        return any(any(v) if isinstance(v, list) else v for v in self.per_rank(name))


def _flatten(facts: Dict[str, Fact]) -> Tuple[List[int], List[Tuple[str, Optional[int]]]]:
    """The facts as one list of ints (what the quick check carries) and its layout: per name,
    None for an int, else the list's length. The layout depends only on what every rank
    passes alike (key names, rank count), so one rank's layout reads every rank's list."""
    flat, layout = [], []
    for name, value in facts.items():
        if isinstance(value, (list, tuple)):
            flat += [int(v) for v in value]
            layout.append((name, len(value)))
        else:
            flat.append(int(value))
            layout.append((name, None))
    return flat, layout


def _unflatten(flat: Sequence[int], layout) -> Dict[str, Fact]:
    out, i = {}, 0
    for name, length in layout:
        if length is None:
            out[name], i = int(flat[i]), i + 1
        else:
            out[name], i = [int(v) for v in flat[i:i + length]], i + length
    return out


@dataclass(frozen=True)
class Prepared:
    """The outcome of :func:`prepare`: ``backend`` is ``"cpu"``, ``"cupy"`` or ``"pycylon"``
    (asked for by name: the operation hands over to :mod:`hetflow.frame._pycylon`)."""

    comm: object
    backend: str
    agreed: Agreed

    @property
    def pycylon(self) -> bool:
        return self.backend == "pycylon"

    def without_pycylon(self, op: str, why: str) -> "Prepared":
        """This preparation on the CPU engine where pycylon was chosen but could not finish
        (every rank agreed on that); the log says why."""
        if not self.pycylon:
            return self
        _on_cpu(op, why)
        return Prepared(self.comm, _backend.resolve("cpu"), self.agreed)

    def result(self, table: pa.Table, backend: Optional[str] = None) -> DistributedTable:
        """``table`` as this operation's output; its backend is the chosen one (``backend``
        overrides), "cpu" on one rank where nothing ran on another path."""
        if backend is None:
            backend = self.backend if self.comm.Get_size() > 1 else "cpu"
        return DistributedTable(self.comm, table, backend=backend)


def _on_cpu(op: str, why: str) -> None:
    log.warning("hetflow.frame: %s ran on the CPU engine, not pycylon: %s", op, why)


def prepare(op: str, tables: Sequence[DistributedTable], keys: Sequence[Sequence[str]] = (), *,
            what: Sequence[str] = (), facts: Optional[Dict[str, Fact]] = None,
            check: Optional[Callable[[], None]] = None, backend: Optional[str] = None,
            cylon: Optional[Callable[[], Route]] = None) -> Prepared:
    """Agree on ``tables``' schemas and ``facts`` (collective), check that ``keys[i]`` are
    columns of ``tables[i]`` and run ``check``, then choose the backend (see the module's
    docstring). ``what`` names the tables in messages (``("left", "right")``); ``cylon``
    builds the operation's pycylon route (only where pycylon was asked for; an operation
    without one runs on the CPU engine, silently: it chooses no backend)."""
    comm = tables[0].comm
    schemas = [t.local.schema for t in tables]
    flat, layout = _flatten(facts or {})
    gathered = _check.agree(comm, schemas, facts=flat if facts is not None else None, what=what)
    for i, names in enumerate(keys):
        side = f"{what[i]} table" if i < len(what) else "table"
        _check.check_columns(schemas[i], names, op, side)
    if check is not None:
        check()
    agreed = Agreed([_unflatten(f, layout) for f in gathered] if facts is not None else [])
    if _backend.requested_name(backend) == "pycylon":
        if cylon is not None:
            decision = _route(comm, op, cylon())
            if decision is None:
                return Prepared(comm, "pycylon", agreed)
            _on_cpu(*decision)
        backend = "cpu"
    chosen = _backend.resolve(backend)
    _backend.heap_pad_for(sum(t.local.nbytes for t in tables))
    return Prepared(comm, chosen, agreed)


def _route(comm, op: str, route: Route):
    """``route``'s decision from its counts summed over the ranks (collective: the counts of
    every rank are as many, the schemas and keys being agreed)."""
    with step(comm, f"{op}: counting what pycylon's routing needs"):
        mine = np.asarray(route.count(), np.int64)
    totals = mine.copy()
    if comm.Get_size() > 1 and len(mine):
        wait_all([comm.Iallreduce(mine, totals, op=MPI.SUM)])
    return route.decide(totals)
