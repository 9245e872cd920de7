"""The runtime's guardian: when the client dies, by any means, its runtime dies with it.

Runtimes start processes that do not die with the client: Parsl's interchange
and worker pool, RADICAL-Pilot's bridges, agent and RAPTOR workers daemonise or
wait on sockets nobody will ever close. A ``kill -9`` of the client (or the OOM
killer, or a lost terminal) would leave them running for good.

``hetflow.runtime`` therefore starts one small guardian process per runtime
before any executor starts, and marks the environment with a variable whose
*name* holds a fresh random token (``HETFLOW_RUNTIME_<token>``). Every process
the runtime starts inherits it, however it was started (fork, exec, daemonised,
re-parented to init, launched through ``mpiexec`` or a pilot's bootstrap), and
``/proc/<pid>/environ`` shows it for the process's whole life. Nested runtimes
keep each other's variables, so each guardian covers its own subtree.

The guardian waits on a pidfd of the client (it is the client's child) and on a
pipe from it. A ``stop`` line on the pipe (normal exit) makes it exit quietly;
the client's death (pidfd readable, or the pipe closed without ``stop``) makes it
SIGKILL every process carrying its token, again until none is left, and then
remove the runtime's own temp run dir. Processes of other runtimes carry other
tokens and are never touched.
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)


#: Prefix of the environment variable that marks a runtime's processes.
ENV_PREFIX = "HETFLOW_RUNTIME_"
_STOP = b"stop\n"
#: How long the guardian keeps sweeping for stragglers (forks racing the kill).
_SWEEP_S = 5.0
#: How long a normal close waits for the runtime's detached processes to end.
_SETTLE_S = 5.0
#: What the guardian writes once it knows its client, and how long the client waits for it.
_READY, _READY_S = b"ready\n", 10.0
#: How often the guardian records the client's descendants.
_TRACK_S = 0.5


# ---- /proc/<pid>/stat, read once for everyone (this module, the launchers, the pool)
#: Indexes into :func:`stat_fields` (``proc(5)`` field number minus 3).
STATE, PPID, PGRP, FLAGS, START_TICKS = 0, 1, 2, 6, 19
#: The kernel-thread bit of the flags (PF_KTHREAD): such a thread has no environment at all.
_PF_KTHREAD = 0x00200000
#: How long a process whose environment and command line both read empty (in execve, or
#: exiting) is waited for to read as one or the other.
_EXEC_WAIT_S = 1.0


def stat_fields(pid) -> Optional[List[bytes]]:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            # The command name is in parentheses and may hold spaces or ')': split after it.
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid) -> bool:
    """Whether ``pid`` runs (a zombie not yet reaped has ended)."""
    fields = stat_fields(pid)
    return fields is not None and fields[STATE] not in (b"Z", b"X")


def start_ticks(pid) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot: tells a live process from a recycled
    pid, and reads the same in every process, unlike ``psutil``'s ``create_time()``, which
    adds a boot time each process cached (and two processes' caches can differ by
    seconds). None if it is gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[START_TICKS]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def marker(token: str) -> str:
    """Name of the environment variable carrying ``token``."""
    return ENV_PREFIX + token


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:                   # gone, or not ours to read
        return None


def process_environ(pid) -> Optional[bytes]:
    """The environment block of ``pid`` (NUL-separated), or None if it is gone or not ours.

    A process inside execve reads as empty: the kernel records where the new image's
    arguments and environment lie only after it has replaced the memory, so a child read
    right after ``subprocess.Popen`` returned was empty more than half the time here. So does
    one releasing its memory as it exits. While both its environment and its command line
    read empty (a process started with an empty environment still has a command line), it is
    read again until one of them does, it has ended, or :data:`_EXEC_WAIT_S` passed."""
    environ = _read(f"/proc/{pid}/environ")
    if environ != b"":
        return environ
    fields = stat_fields(pid)
    if fields is None or int(fields[FLAGS]) & _PF_KTHREAD:
        return environ if fields is not None else None
    deadline, delay = time.monotonic() + _EXEC_WAIT_S, 0.0002
    while _read(f"/proc/{pid}/cmdline") == b"" and alive(pid) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(2 * delay, 0.01)
        environ = _read(f"/proc/{pid}/environ")
        if environ != b"":
            return environ
    return _read(f"/proc/{pid}/environ")


def marked_processes(token: str, exclude: tuple = ()) -> List[int]:
    """Pids of live processes whose environment carries ``token`` (zombies excluded)."""
    needle = (marker(token) + "=").encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid in exclude:
            continue
        environ = process_environ(pid)
        if environ is None or not alive(pid):
            continue
        # Variables are NUL-separated: match whole names only.
        if environ.startswith(needle) or b"\0" + needle in environ:
            found.append(pid)
    return found


def descendants(root: int, since: Tuple[int, int] = (0, 0)) -> Dict[int, int]:
    """Pid -> start time of every live descendant of ``root`` (from /proc's children
    lists), leaving out subtrees whose top did not start after ``since`` (see :func:`_after`)."""
    found: Dict[int, int] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    children = [int(c) for c in fh.read().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                started = start_ticks(child)
                if started is not None and _after(started, child, since) and child not in found:
                    found[child] = started
                    stack.append(child)
    return found


def _after(started: int, pid: int, since: Tuple[int, int]) -> bool:
    """Whether process ``pid``, started at ``started`` (clock ticks), began after the process
    ``since`` = (its start ticks, its pid). Start times have a 10 ms grain, so within one
    tick the higher pid is the later fork (pids are handed out in increasing order)."""
    return (started, pid) > since


def orphans(pgid: int, since: Tuple[int, int]) -> List[int]:
    """Processes the dead client left as orphans: re-parented to our own new parent (init
    or a subreaper), still in the client's process group, started after ``since``."""
    reaper = os.getppid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)
        try:
            if fields is not None and int(fields[PPID]) == reaper and \
                    int(fields[PGRP]) == pgid and _after(int(fields[START_TICKS]), int(entry), since):
                found.append(int(entry))
        except (IndexError, ValueError):
            continue
    return found


