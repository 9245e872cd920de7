"""hetflow's RAPTOR MPI worker: RP's own, whose ranks, once all of them are up, unlink the
names of the MPICH shared-memory segments they mapped.

MPICH removes those segments (``/dev/shm/mpich_shm_*``, one per node of the worker) only at
``MPI_Finalize``, which the ranks of a worker hetflow kills (a lost rank, a cancel, the close)
never reach: each killed worker left them there, RAM until the node reboots. hetflow's other
rank runners unlink the names once every rank has mapped the segments
(``hetflow.executors._rank.forget_mpi_shm_names``); here that point is the end of RP's
``MPIWorker.__init__``, which every rank runs after ``MPI_Init`` (which waits for all ranks)
and which ends in a broadcast over the whole world. Every rank does it, so every node's
segment goes, whether or not a task ever reaches that node's ranks.

RP loads this file by path in the pilot (the worker task's ``raptor_file``, this file in
hetflow's install).
"""
import radical.pilot as rp

from hetflow.executors._rank import unlink_mapped_mpi_shm


class MPIWorker(rp.raptor.MPIWorker):

    def __init__(self, raptor_id: str):
        super().__init__(raptor_id)
        unlink_mapped_mpi_shm()
