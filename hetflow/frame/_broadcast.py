"""Broadcast join: a small right side is sent whole to every rank, the left side stays put.

A shuffle moves about (P-1)/P of both sides; a broadcast moves (P-1) copies of the right side
and nothing of the left. When the right side is small (Spark's broadcast hash join, Dask's
broadcast merge) that is far less traffic, and the left side, usually the big one, is neither
hashed nor routed nor copied. Every rank decides from the same sizes (the join's collective
check gathers each rank's), so all take the same path.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import pyarrow as pa

from hetflow.frame import _ipc, _localjoin
from hetflow.frame._agreement import step
from hetflow.frame._phases import phase

#: The most bytes of right side (all ranks' partitions together) sent to every rank: each rank
#: holds a copy beside its partitions.
BROADCAST_BYTES = 64 << 20
#: Joins where every left row lives on exactly one rank and the right side's rows are only
#: looked up: replicating the right side changes no result row.
BROADCAST_HOW = ("inner", "left", "semi", "anti")


def chosen(how: str, left_bytes: Sequence[int], right_bytes: Sequence[int]) -> bool:
    """Whether to broadcast the right side, from every rank's partition sizes (the same answer
    on every rank): it fits :data:`BROADCAST_BYTES`, and its copies to the other ranks are
    fewer bytes than the left side holds (what a shuffle would route)."""
    ranks = len(right_bytes)
    right, left = sum(right_bytes), sum(left_bytes)
    return (ranks > 1 and how in BROADCAST_HOW and right <= BROADCAST_BYTES
            and right * (ranks - 1) < left)


def join(comm, left: pa.Table, right: pa.Table, lk: Sequence[str], rk: Sequence[str], how: str,
         suffixes: Tuple[str, str]) -> pa.Table:
    """This rank's rows of the join of its ``left`` with every rank's ``right`` (collective)."""
    with phase("exchange"):
        whole = _ipc.allgather(comm, right)
    with step(comm, "join: the local join with the broadcast side"), phase("local"):
        out = _localjoin.join(left, whole, lk, rk, how, suffixes)
    return out
