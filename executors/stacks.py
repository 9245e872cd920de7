"""The ranks' Python stacks, on the client: asked for when the kernel stops a running task.

:func:`stacks` asks each rank of a task that has not returned for its stacks (``SIGUSR1``:
faulthandler writes them even while the rank waits inside MPI) and :func:`explain` puts them,
with which ranks had returned, on the task's error, each frame with its source line. A rank
is signalled only when ``/proc/<pid>/fd`` shows it holding that task's stack file open: a pid
that is not the rank (reused, or on another node) is never signalled.
"""
from __future__ import annotations

import linecache
import os
import re
import time
from typing import Dict

from hetflow import errors
from hetflow.executors import _rankio

#: How long a stopped task's ranks get to write their stacks.
STACK_WAIT_S = 1.0

_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in ')


def explain(files, error: BaseException, known=None) -> None:
    """Put on ``error`` which ranks of the task followed by ``files`` (a
    :class:`~hetflow.executors.rankio.TaskFiles`) had returned, and the stacks of the others
    (``known``: ``{rank: (pid, stack file)}`` of ranks that keep one for their life)."""
    files.check_returned(float("inf"))
    running = files.running()
    found = stacks(files.directories, running, known=known) if running else {}
    state = files.hang_text(named=False) if files.returned else ""
    silent = [r for r in running if r not in found]
    if silent:
        state += ("; " if state else "") + (f"no stack from rank(s) {silent} (not started, "
                                            f"or not on this node)")
    errors.with_stacks(error, state, found)


def stacks(directories, ranks, wait_s: float = STACK_WAIT_S, known=None) -> Dict[int, str]:
    """Ask ranks ``ranks`` of the task whose files dirs are ``directories`` for their Python
    stacks (``known``: ``{rank: (pid, path)}``, stack files kept by the ranks, besides
    those in the dirs); ``{rank: text}`` for those that answered within ``wait_s``."""
    asked = {}
    candidates = []
    if known is not None:
        candidates = [(rank, pid, path) for rank, (pid, path) in known.items()]
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            match = re.fullmatch(r"stack-(\d+)-(\d+)\.txt", name)
            if match:
                candidates.append((int(match.group(1)), int(match.group(2)),
                                   os.path.join(directory, name)))
    for rank, pid, path in candidates:
        if rank not in ranks or not _holds(pid, path):
            continue
        try:
            before = os.path.getsize(path)
            os.kill(pid, _rankio.STACK_SIGNAL)
        except OSError:
            continue
        asked[rank] = (path, before)
    found: Dict[int, str] = {}
    sizes: Dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(0.02)
        for rank, (path, before) in list(asked.items()):
            size = os.path.getsize(path) if os.path.exists(path) else before
            if size > before and sizes.get(rank) == size:     # written, and no longer growing
                with open(path, errors="replace") as fh:
                    fh.seek(before)
                    found[rank] = with_source(fh.read())
                del asked[rank]
            sizes[rank] = size
    return found


def _holds(pid: int, path: str) -> bool:
    """Whether process ``pid`` of this node has ``path`` open (it is that task's rank)."""
    folder = f"/proc/{pid}/fd"
    path = os.path.realpath(path)
    try:
        fds = os.listdir(folder)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(os.path.join(folder, fd)) == path:
                return True
        except OSError:
            continue
    return False


#: The first frame below a task's function: hetflow's runner and what started it.
_RUNNER = re.compile(r'^\s+File ".*hetflow[/\\]_task\.py", line \d+ in __call__$')


#: Frames of the runtime's own threads on a rank (a pool rank's control loop, zmq's, the
#: threading module's): a thread made only of these is not the user's and is left out.
_RUNTIME_FILE = re.compile(r'hetflow[/\\]executors[/\\]|[/\\]zmq[/\\]|[/\\]threading\.py$')


def _task_thread_first(dump: str) -> str:
    """faulthandler's dump with the thread running the task first, and without the threads
    whose every frame is the runtime's own (a persistent rank's control thread): the user
    reads where their function is before anything else."""
    threads, current = [], None
    for line in dump.splitlines():
        if line and not line.startswith(" "):      # a thread's header
            current = [line]
            threads.append(current)
        elif current is not None:
            current.append(line)
    if not threads:
        return dump

    def runs_task(block):
        return any(_RUNNER.match(line) for line in block)

    def runtime_only(block):
        files = [m.group(1) for m in map(_FRAME.match, block) if m]
        return bool(files) and all(_RUNTIME_FILE.search(f) for f in files)

    ordered = ([b for b in threads if runs_task(b)]
               + [b for b in threads if not runs_task(b) and not runtime_only(b)])
    return "\n\n".join("\n".join(b).rstrip("\n") for b in ordered or threads)


def with_source(dump: str) -> str:
    """faulthandler's dump with each frame's source line under it (read on the client: the
    same files where the client and ranks share a file system), the task's thread first and
    without the frames of hetflow's runner below the task's function."""
    lines = []
    below = False
    for line in _task_thread_first(dump).splitlines():
        if _RUNNER.match(line):
            below = True
        elif not line.startswith(" "):     # the next thread's header
            below = False
        if below:
            continue
        lines.append(line)
        frame = _FRAME.match(line)
        if frame:
            source = linecache.getline(frame.group(1), int(frame.group(2))).strip()
            if source:
                lines.append(f"    {source}")
    return "\n".join(lines)
