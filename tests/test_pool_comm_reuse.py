"""A pool's multi-rank tasks run on communicators its ranks keep, and a rank making a new
one waits for its peers asleep. Counted, not timed (the machine is shared).

On a pool of more slots than a task has ranks, the ranks of a task that ends used to go back
to the queue one by one, each paired with whichever rank came back next: 300 2-rank tasks on
8 slots used all 28 pairs, each a communicator made (``Create_group``, then ``Dup``: both
busy-poll in MPICH while a peer is not there yet; on 32 slots, 1,000 tasks made about 430).
The broker now gives a task's slots back together (``Broker._park``): 4 pairs.
"""

import pytest
from mpiutil import run_mpi

import hetflow

pytestmark = pytest.mark.timeout(180)

SLOTS, TASKS = 8, 300
#: Distinct rank sets of 300 2-rank tasks on 8 slots: 4 measured (n=3, load 85-96), 28 (every pair)
#: before the broker gave a task's slots back together. A peer back more than the broker's
#: PARK_S after its task's first rank makes a new pair: the margin is for that.
MAX_RANK_SETS = 12


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return None


def test_tasks_at_once_reuse_their_ranks_communicators(tmp_path):
    from parsl.dataflow.dflow import DataFlowKernelLoader

    with hetflow.runtime("pool", max_ranks=SLOTS, output="off", run_dir=str(tmp_path),
                         progress=False):
        executor = DataFlowKernelLoader.dfk().executors["pool"]
        noop().result(timeout=60)
        futures = [noop() for _ in range(TASKS)]
        assert [f.result(timeout=120) for f in futures] == [None] * TASKS
        sets = sum(len(w.comm_keys) for w in executor._broker.mpi.worlds.values())
    assert 1 <= sets <= MAX_RANK_SETS, f"{TASKS} 2-rank tasks made {sets} rank sets"


LATE_S = 2.0
#: CPU seconds a rank may use while its peer comes LATE_S late: 0.04 measured asleep
#: (``_rank.wait``); MPICH's Create_group and Dup spun 0.59-1.12 s of it (n=3, load 87-90).
MAX_WAITING_CPU_S = 0.2

SCRIPT = r"""
import time
from mpi4py import MPI
import mpiutil
from hetflow.executors._rank import duplicate, group_comm

world = MPI.COMM_WORLD
meeting = duplicate(world)
late = world.Get_rank() == 1
cpu = []
if late:
    time.sleep(LATE_S)
start = time.process_time()
comm = group_comm(world, meeting, (0, 1))     # rank 1 comes LATE_S late
cpu.append(time.process_time() - start)
if late:
    time.sleep(LATE_S)
start = time.process_time()
user = duplicate(comm)                         # again
cpu.append(time.process_time() - start)
ok = user.allreduce(1) == 2 and comm.Get_size() == 2
mpiutil.report((ok, cpu))
""".replace("LATE_S", repr(LATE_S))


def test_a_rank_waits_for_a_late_peer_asleep():
    run = run_mpi(SCRIPT, 2, timeout=90)
    (ok0, early), (ok1, _) = run.values(2)
    assert ok0 and ok1, run
    assert max(early) <= MAX_WAITING_CPU_S, \
        f"rank 0 used {early} CPU s waiting {LATE_S} s for rank 1 (make, then duplicate)"


@hetflow.mpi_app(ranks=2)
def rank_one_sleeps(comm, seconds):
    import time

    if comm.Get_rank() == 1:
        time.sleep(seconds)
    return comm.Get_rank()


@hetflow.mpi_app(ranks=1)
def quick(comm):
    return "quick"


def test_a_rank_back_before_its_peer_is_not_kept_from_other_tasks(tmp_path):
    # The broker keeps a rank back from a 2-rank task off the queue for its peer at most
    # PARK_S (50 ms): a 1-rank task queued behind a task whose rank 1 runs 3 s more than its
    # rank 0 runs on rank 0's slot meanwhile, and is delivered first.
    with hetflow.runtime("pool", max_ranks=2, output="off", run_dir=str(tmp_path),
                         progress=False):
        quick().result(timeout=60)
        slow = rank_one_sleeps(3.0)
        fast = quick()
        assert fast.result(timeout=60) == "quick"
        assert not slow.done(), "the 1-rank task waited for the 2-rank task's slow rank"
        assert slow.result(timeout=60) == 0              # rank 0's value
