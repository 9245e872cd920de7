"""Launching one task as one ``mpiexec -n R`` job: shared by the mpirun and Parsl executors.

:class:`MPILaunch` starts the launcher in its own process session, watches the
ranks' processes (to name the one that died first) and kills the whole process
tree when asked; the task dir (:mod:`hetflow.executors.taskdir`) carries the rest.
"""
from __future__ import annotations

import functools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from typing import Callable, List, Optional, Sequence

from hetflow.errors import LaunchError
from hetflow.executors._forensics import ended, forget_recorded_shm, kill_tree
from hetflow.executors.taskdir import PRIVATE_UMASK, Deaths, TaskDir
from hetflow.executors.watch import POLL_S


def default_mpiexec() -> str:
    """``$HETFLOW_MPIEXEC`` (a site's launcher), else the launcher next to this interpreter
    (the mpich wheel's), else the one on PATH."""
    chosen = os.environ.get("HETFLOW_MPIEXEC")
    if chosen:
        found = shutil.which(chosen)
        if not found:
            raise LaunchError(f"HETFLOW_MPIEXEC={chosen!r} is not an executable")
        return found
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return local
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise LaunchError("no mpiexec found: install the 'mpich' wheel (pip install mpich) "
                          "or put an MPI launcher on PATH")
    return found


