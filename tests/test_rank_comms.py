"""A persistent rank (pool, RAPTOR) runs task after task on communicators it creates; one
whose task failed must not let that task's unreceived messages reach the next task."""
from __future__ import annotations

from mpiutil import run_mpi

SCRIPT = r"""
import os, sys, threading, time
from mpi4py import MPI
import mpiutil
from hetflow.executors._rank import arrive, release_comm

world = MPI.COMM_WORLD
rank = world.Get_rank()


def task_comm(ranks):
    group = world.group.Incl(ranks)
    comm = world.Create_group(group)
    group.Free()
    return comm


# A 2-rank task on world ranks 2 and 3: rank 3 raises, rank 2 has entered a barrier, so
# its message to rank 3 stays unreceived. Rank 3 settles its failed task's communicators
# as the pool worker does.
if rank in (2, 3):
    comm = task_comm([2, 3])
    user = arrive(comm)
    if rank == 2:                        # a barrier that never completes: rank 3 never enters
        threading.Thread(target=user.Barrier, daemon=True).start()
        time.sleep(0.5)                  # (its first message is sent at once)
    else:
        release_comm(user, failed=True)
        release_comm(comm, failed=True)
world.Barrier()

# The next task, on world ranks 0, 1 and 3: its first collectives must complete.
done = None
if rank != 2:
    comm = task_comm([0, 1, 3])
    deadline = time.monotonic() + 20
    request = comm.Ibarrier()
    while not request.Test() and time.monotonic() < deadline:
        time.sleep(0.001)
    done = request.Test()
    if done:
        user = comm.Dup()
        done = user.allreduce(1) == 3
mpiutil.report(done)
world.Barrier()  # every report written before any rank leaves
sys.stdout.flush()
os._exit(0)      # rank 2's barrier never completes: no MPI_Finalize
"""


def test_a_failed_tasks_stale_message_does_not_reach_the_next_task():
    # Without release_comm keeping rank 3's communicators (it freed them), Open MPI 4.1.4
    # reused their context id for the 3-rank communicator and matched rank 2's stale barrier
    # message in its first collective, which never completed: rank 0 or 3 reported False.
    run = run_mpi(SCRIPT, 4, timeout=90)
    assert run.reports == {0: True, 1: True, 2: None, 3: True}, run


COUNT_SCRIPT = r"""
import mpiutil
from mpi4py import MPI
from hetflow.executors._rank import run_on_rank
from hetflow.executors.payload import TaskPayload

COLLECTIVES = {"Barrier", "Ibarrier", "Dup", "Idup", "Split", "Create_group", "Bcast",
               "Allreduce", "allreduce", "barrier", "bcast"}


class Counting:
    # the task's communicator as run_on_rank sees it: every call it makes, named
    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.comm, name)


def noop():               # the payload's function: hetflow's wrapper, called bare
    return None


world = MPI.COMM_WORLD
payload = TaskPayload(1, noop, (), {}, {"ranks": 2}).dumps()
counted = Counting(world.Dup())
outcome = run_on_rank(payload, counted)
mpiutil.report((outcome.ok, [c for c in counted.calls if c in COLLECTIVES]))
"""


def test_a_task_costs_its_ranks_one_collective_before_the_function():
    # A rank waits for its peers and makes the task's own communicator in one nonblocking
    # collective (Idup), then sleeps while it waits. Before: Ibarrier, then Dup, a second
    # collective that busy-polls in MPICH while a peer is descheduled.
    run = run_mpi(COUNT_SCRIPT, 2, timeout=90)
    assert run.values(2) == [(True, ["Idup"]), (True, ["Idup"])], run
