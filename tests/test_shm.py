"""MPI shared memory: a world killed by hetflow leaves nothing in /dev/shm (each test here
starts its own runtime: no module-level one)."""
import os
import time

import pytest

import hetflow


@hetflow.mpi_app(ranks=2, walltime=5)
def hold_and_list_shm(comm, marks):
    # the named shared-memory segments this rank has mapped (MPICH's: /dev/shm/mpich_shm_*)
    with open("/proc/self/maps") as fh:
        names = sorted({line.split(None, 5)[5].strip() for line in fh
                        if "/dev/shm/mpich_shm_" in line})
    mark = os.path.join(marks, f"shm-{comm.Get_rank()}")
    with open(mark + ".tmp", "w") as fh:
        fh.write("\n".join(names))
    os.replace(mark + ".tmp", mark)                        # whole, or not there
    time.sleep(120)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["mpirun", "pool"])
def test_a_killed_world_leaves_nothing_in_dev_shm(name, tmp_path):
    # MPICH removes the /dev/shm segments of a node's ranks at MPI_Finalize, which a killed
    # rank never reaches: every walltime, cancel or crash left one for good (RAM, until a
    # reboot; ~180 per suite run filled this machine's 24 GB and the OOM killer ended the
    # test workers). The rank runner unlinks their names once every rank has mapped them.
    # (Both the launch-per-task runner, shared by mpirun, parsl and slurm, and the pool's.)
    with hetflow.runtime(name, max_ranks=4):
        fut = hold_and_list_shm(str(tmp_path))
        deadline = time.time() + 60
        while len(list(tmp_path.glob("shm-?"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(hetflow.WalltimeExceeded):
            fut.result(timeout=60)
    names = {n for f in tmp_path.glob("shm-?") for n in f.read_text().split("\n") if n}
    assert names, "MPICH mapped no named segment: the mpich wheel's MPI is expected here"
    assert all(n.endswith(" (deleted)") for n in names), names     # unlinked while running
    assert not [n for n in names if os.path.exists(n.removesuffix(" (deleted)"))]


HOLD = r"""
import os, sys, time
from mpi4py import MPI
names = sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps")
                if "/dev/shm/mpich_shm_" in line or "/dev/shm/vader_segment." in line})
mark = os.path.join(sys.argv[1], f"shm-{MPI.COMM_WORLD.Get_rank()}")
with open(mark + ".tmp", "w") as fh:
    fh.write("\n".join(names))
os.replace(mark + ".tmp", mark)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_world_killed_before_it_unlinked_leaves_nothing_in_dev_shm(tmp_path):
    # A world hetflow kills before its ranks reached the unlink (a cancel or a walltime during
    # MPI_Init, a pool world lost at its start), or any Open MPI world (its ranks cannot
    # unlink early): kill_tree removes what its ranks mapped. (make test-openmpi runs this
    # with Debian's Open MPI: $HETFLOW_MPIEXEC.)
    import subprocess
    import sys

    from hetflow.executors.launch import kill_tree

    mpiexec = (os.environ.get("HETFLOW_MPIEXEC")
               or os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    launcher = subprocess.Popen([mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path)],
                                start_new_session=True, env=env)
    try:
        deadline = time.time() + 40
        while len(list(tmp_path.glob("shm-?"))) < 2 and time.time() < deadline:
            assert launcher.poll() is None, f"{mpiexec} exited {launcher.returncode}"
            time.sleep(0.05)
        names = {n for f in tmp_path.glob("shm-?") for n in f.read_text().split("\n") if n}
        assert names, "the MPI mapped no named segment (MPICH's or Open MPI's vader)"
        assert all(os.path.exists(n) for n in names)      # nobody unlinked them
        kill_tree(launcher.pid)
        assert not [n for n in names if os.path.exists(n)], names
    finally:
        launcher.kill()
        launcher.wait()


@hetflow.mpi_app(ranks=2)
def list_shm_and_fail(comm, marks):
    names = sorted({line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                    for line in open("/proc/self/maps")
                    if "/dev/shm/mpich_shm_" in line or "/dev/shm/vader_segment." in line})
    mark = os.path.join(marks, f"shm-{comm.Get_rank()}")
    with open(mark + ".tmp", "w") as fh:
        fh.write("\n".join(names))
    os.replace(mark + ".tmp", mark)
    comm.Barrier()
    if comm.Get_rank() == 1:
        raise ValueError("a rank fails: the world is aborted")
    time.sleep(60)


@pytest.mark.timeout(120)
def test_an_aborted_world_leaves_nothing_in_dev_shm(tmp_path):
    # A task failing on one rank aborts its world (MPI_Abort: the launcher kills the other
    # ranks, nobody reaches MPI_Finalize). MPICH's names are gone from the start; Open MPI's,
    # which cannot go early, are removed once the launch has ended (the ranks record them).
    # (make test-openmpi runs this with Debian's Open MPI.)
    with hetflow.runtime("mpirun", max_ranks=2):
        with pytest.raises(hetflow.TaskFailed):
            list_shm_and_fail(str(tmp_path)).result(timeout=90)
    names = {n for f in tmp_path.glob("shm-?") for n in f.read_text().split("\n") if n}
    assert names, "the MPI mapped no named segment (MPICH's or Open MPI's vader)"
    assert not [n for n in names if os.path.exists(n)], names
