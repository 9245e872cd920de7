"""A pool rank keeps the communicators of the tasks that failed on it (freeing one a peer
may still have sent on is unsafe: ``_rank.release_comm``), and each holds one of the MPI's
context ids: MPICH's ran out at about the 1,023rd failed task and the world died. The pool
replaces a world one of whose ranks keeps ``max_kept_comms``, once it is idle, losing no
queued task. (make test-openmpi runs these with Debian's Open MPI.)"""
import time

import pytest

import hetflow
from hetflow.experiments.failed_tasks import good, sends_then_raises
from hetflow.experiments.failed_tasks import raises as raises_alone
from test_pool import pool

pytestmark = pytest.mark.timeout(120)


@hetflow.mpi_app(ranks=2, returns="all")
def waits_then_raises(comm, i):
    """Rank 1 raises while rank 0 waits for it in a collective."""
    if comm.Get_rank() == 1:
        raise ValueError(f"waits_then_raises {i}")
    return comm.allreduce(1)


def failed_with(future, kind, text):
    with pytest.raises(hetflow.TaskFailed) as info:
        future.result(timeout=60)
    assert info.value.exception_type == kind and text in str(info.value), info.value


def test_a_pool_replaces_a_world_before_its_ranks_keep_too_many_communicators():
    rounds, limit = 20, 4
    with pool(max_ranks=2, max_kept_comms=limit) as executor:
        # Rank 0 waits forever: the pool stops it after the grace and restarts the world (a
        # consolidation, not a replacement for kept communicators).
        failed_with(waits_then_raises(-1), "ValueError", "waits_then_raises -1")
        assert good(-1).result(timeout=60) == [-2, -2]
        executor.remember()
        assert executor.recycled == 0
        kept = []
        for i in range(rounds):
            failed_with(sends_then_raises(i), "ValueError", f"failed {i}")
            failed_with(raises_alone(i), "KeyError", f"failed {i}")
            assert good(i).result(timeout=60) == [2 * i, 2 * i]
            executor.remember()
            kept.append(max((s.kept_comms for s in executor._slots.values() if s.alive), default=0))
        # Per round, each rank of the 2-rank task keeps 2 (the task's communicator and its user
        # duplicate: its generation ended); a 1-rank task's is freed at once. The ranks
        # reach 4 every second round: the world is replaced, 10 times in 20 rounds.
        deadline = time.monotonic() + 30
        while executor.recycled < rounds // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert executor.recycled == rounds // 2, executor.events
        assert max(kept) <= limit, kept
        # Tasks queued at once while worlds are replaced: none lost, none failed wrongly.
        futures = [(sends_then_raises(i) if i % 3 == 0 else good(i)) for i in range(24)]
        for i, future in enumerate(futures):
            if i % 3 == 0:
                failed_with(future, "ValueError", f"failed {i}")
            else:
                assert future.result(timeout=60) == [2 * i, 2 * i]
        executor.remember()
        assert executor.recycled > rounds // 2, executor.events
