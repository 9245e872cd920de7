"""Launching one task as one ``mpiexec -n R`` job: shared by the mpirun and Parsl executors.

:class:`MPILaunch` writes the task directory, starts the launcher in its own
process session, enforces the walltime, kills the whole process tree on
timeout or cancel, and turns what the ranks wrote into a value or a typed error.
"""
from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import List, Optional, Sequence

import psutil

from hetflow.errors import LaunchError, TaskCancelled, WalltimeExceeded
from hetflow.executors._rank import read_launcher_deaths, read_outcomes, task_deaths
from hetflow.spec import Resources


def default_mpiexec() -> str:
    """The launcher next to this interpreter (the mpich wheel's), else the one on PATH."""
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


def launcher_env(mpiexec: str, base: Optional[dict] = None) -> dict:
    """Environment for the launcher; Open MPI as root needs its two opt-in variables."""
    env = dict(os.environ if base is None else base)
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


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and everything under it (Hydra proxies and ranks included)."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie not yet reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


#: How often a running job's rank processes are checked (seconds).
WATCH_S = 0.02

#: How long the launcher gets to stop the job after a rank vanished without reporting,
#: before hetflow stops it itself (seconds). Hydra normally takes milliseconds; under
#: load it was once seen never to notice, leaving the peers spinning in a collective.
LOST_GRACE_S = 5.0


