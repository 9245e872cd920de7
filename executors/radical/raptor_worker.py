"""hetflow's RAPTOR MPI worker: RP's own, whose ranks, once all of them are up, unlink the
names of the MPICH shared-memory segments they mapped.

MPICH removes those segments (``/dev/shm/mpich_shm_*``, one per node of the worker) only at
``MPI_Finalize``, which the ranks of a worker hetflow kills (a lost rank, a cancel, the close)
never reach: each killed worker left them there, RAM until the node reboots. hetflow's other
rank runners unlink the names once every rank has mapped the segments
(``hetflow.executors._mpishm.forget_mpi_shm_names``); here that point is the end of RP's
``MPIWorker.__init__``, which every rank runs after ``MPI_Init`` (which waits for all ranks)
and which ends in a broadcast over the whole world. Every rank does it, so every node's
segment goes, whether or not a task ever reaches that node's ranks.

RP loads this file by path in the pilot (the worker task's ``raptor_file``, this file in
hetflow's install).

Its start is also quiet. In ``MPIWorker.__init__`` rank 0 registers with the master, starts
two queues and sleeps a second while the other ranks wait in the world broadcast that follows,
and MPICH's blocking calls busy-poll: on a node with more ranks than cores those ranks burned
the CPU rank 0 needed (measured: about 1.4 CPU-s per waiting rank and second, 4 ranks on 2
cores). Here that broadcast first waits for every rank in a non-blocking barrier polled every
10 ms, so the broadcast itself no longer waits.

Once up (every rank started, registered with the master), rank 0 creates the file named by
``$HETFLOW_RAPTOR_READY``: hetflow replaces a worker that does not come up
(``radical.worker.RaptorWorker.check``).

Its ranks' own threads (rank 0's queues, task puller and result pusher, which poll every
1-100 ms) run, when asked to (``$HETFLOW_YIELD_CPU``, see ``executors/radical/priority.py``),
at the lowest CPU priority: only the thread that runs the tasks (and the threads a task
starts) keeps the rank's own, so the task never waits for them.
"""
import os
import threading
import time

import radical.pilot as rp
from mpi4py import MPI

from hetflow.executors._mpishm import unlink_mapped_mpi_shm
from hetflow.executors.radical import lowprio as _lowprio

#: Seconds between the polls of a rank waiting for its peers at the worker's start.
_POLL_S = 0.01


class _QuietWorld(MPI.Intracomm):
    """MPI_COMM_WORLD (the same handle) whose ``bcast`` first waits for every rank without
    spinning."""

    def bcast(self, obj=None, root=0):
        arrived = self.Ibarrier()
        while not arrived.Test():
            time.sleep(_POLL_S)
        return super().bcast(obj, root)


class MPIWorker(rp.raptor.MPIWorker):

    def __init__(self, raptor_id: str):
        world = MPI.COMM_WORLD
        MPI.COMM_WORLD = _QuietWorld(world)     # what RP's __init__ takes as its world
        try:
            super().__init__(raptor_id)
        finally:
            MPI.COMM_WORLD = world
        self._world = world
        unlink_mapped_mpi_shm()
        ready = os.environ.get("HETFLOW_RAPTOR_READY")
        if ready and world.Get_rank() == 0:
            os.close(os.open(ready, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))

    def start(self):
        super().start()
        if _lowprio.wanted():
            _lowprio.lower_threads(keep=[threading.get_native_id(), self._work_thread.native_id])