@functools.lru_cache(maxsize=None)
def launcher_flavour(mpiexec: str) -> str:
    """"openmpi" or "mpich" (Hydra), from the launcher's --version."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "mpich"
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


#: glibc's tunable that makes malloc ask for transparent huge pages (``madvise``) for the
#: memory it maps; glibc before 2.35 and other C libraries ignore it.
MALLOC_THP = "glibc.malloc.hugetlb=1"


def with_malloc_thp(env: dict) -> dict:
    """``env`` (changed in place) with :data:`MALLOC_THP` added to ``GLIBC_TUNABLES``, so the
    processes started with it map their large buffers in 2 MiB pages, not 4 KiB ones: a
    page fault, and the kernel's zeroing, per 2 MiB on first touch. NumPy asks for that for
    its own arrays of 4 MiB and more; Arrow's buffers and smaller ones did not get it
    (docs/engine.md has the measurements). Left as it is where ``GLIBC_TUNABLES`` already
    sets ``glibc.malloc.hugetlb`` (the user's choice) or ``HETFLOW_FRAME_ALLOCATOR=keep``
    (the opt-out from hetflow's allocator settings)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get("HETFLOW_FRAME_ALLOCATOR") == "keep" or "glibc.malloc.hugetlb=" in tunables:
        return env
    env["GLIBC_TUNABLES"] = f"{tunables}:{MALLOC_THP}" if tunables else MALLOC_THP
    return env


def launcher_env(mpiexec: str, base: Optional[dict] = None) -> dict:
    """Environment for the launcher (and so the ranks); Open MPI as root needs its two opt-in
    variables, inside a Slurm allocation the launcher's steps overlap, and malloc asks for
    transparent huge pages (:func:`with_malloc_thp`)."""
    env = with_malloc_thp(dict(os.environ if base is None else base))
    if env.get("SLURM_JOB_ID"):
        # Inside a Slurm allocation Hydra starts its proxies with srun, and a step takes
        # its nodes' CPUs: a second task's step waits ("Requested nodes are busy") for the
        # first to end. hetflow places the ranks on its own slots: let the steps overlap.
        env.setdefault("SLURM_OVERLAP", "1")
    if launcher_flavour(mpiexec) == "openmpi" and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpiexec_command(mpiexec: str, ranks: int, extra: Sequence[str] = (),
                    python: Optional[str] = None) -> List[str]:
    """``mpiexec -n R [extra] python -m hetflow.executors._rank``; the task dir comes last."""
    cmd = [mpiexec, "-n", str(ranks)]
    if launcher_flavour(mpiexec) == "openmpi" and ranks > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    cmd += list(extra)
    cmd += [python or sys.executable, "-m", "hetflow.executors._rank"]
    return cmd


def tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


class MPILaunch:
    """One task's launcher job: start it in its own session, watch its ranks, kill it.

    The task dir must already hold the payload (``TaskDir.create``). ``on_vanished``
    is called once, from :meth:`wait_step`, when a rank's process ended without
    reporting: the caller arms its failed-peer grace (see ``watch.PEER_GRACE_S``)
    and kills the job if the launcher has not stopped it by then.
    """

    def __init__(self, taskdir: TaskDir, ranks: int, command: List[str], env: dict,
                 on_vanished: Optional[Callable[[], None]] = None):
        self.taskdir = taskdir
        self.ranks = ranks
        self.command = command + [taskdir.path]
        self.env = env
        self.on_vanished = on_vanished
        self.proc: Optional[subprocess.Popen] = None
        self.first_vanished: Optional[int] = None
        self._pids: dict = {}
        self._pidfds: dict = {}      # descriptor -> rank, while the job runs (Linux pidfds)
        self._launcher_fd: Optional[int] = None

    def start(self) -> None:
        out, err = self.taskdir.open_output()
        with out, err:
            try:
                self.proc = subprocess.Popen(self.command, cwd=self.taskdir.path, stdout=out,
                                             stderr=err, env=self.env, start_new_session=True,
                                             umask=PRIVATE_UMASK)
            except OSError as exc:
                raise LaunchError(f"could not start the MPI launcher: {exc}",
                                  command=self.command, logs=[self.taskdir.stderr]) from exc

    def wait(self) -> int:
        """Block until the job ends (watching its ranks); the launcher's exit code."""
        returncode = None
        while returncode is None:
            returncode = self.wait_step(1.0)
        # Ranks may have left orphans (a task's own subprocesses): end the session.
        self.kill()
        return returncode

    def kill(self) -> None:
        """SIGKILL the launcher's whole process tree (idempotent)."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            kill_tree(self.proc.pid)
        else:
            # The launcher is reaped (its pid may already name another process): what is
            # left of the job, a task's orphans, is in the session's process group.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        forget_recorded_shm(self.taskdir)

    def wait_step(self, timeout: float) -> Optional[int]:
        """Wait up to ``timeout`` s for the launcher to end, watching the ranks meanwhile.

        Returns the launcher's exit code, or None while it runs. Where the kernel has
        pidfds, this blocks on the launcher's and the ranks' descriptors together, so a
        rank's death is seen as it happens rather than at the next poll: Hydra stops
        the peers of a SIGKILLed rank within milliseconds, and a 20-50 ms poll under
        load sometimes found them all gone and named the wrong rank.
        """
        self._refresh_pids()
        if self._launcher_fd is None and hasattr(os, "pidfd_open"):
            try:
                self._launcher_fd = os.pidfd_open(self.proc.pid)
            except OSError:                # already reaped, or pidfds unsupported
                pass
        if self._launcher_fd is None:
            try:
                return self.proc.wait(timeout=min(timeout, POLL_S))
            except subprocess.TimeoutExpired:
                self.watch_ranks()
                return None
        poller = select.poll()
        poller.register(self._launcher_fd, select.POLLIN)
        watching = self.first_vanished is None
        if watching:
            for fd in self._pidfds:
                poller.register(fd, select.POLLIN)
        # Until every rank's pid is known, wake at the poll interval to read pid files.
        all_known = len(self._pids) == self.ranks
        wait_s = timeout if all_known or not watching else min(timeout, POLL_S)
        ready = [fd for fd, _ in poller.poll(wait_s * 1000)]
        if watching:
            exited = [self._pidfds[fd] for fd in ready if fd in self._pidfds]
            if len(exited) == 1:
                self._vanished(exited[0])
            elif exited:                   # seen together: fall back to rank order
                self.watch_ranks()
        returncode = self.proc.poll()
        if returncode is not None:
            self.close_watch()
        return returncode

    def _refresh_pids(self) -> None:
        if len(self._pids) >= self.ranks:
            return
        for rank, pid in self.taskdir.pids().items():
            if rank in self._pids:
                continue
            self._pids[rank] = pid
            if hasattr(os, "pidfd_open"):
                try:
                    self._pidfds[os.pidfd_open(pid)] = rank
                except OSError:            # gone already: the next watch_ranks sees it
                    pass

    def _vanished(self, rank: int) -> None:
        """``rank``'s process ended: note it if it ended without reporting."""
        if self.first_vanished is None and not self.taskdir.has_outcome(rank):
            self.first_vanished = rank
            if self.on_vanished is not None:
                self.on_vanished()

    def close_watch(self) -> None:
        """Close the pidfds (idempotent)."""
        for fd in list(self._pidfds) + ([self._launcher_fd] if self._launcher_fd else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds.clear()
        self._launcher_fd = None

    def watch_ranks(self) -> None:
        """Note the first rank whose process vanished without reporting (polling fallback).

        A SIGKILLed rank leaves no evidence of its own, and Hydra then stops its peers
        and reports whichever it saw first; watching the pids while the job runs tells
        the victim from the ranks stopped with it (ranks found gone together are
        taken in rank order).
        """
        if self.first_vanished is not None:
            return
        self._refresh_pids()
        for rank, pid in sorted(self._pids.items()):
            if ended(pid):
                self._vanished(rank)
                if self.first_vanished is not None:
                    return

    def deaths(self) -> Deaths:
        """Ranks that died without reporting, the cause first (see ``TaskDir.deaths``)."""
        return self.taskdir.deaths(self._launcher_report)

    def _launcher_report(self) -> Deaths:
        """What only the launcher saw: Hydra's "BAD TERMINATION" report (on stdout) names a
        pid and the signal; the rank seen vanishing first is the victim."""
        report = tail(self.taskdir.stdout, 20000) + tail(self.taskdir.stderr, 20000)
        found = hydra_deaths(self.taskdir, report)
        if self.first_vanished is not None:
            what = next(iter(found.values()))[0] if found else "vanished"
            return {self.first_vanished: (what, "")}
        return found

    def stderr_tail(self) -> str:
        return tail(self.taskdir.stderr)


_HYDRA_BAD = re.compile(r"PID (\d+) RUNNING AT .*?\n=\s+EXIT CODE: (\d+)", re.S)
_HYDRA_SIGNAL = re.compile(r"EXIT STRING: .*?\(signal (\d+)\)")


def hydra_deaths(taskdir: TaskDir, launcher_output: str) -> Deaths:
    """Deaths Hydra saw but the rank could not record (SIGKILL leaves no evidence).

    Hydra reports ``PID n RUNNING AT host / EXIT CODE: c`` for the process that
    terminated badly; the ``pid-<rank>`` files map it back to a rank. Only its
    first report counts: later ones are peers it stopped while cleaning up.
    """
    pids = {pid: rank for rank, pid in taskdir.pids().items()}
    signal_match = _HYDRA_SIGNAL.search(launcher_output)
    deaths = {}
    for pid, code in _HYDRA_BAD.findall(launcher_output)[:1]:
        rank = pids.get(int(pid))
        if rank is not None:
            deaths[rank] = (f"was killed by signal {signal_match.group(1)}" if signal_match
                            else f"exited with code {code}", "")
    return deaths