class MPILaunch:
    """One task's ``mpiexec`` job: prepare, run to completion (or walltime), collect."""

    def __init__(self, taskdir: str, payload: bytes, resources: Resources, sys_path: List[str],
                 command: List[str], env: dict):
        self.taskdir = taskdir
        self.resources = resources
        self.command = command + [taskdir]
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.cancelled = False
        self.first_vanished: Optional[int] = None
        self._vanished_at: Optional[float] = None
        self._pids: dict = {}
        self._pidfds: dict = {}      # descriptor -> rank, while the job runs (Linux pidfds)
        self._launcher_fd: Optional[int] = None
        os.makedirs(taskdir, exist_ok=True)
        with open(os.path.join(taskdir, "task.pkl"), "wb") as fh:
            fh.write(payload)
        with open(os.path.join(taskdir, "meta.json"), "w") as fh:
            json.dump({"resources": asdict(resources), "sys_path": sys_path}, fh)
        self.stdout = os.path.join(taskdir, "stdout")
        self.stderr = os.path.join(taskdir, "stderr")

    def start(self) -> None:
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            try:
                self.proc = subprocess.Popen(self.command, cwd=self.taskdir, stdout=out,
                                             stderr=err, env=self.env, start_new_session=True)
            except OSError as exc:
                raise LaunchError(f"could not start the MPI launcher: {exc}",
                                  command=self.command, logs=[self.stderr]) from exc

    def wait(self, task_id=None, executor: str = "") -> tuple:
        """Block until the job ends; ``(outcomes, returncode, error_or_None)``."""
        assert self.proc is not None
        walltime = self.resources.walltime
        deadline = None if walltime is None else time.monotonic() + walltime
        returncode = None
        while returncode is None:
            returncode = self.wait_step(WATCH_S)
            if returncode is None and deadline is not None and time.monotonic() > deadline:
                break
        self.close_watch()
        if returncode is None:
            kill_tree(self.proc.pid)
            self.proc.wait()
            return {}, self.proc.returncode, WalltimeExceeded(
                f"task {task_id} ({executor}) exceeded its walltime of {walltime} s and was "
                "stopped", walltime=walltime, task_id=task_id)
        # Ranks may have left orphans (a task's own subprocesses): end the session.
        kill_tree(self.proc.pid)
        if self.cancelled:
            return {}, returncode, TaskCancelled(f"task {task_id} ({executor}) was cancelled")
        return read_outcomes(self.taskdir), returncode, None

    def cancel(self) -> None:
        self.cancelled = True
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid)

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
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.watch_ranks()
                return self._stop_if_lost()
        poller = select.poll()
        poller.register(self._launcher_fd, select.POLLIN)
        watching = self.first_vanished is None
        if watching:
            for fd in self._pidfds:
                poller.register(fd, select.POLLIN)
        # Until every rank's pid is known, wake at the poll interval to read pid files.
        all_known = len(self._pids) == self.resources.ranks
        wait_s = timeout if all_known or not watching else min(timeout, WATCH_S)
        ready = [fd for fd, _ in poller.poll(wait_s * 1000)]
        if watching:
            exited = [self._pidfds[fd] for fd in ready if fd in self._pidfds]
            if len(exited) == 1:
                self._vanished(exited[0])
            elif exited:                   # seen together: fall back to rank order
                self.watch_ranks()
        returncode = self.proc.poll()
        if returncode is None:
            returncode = self._stop_if_lost()
        if returncode is not None:
            self.close_watch()
        return returncode

    def _stop_if_lost(self) -> Optional[int]:
        """Stop the job if a rank vanished unreported and the launcher has not, in time."""
        if self._vanished_at is None or time.monotonic() - self._vanished_at <= LOST_GRACE_S:
            return None
        kill_tree(self.proc.pid)   # the task is lost already; its peers must not hang
        return self.proc.wait()

    def _refresh_pids(self) -> None:
        if len(self._pids) >= self.resources.ranks:
            return
        for rank in range(self.resources.ranks):
            if rank in self._pids:
                continue
            try:
                with open(os.path.join(self.taskdir, f"pid-{rank}")) as fh:
                    pid = int(fh.read().strip())
            except (OSError, ValueError):
                continue
            self._pids[rank] = pid
            if hasattr(os, "pidfd_open"):
                try:
                    self._pidfds[os.pidfd_open(pid)] = rank
                except OSError:            # gone already: the next watch_ranks sees it
                    pass

    def _vanished(self, rank: int) -> None:
        """``rank``'s process ended: note it if it ended without reporting."""
        if self.first_vanished is None and \
                not os.path.exists(os.path.join(self.taskdir, f"rank-{rank}.pkl")):
            self.first_vanished = rank
            self._vanished_at = time.monotonic()

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
        """Note the first rank whose process vanished without reporting.

        A SIGKILLed rank leaves no evidence of its own, and Hydra then stops its peers
        and reports whichever it saw first; watching the pids while the job runs tells
        the victim from the ranks stopped with it. This is the polling fallback of
        :meth:`wait_step` (ranks found gone together are taken in rank order).
        """
        if self.first_vanished is not None:
            return
        self._refresh_pids()
        for rank, pid in self._pids.items():
            if ended(pid):
                self._vanished(rank)
                if self.first_vanished is not None:
                    return

    def deaths(self) -> dict:
        """Ranks that died without reporting: their own evidence first, then the launcher's."""
        own = task_deaths(self.taskdir)   # the supervisors' records order them, cause first
        if own:
            # Hydra may name a peer it killed while cleaning up; a rank's own evidence wins.
            return own
        # SIGKILL leaves no evidence: Hydra's "BAD TERMINATION" report (on stdout) names a pid
        # and the signal; the rank seen vanishing first is the victim.
        report = tail(self.stdout, 20000) + tail(self.stderr, 20000)
        found = read_launcher_deaths(self.taskdir, report)
        if self.first_vanished is not None:
            what = next(iter(found.values()))[0] if found else "vanished"
            return {self.first_vanished: (what, "")}
        return found

    def stderr_tail(self) -> str:
        return tail(self.stderr)

    def cleanup(self) -> None:
        shutil.rmtree(self.taskdir, ignore_errors=True)


def timestamps(outcomes: dict, launched: float) -> dict:
    """The rank-0 start/finish stamps for :class:`TaskTimes` (launch stamp included)."""
    stamps = {"launched": launched}
    root = outcomes.get(0)
    if root is not None:
        stamps.update(started=root.started, finished=root.finished)
    return stamps


def now() -> float:
    return time.time()