def sweep(token: str, tracked: Optional[Dict[int, int]] = None, group: Optional[tuple] = None,
          budget_s: float = _SWEEP_S) -> int:
    """SIGKILL every process marked with ``token``, every still-live ``tracked`` process
    (pid -> start time) and their descendants, and the client's orphans (``group``: its
    process group and our start time), until a scan finds none; how many died."""
    me = os.getpid()
    tracked = dict(tracked or {})
    killed = set()
    shm = _MPIShm()
    deadline = time.monotonic() + budget_s
    try:
        while True:
            # Forks of the client never exec'd, so they lack the mark: known by the tree we
            # recorded, or, if forked since, as orphans of the client's process group.
            if group is not None:
                for pid in orphans(*group):
                    tracked.setdefault(pid, start_ticks(pid))
            for pid, started in list(tracked.items()):
                if start_ticks(pid) != started:
                    del tracked[pid]
                    continue
                tracked.update(descendants(pid))
            targets = (set(marked_processes(token)) | set(tracked)) - {me}
            targets = {pid for pid in targets if pid not in killed or alive(pid)}
            if not targets:
                return len(killed)
            for pid in targets:
                shm.note(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() > deadline:
                return len(killed)
            time.sleep(0.05)
    finally:
        shm.unlink()


class _MPIShm:
    """The MPI segments the killed processes still had linked, removed once they are dead
    (``hetflow.executors._forensics.ShmSweep``; nothing to do without the executors)."""

    def __init__(self):
        try:
            from hetflow.executors._forensics import ShmSweep
        except ImportError:
            ShmSweep = None
        self._sweep = ShmSweep() if ShmSweep is not None else None

    def note(self, pid: int) -> None:
        if self._sweep is not None:
            self._sweep.note(pid)

    def unlink(self) -> None:
        if self._sweep is not None:
            self._sweep.unlink()


class Guardian:
    """Client side of one runtime's guardian: start it, mark the environment, stop it."""

    def __init__(self, run_dir: Optional[str] = None, remove: bool = True):
        """``run_dir``: the runtime's run dir, whose ranks' shared-memory records the guardian
        honours after a sweep (and which it removes, with ``remove``)."""
        self.token = secrets.token_hex(8)
        self.name = marker(self.token)
        # Started before the environment is marked, so it never sweeps itself.
        # Run as a file in isolated mode: stdlib only, no hetflow/Parsl import (fast start).
        args = [sys.executable, "-I", os.path.abspath(__file__), self.token]
        if run_dir is not None:
            args += [run_dir, "remove" if remove else "keep"]
        self._proc = None
        if os.path.isdir("/proc/self/task"):     # Linux: the guardian reads /proc
            self._proc = subprocess.Popen(args, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, close_fds=True,
                                          start_new_session=True)
            # Wait until it knows its client and the client's process group: a client
            # killed before that would leave its forks unfound.
            ready, _, _ = select.select([self._proc.stdout], [], [], _READY_S)
            if not ready or self._proc.stdout.readline() != _READY:
                logger.warning("runtime guardian %s did not report ready in %s s", self.token,
                               _READY_S)
            self._proc.stdout.close()
        os.environ[self.name] = str(os.getpid())
        # setproctitle (Parsl's interchange, RP's components) writes a long title over
        # the environ block, erasing the mark from /proc/<pid>/environ; SPT_NOENV stops it.
        self._spt_noenv = os.environ.get("SPT_NOENV")
        os.environ["SPT_NOENV"] = "1"

    def processes(self) -> List[int]:
        """Live processes carrying this runtime's token (the guardian itself excluded)."""
        return marked_processes(self.token, exclude=(self._proc.pid,) if self._proc else ())

    def settle(self, grace_s: float = _SETTLE_S) -> List[int]:
        """At a normal close, once the executors have shut down: wait up to ``grace_s``
        for the detached processes still carrying the token (a Parsl worker pool or its
        resource tracker, a pilot's component, still exiting) to end, so that none
        outlives the close. The client's own descendants are left out: a process the
        user started while the runtime was open carries the token too, and is not the
        runtime's to wait for (or to end). Returns those still alive (logged)."""
        deadline = time.monotonic() + grace_s
        while True:
            mine = set(descendants(os.getpid()))
            left = [pid for pid in self.processes() if pid not in mine]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if left:
            logger.warning("runtime %s: processes still running %s s after its shutdown: %s",
                           self.token, grace_s, left)
        return left

    def stop(self) -> None:
        """Normal exit: unmark the environment and let the guardian exit without sweeping."""
        os.environ.pop(self.name, None)
        if self._spt_noenv is None:
            os.environ.pop("SPT_NOENV", None)
        else:
            os.environ["SPT_NOENV"] = self._spt_noenv
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(_STOP)
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        else:
            self._proc.stdin.close()


def _watch_client(pipe_fd: int, tracked: Dict[int, int], born: Tuple[int, int]) -> bool:
    """Block until the client stops us (False) or dies (True).

    Meanwhile every ``_TRACK_S`` record the client's descendants in ``tracked``: a
    process the client forked without exec'ing carries the client's original
    environment, without the mark, and is known only as a descendant.
    """
    client = os.getppid()
    me = os.getpid()
    pidfd = None
    try:
        pidfd = os.pidfd_open(client)
    except (AttributeError, OSError):
        pass
    if os.getppid() != client or client == 1:
        return True                   # it died before we could watch it
    watched = [pipe_fd] + ([pidfd] if pidfd is not None else [])
    data = b""
    while True:
        ready, _, _ = select.select(watched, [], [], _TRACK_S)
        if pipe_fd in ready:          # first: a "stop" written just before exiting counts
            chunk = os.read(pipe_fd, 64)
            if not chunk:
                return True
            data += chunk
            if data.endswith(_STOP):
                return False
        if (pidfd is not None and pidfd in ready) or os.getppid() != client:
            return True
        if not ready:
            for pid, started in list(tracked.items()):
                if start_ticks(pid) != started:
                    del tracked[pid]      # ended: forget it (its pid may be reused)
            tracked.update(descendants(client, since=born))
            tracked.pop(me, None)


def main(argv: List[str]) -> int:
    token = argv[0]
    run_dir = argv[1] if len(argv) > 1 else None
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)   # a terminal's Ctrl-C is the client's business
    tracked: Dict[int, int] = {}
    # The client's older processes (started before its runtime) are none of our business.
    born = (start_ticks(os.getpid()) or 0, os.getpid())
    client = os.getppid()
    try:
        group = (os.getpgid(client), born)
    except OSError:
        group = None
    if os.getppid() != client:        # the client died already: that group is not its
        group = None
    try:
        os.write(sys.stdout.fileno(), _READY)
    except OSError:
        pass
    if not _watch_client(sys.stdin.fileno(), tracked, born):
        return 0
    killed = sweep(token, tracked, group)
    if run_dir is not None:
        _forget_recorded_shm(run_dir)
    # One line on the client's stderr (inherited): why processes vanished.
    print(f"hetflow: the client of runtime {token} died; its guardian killed {killed} "
          f"process(es) it had started", file=sys.stderr, flush=True)
    if run_dir is not None and argv[2:3] != ["keep"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    _remove_rank_files(client)
    return 0


def _remove_rank_files(client: int) -> None:
    """Remove the in-memory dirs where the client's runtimes had ranks write their output
    (``hetflow.executors.rankio.node_root``: named after the client's pid)."""
    import glob

    for path in glob.glob(f"/dev/shm/hetflow-{client}-*"):
        if os.path.isdir(path) and not os.path.islink(path) and os.stat(path).st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _forget_recorded_shm(run_dir: str) -> None:
    """Remove the MPI segments the runtime's ranks on this host recorded in their dirs under
    ``run_dir``, as the executors do when a world ends. Needed besides the sweep's look at
    the ranks' mappings: a pool rank that finds its client gone exits on its own (without
    MPI_Finalize), sometimes before the sweep reaches it."""
    try:
        from hetflow.executors._forensics import forget_recorded_shm_under
    except ImportError:
        return
    forget_recorded_shm_under(run_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
