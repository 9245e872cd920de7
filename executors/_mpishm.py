"""MPICH's (and Open MPI's) named shared memory, which a killed rank leaves in /dev/shm.

Ranks unlink the names once every rank has mapped them (:func:`forget_mpi_shm_names`);
the client removes what a killed world left (``_forensics``).
"""
from __future__ import annotations

import os

from hetflow.executors.taskdir import TaskDir

#: Named shared-memory segments MPICH creates at ``MPI_Init`` for a node's ranks and removes
#: only at ``MPI_Finalize``: the segment of a world whose rank was killed (a walltime, a
#: cancel, a crash) stayed in /dev/shm for good, RAM until the node reboots (about 180
#: segments, 430 MB, per run of the test suite). Open MPI's segments are left alone: its
#: peers attach to them by name after initialisation.
_MPI_SHM_PREFIX = "/dev/shm/mpich_shm_"


def forget_mpi_shm_names(world, taskdir: TaskDir) -> None:
    """Unlink the names of the MPICH segments this rank mapped at ``MPI_Init``, once every
    rank of ``world`` has (a barrier): the mappings stay valid, nobody opens them by name
    again, and nothing is left in /dev/shm however the world ends. Segments that cannot go
    yet (Open MPI's) are noted in ``taskdir`` for the client to remove once the world has
    ended (``launch.forget_recorded_shm``)."""
    if world.Get_size() > 1:
        world.Barrier()              # every rank, mapped segments or not (no rank waits alone)
    mapped = mapped_mpi_shm("self", KILLED_WORLD_SHM)
    unlink_mpi_shm(p for p in mapped if p.startswith(_MPI_SHM_PREFIX))
    left = {p for p in mapped if not p.startswith(_MPI_SHM_PREFIX)}
    if left:
        taskdir.record_shm(world.Get_rank(), os.uname().nodename, left)


def unlink_mapped_mpi_shm() -> int:
    """Unlink the names of the MPICH segments this rank has mapped (see
    :func:`forget_mpi_shm_names`; without its barrier, for a world known to be past its
    start on every rank). Returns how many."""
    return unlink_mpi_shm(mapped_mpi_shm("self"))


#: Named shared memory of an MPI world that outlives its ranks when they are killed: MPICH's
#: segments, and Open MPI's (whose peers attach to them by name after start-up, so they
#: can be removed only once the whole world is dead: see launch.kill_tree).
KILLED_WORLD_SHM = (_MPI_SHM_PREFIX, "/dev/shm/vader_segment.")
#: What a killed process tree leaves besides: those, and the named semaphores of Python's
#: multiprocessing started by spawn (a Parsl worker pool's queues and counters), whose names
#: only its finalizers or its resource tracker (killed with the tree) would have removed.
#: Only those a process opened by name are seen (in its maps): the creator maps a
#: temporary name that glibc already unlinked.
KILLED_TREE_SHM = KILLED_WORLD_SHM + ("/dev/shm/sem.mp-",)


def mapped_mpi_shm(pid, prefixes=(_MPI_SHM_PREFIX,)) -> set:
    """Paths under ``prefixes`` (default: MPICH's segments) that process ``pid`` ("self":
    this one) maps and whose names are still linked (an exited or foreign process: none)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return {path for path in (line.split(None, 5)[5].strip() for line in fh
                                      if "/dev/shm/" in line)
                    if path.startswith(prefixes) and not path.endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


def unlink_mpi_shm(paths) -> int:
    """Unlink these segment names; returns how many were still there."""
    gone = 0
    for path in paths:
        try:
            os.unlink(path)
            gone += 1
        except OSError:              # a peer of this node unlinked it first
            pass
    return gone
