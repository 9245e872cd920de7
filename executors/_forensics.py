"""Processes and shared memory a runtime leaves behind: find them, end them, clean up.

One place for what launch, the pool, the radical runtime and the guardian each need:
find a task's launcher from its ranks, kill a launcher's whole tree, find the
processes working under a directory, and remove the MPI shared-memory segments of
ranks that died without ``MPI_Finalize`` (which would have removed them). The
segments' names are read from the ranks' mappings *before* the kill (a dead
process has none), or from what ranks recorded in their task dirs
(``_mpishm.forget_mpi_shm_names``).
"""
from __future__ import annotations

import os
import signal
from typing import Dict, Iterable, List, Optional

from hetflow._guardian import alive
from hetflow._private import within

__all__ = ["ShmSweep", "ended", "forget_recorded_shm", "forget_recorded_shm_under",
           "kill_launch_of", "kill_processes", "kill_tree", "launcher_named", "launcher_of",
           "processes_under"]


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie not yet reaped)."""
    return not alive(pid)


class ShmSweep:
    """Collects the MPI segments (and multiprocessing semaphores) processes about to be
    killed still have linked, and removes them once they are dead."""

    def __init__(self):
        from hetflow.executors._mpishm import KILLED_TREE_SHM, mapped_mpi_shm, unlink_mpi_shm

        self._prefixes, self._mapped, self._unlink = KILLED_TREE_SHM, mapped_mpi_shm, unlink_mpi_shm
        self.paths: set = set()

    def note(self, pid: int) -> None:
        self.paths |= self._mapped(pid, self._prefixes)

    def unlink(self) -> None:
        self._unlink(self.paths)


def kill_tree(pid: int, wait: bool = True) -> None:
    """SIGKILL a launcher and everything under it (Hydra proxies and ranks included);
    ``wait``: until they are gone (up to 5 s; a process that is not this one's child is
    gone only once its own parent reaped it)."""
    import psutil   # here: only a kill needs the process tree (ranks never import this)

    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        procs = []
    kill_processes(procs, wait=wait, group=pid)


def kill_processes(procs, wait: bool = True, group: Optional[int] = None) -> None:
    """SIGKILL ``procs`` (psutil processes; and process group ``group``), then remove the
    shared memory they had mapped whose names were still there (see :class:`ShmSweep`).
    ``wait``: until they are gone (up to 5 s)."""
    import psutil

    shm = ShmSweep()
    for proc in procs:
        shm.note(proc.pid)
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    shm.unlink()
    if wait:
        psutil.wait_procs(procs, timeout=5)


def forget_recorded_shm(taskdir) -> None:
    """Once a world has ended: remove the segments its ranks on this host recorded in
    ``taskdir`` (Open MPI's, which a rank cannot unlink while its peers may attach). Only
    MPI segment paths are taken."""
    from hetflow.executors._mpishm import KILLED_WORLD_SHM, unlink_mpi_shm

    unlink_mpi_shm(p for p in taskdir.shm_recorded(os.uname().nodename)
                   if p.startswith(KILLED_WORLD_SHM) and "/../" not in p)


def forget_recorded_shm_under(run_dir: str) -> None:
    """:func:`forget_recorded_shm` for every task dir under ``run_dir``."""
    from hetflow.executors.taskdir import TaskDir

    for path, _dirs, files in os.walk(run_dir):
        if any(TaskDir.is_shm_record(f) for f in files):
            forget_recorded_shm(TaskDir(path))


def launcher_of(pids: Dict[int, int]) -> Optional[int]:
    """The pid of the ``mpiexec`` that started these ranks (an ancestor of one of them)."""
    import psutil

    for pid in pids.values():
        try:
            for parent in psutil.Process(pid).parents():
                if parent.name().startswith("mpiexec"):
                    return parent.pid
        except psutil.Error:
            continue
    return None


def launcher_named(prefix: str, suffix: str) -> Optional[int]:
    """The pid of an ``mpiexec`` given a file under ``prefix`` whose path ends in ``suffix``
    (inside Slurm, Hydra starts ranks under ``slurmstepd``: not its descendants)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if proc.name().startswith("mpiexec") and any(
                    a.startswith(prefix) and a.endswith(suffix) for a in proc.cmdline()):
                return proc.pid
        except (psutil.Error, OSError):    # it ended meanwhile
            continue
    return None


def kill_launch_of(last_argument: str) -> None:
    """SIGKILL the ranks whose command line ends in ``last_argument`` (a task dir), with
    their launcher's tree."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if (proc.cmdline() or [""])[-1] == last_argument:
                kill_tree(launcher_of({0: proc.pid}) or proc.pid)
        except (psutil.Error, OSError):    # it ended meanwhile
            pass


def processes_under(base: str, env_var: Optional[str] = None) -> List:
    """Live processes working under ``base`` (their cwd), or whose ``env_var`` names a
    path under it: daemonised processes (re-parented to init) are found this way."""
    import psutil

    if not os.path.isabs(base) or os.path.dirname(base) == base:
        raise ValueError(f"processes_under needs an absolute dir other than '/', got {base!r}")
    found = []
    me = os.getpid()
    # Attributes are read one process at a time: one that exits meanwhile can surface as
    # a bare FileNotFoundError from /proc, which inside process_iter would end the scan.
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if within(proc.cwd() or "", base) or (
                    env_var is not None and within(proc.environ().get(env_var) or "", base)):
                found.append(proc)
        except (psutil.Error, OSError):
            pass
    return found


def end_processes(procs: Iterable) -> None:
    """Kill the trees of those of ``procs`` still running (each checked first)."""
    import psutil

    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                kill_tree(proc.pid)
        except (psutil.Error, OSError):    # it ended meanwhile
            pass
