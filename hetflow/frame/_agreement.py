"""A rank's own work after data has moved: it fails on every rank, or on none.

Before data moves, :func:`hetflow.frame._check.agree` makes every rank raise the same error or
none. After an exchange each rank works on the rows it received (a local join, the merge of a
sort, an aggregation's finishing step), and an error there is raised on that rank alone: the
other ranks go on to their next collective (the caller's next operation, a gather) and wait in
it for a rank that has left. :func:`step` runs such work and agrees on its outcome with one
small allreduce (waited for asleep): where any rank failed, every rank raises
:class:`~hetflow.errors.PartitionFailed`, naming the ranks and their errors::

    shuffled = shuffle_local(comm, table, keys, backend)      # data moves
    with step(comm, "groupby: finishing the groups"):
        out = finish(shuffled)                                 # this rank's rows only

The block must make no collective call (a rank that failed before it would not be there),
or make every one of them on every rank even after its own work failed: the streamed join's
output (:func:`hetflow.frame._localjoin.assemble`) fetches each payload column by a collective
exchange, and a rank whose column failed goes on fetching and dropping the rest.
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import numpy as np

from hetflow.errors import PartitionFailed
from hetflow.frame._mpi import MPI, wait_all
from hetflow.frame._phases import phase

#: Ranks whose errors a message quotes in full (all of them are on the error's attributes).
_QUOTED = 4


@contextmanager
def step(comm, what: str) -> Iterator[None]:
    """Run the block on every rank of ``comm``, then agree: if it raised on any rank, raise
    :class:`~hetflow.errors.PartitionFailed` on every rank (collective, one allreduce when
    every rank succeeds). ``what`` names the step in the message."""
    error: Optional[BaseException] = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every rank raises it below
        error = exc
    settle(comm, what, error)


def settle(comm, what: str, error: Optional[BaseException]) -> None:
    """Agree on this rank's ``error`` (None: it succeeded) with every rank of ``comm``; raise
    the same :class:`~hetflow.errors.PartitionFailed` on every rank if any rank has one."""
    size = comm.Get_size()
    if size > 1:
        with phase("check"):
            failed = np.array([error is not None], np.int64)
            total = np.empty(1, np.int64)
            wait_all([comm.Iallreduce(failed, total, op=MPI.SUM)])
            if not total[0]:
                return
            every = comm.allgather(_described(error))     # only on failure: who, and what
    elif error is None:
        return
    else:
        every = [_described(error)]
    raise _partition_failed(what, every, size) from error


def _described(error: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    if error is None:
        return None
    text = f"{type(error).__name__}: {error}"
    return text, "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _partition_failed(what: str, every, size: int) -> PartitionFailed:
    failed = {rank: d for rank, d in enumerate(every) if d is not None}
    ranks = sorted(failed)
    where = (f"rank {ranks[0]}" if len(ranks) == 1 else
             "ranks " + ", ".join(map(str, ranks))) + f" of {size}"
    quoted = "; ".join(f"rank {r}: {failed[r][0]}" for r in ranks[:_QUOTED])
    more = f"; and {len(ranks) - _QUOTED} more" if len(ranks) > _QUOTED else ""
    return PartitionFailed(
        f"{what} failed on {where} after the data moved ({quoted}{more}); every rank of the "
        "operation raises this error", operation=what, ranks=ranks,
        errors={r: failed[r][0] for r in ranks},
        remote_tracebacks={r: failed[r][1] for r in ranks})
