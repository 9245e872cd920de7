"""Client side of what ranks say while a task runs: their output, which of them returned, and
their stacks when the task is stopped.

The kernel gives every task two files dirs (owner-only, 0700), named ``task-NNNNNN``: one in
memory on the client's node (:func:`node_root`, made before the runtime starts the task), for
ranks on that node, and one in the run dir, made by a rank on another node; each rank writes
its files in one of them (the table is in :mod:`hetflow.executors._rankio`). One
:class:`Follower` thread per runtime reads the dirs of the running tasks every :data:`POLL_S`:

- each rank's output, cut into whole lines and handed on in the order each rank wrote them,
  prefixed ``[task N rank R]``, to the runtime's ``output``: the client's stdout
  (``"console"``, the default), a file per task (``"files"``: ``<runtime dir>/output/
  task-NNNNNN.log``), a stream given instead, or nowhere (``"off"``: the ranks' output is
  not captured at all and goes where their launcher sends it); the last :data:`TAIL_BYTES`
  stay on the task's record either way (``hetflow.task_output``);
- the ``returned-<r>`` marks: when some ranks have returned and others still run
  ``hang_warning_s`` later, one warning (logger ``hetflow.tasks``) names them;
  ``task_times(f).returned`` holds when each returned.

When the kernel stops a running task (walltime, cancel, shutdown), :func:`stacks` asks each
rank that has not returned for its stacks (``SIGUSR1``: faulthandler writes them even while
the rank waits inside MPI) and the error carries them, each frame with its source line.

The channel is the file system: the dir is the client's own and owner-only, and only text
and file names are read from it; no socket is opened and nothing is unpickled. A rank is
signalled only when ``/proc/<pid>/fd`` shows it holding that task's stack file open: a pid
that is not the rank (reused, or on another node) is never signalled.
"""
from __future__ import annotations

import contextlib
import linecache
import logging
import os
import re
import sys
import threading
import time
from typing import Dict, Optional

from hetflow._private import private_dir
from hetflow.executors import _rankio

logger = logging.getLogger("hetflow.tasks")

#: How much of a task's captured output its record keeps.
TAIL_BYTES = 64 * 1024
#: How often the follower reads the running tasks' files.
POLL_S = 0.05
#: How long a stopped task's ranks get to write their stacks.
STACK_WAIT_S = 1.0
#: Default seconds between a task's first rank returning and the warning about the others.
HANG_WARNING_S = 30.0
#: The named ``output`` modes.
MODES = ("console", "files", "off")

_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in ')


def check_output(output) -> None:
    """Raise ConfigError for an ``output`` that is neither a mode nor a writable stream."""
    if output in MODES or (not isinstance(output, str) and hasattr(output, "write")):
        return
    from hetflow.errors import ConfigError

    raise ConfigError(f"output must be one of {list(MODES)} or a writable text stream, "
                      f"got {output!r}")


class TaskFiles:
    """One task's files dirs as the client follows them."""

    def __init__(self, task, label: str, directories, output, run_root: str,
                 write_lock: threading.Lock, paused=None):
        #: Where ranks on the client's node write (first), and ranks elsewhere.
        self.task, self.label, self.directories = task, label, tuple(directories)
        self.ranks = task.resources.ranks
        self.output = output
        self.run_root = run_root
        self._write_lock = write_lock
        self._paused = paused      # a context that clears a progress bar while lines print
        # Reentrant: the follower and a thread stopping the task both read ``returned``.
        self._mutex = threading.RLock()
        self._handles: Dict[int, object] = {}
        self._partial: Dict[int, bytes] = {}
        self._tail = bytearray()
        self._log = None
        self.returned: Dict[int, float] = task.times.returned
        self.warned = False
        self.closed = False

    # ------------------------------------------------------------------ output
    def poll(self, final: bool = False) -> None:
        """Hand on every whole line written since the last poll (``final``: the rest too)."""
        with self._mutex:
            if self.closed or self.output == "off":    # off: the ranks write no out-<r>
                return
            lines = []
            for rank in range(self.ranks):
                data = self._read(rank)
                if data:
                    data = self._partial.pop(rank, b"") + data
                    cut = data.rfind(b"\n") + 1
                    if cut < len(data):
                        self._partial[rank] = data[cut:]
                    lines.extend(self._prefixed(rank, data[:cut]))
                if final and self._partial.get(rank):
                    lines.extend(self._prefixed(rank, self._partial.pop(rank) + b"\n"))
            if lines:
                self._emit(lines)

    def _read(self, rank: int) -> bytes:
        handle = self._handles.get(rank)
        if handle is None:
            for directory in self.directories:
                try:
                    handle = open(os.path.join(directory, _rankio.out_name(rank)), "rb")
                    break
                except OSError:
                    continue
            else:
                return b""
            self._handles[rank] = handle
        try:
            return handle.read()
        except OSError:
            return b""

    def _prefixed(self, rank: int, data: bytes) -> list:
        prefix = f"[task {self.task.id} rank {rank}] "
        return [prefix + line + "\n"
                for line in data.decode("utf-8", "replace").split("\n")[:-1]]

    def _emit(self, lines: list) -> None:
        text = "".join(lines)
        self._tail += text.encode()
        if len(self._tail) > TAIL_BYTES:
            del self._tail[:len(self._tail) - TAIL_BYTES]
        if self.output == "files":
            if self._log is None:
                folder = private_dir(os.path.join(self.run_root, "output"))
                self._log = open(os.path.join(folder, f"task-{self.task.id:06d}.log"), "a",
                                 opener=lambda p, f: os.open(p, f, 0o600))
            self._log.write(text)
            self._log.flush()
            return
        stream = sys.stdout if self.output == "console" else self.output
        with self._write_lock, (self._paused() if self._paused else _nothing()):
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):   # a closed console: the record keeps the tail
                pass

    def text(self) -> str:
        """The last :data:`TAIL_BYTES` of the task's prefixed lines."""
        with self._mutex:
            return bytes(self._tail).decode("utf-8", "replace")

    # ------------------------------------------------------------------ returned ranks
    def check_returned(self, hang_warning_s: float) -> None:
        with self._mutex:
            self._check_returned(hang_warning_s)

    def _check_returned(self, hang_warning_s: float) -> None:
        for rank in range(self.ranks):
            if rank not in self.returned:
                for directory in self.directories:
                    try:
                        self.returned[rank] = os.stat(os.path.join(
                            directory, _rankio.returned_name(rank))).st_mtime
                        break
                    except OSError:
                        continue
        if self.warned or not self.returned or len(self.returned) >= self.ranks \
                or self.task.done:
            return
        first = min(self.returned.values())
        if time.time() - first >= hang_warning_s:
            self.warned = True
            logger.warning("%s", self.hang_text(hang_warning_s))

    def hang_text(self, waited: Optional[float] = None, named: bool = True) -> str:
        """Which ranks returned (and when, from the launch) and which still run."""
        with self._mutex:
            return self._hang_text(waited, named)

    def _hang_text(self, waited, named) -> str:
        launched = self.task.times.launched
        done = ", ".join(f"{r} at +{max(0.0, t - launched):.1f} s"
                         for r, t in sorted(self.returned.items()))
        running = self.running()
        text = (f"task {self.task.id} ({self.label}): " if named else "") + (
            f"rank(s) {sorted(self.returned)} returned ({done}) but rank(s) {running} "
            f"were still running")
        if waited is not None:
            text += (f" {waited:g} s later; a collective called on only some ranks waits "
                     f"forever (stacks come with the error when the task is stopped)")
        return text

    def running(self) -> list:
        with self._mutex:
            return [r for r in range(self.ranks) if r not in self.returned]

    # ------------------------------------------------------------------ the end
    def close(self, success: bool) -> None:
        """Last read, then close; a successful task's files are removed."""
        self.poll(final=True)
        with self._mutex:
            self.closed = True
            for handle in self._handles.values():
                handle.close()
            if self._log is not None:
                self._log.close()
            if not success:
                return
            for directory in self.directories:
                try:
                    names = os.listdir(directory)
                except OSError:  # no rank wrote there
                    continue
                for name in names:
                    if name.startswith(("out-", "stack-", "returned-", "samples-")):
                        _unlink(os.path.join(directory, name))
                try:
                    os.rmdir(directory)
                except OSError:  # the runtime's own files are there too: its dir to remove
                    pass


@contextlib.contextmanager
def _nothing():
    yield


def node_root(run_root: str, label: str) -> str:
    """Where ranks on the client's node write: a fresh owner-only dir in memory
    (``/dev/shm``: a file there costs microseconds, on a busy disk milliseconds, per
    task), else the run dir. Named after the client's pid: if the client is killed, its
    guardian removes it (``hetflow._guardian``)."""
    import tempfile

    try:
        return tempfile.mkdtemp(prefix=f"hetflow-{os.getpid()}-{label}-", dir="/dev/shm")
    except OSError:
        return run_root


def remove_node_root(root: str, run_root: str) -> None:
    if root != run_root:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Follower:
    """The thread that reads every running task's files (one per runtime)."""

    def __init__(self, name: str, hang_warning_s):
        self._name = name
        self._hang_warning_s = hang_warning_s   # a callable: the runtime's setting now
        self._tasks: Dict[int, TaskFiles] = {}
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.write_lock = threading.Lock()

    def add(self, files: TaskFiles) -> None:
        with self._mutex:
            self._tasks[files.task.id] = files
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def remove(self, files: TaskFiles) -> None:
        with self._mutex:
            if self._tasks.get(files.task.id) is files:
                del self._tasks[files.task.id]

    def close(self) -> None:
        with self._mutex:       # add() starts the thread under it: seen here, it has started
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed:
            with self._mutex:
                tasks = list(self._tasks.values())
            for files in tasks:
                try:
                    files.poll()
                    files.check_returned(self._hang_warning_s())
                except Exception:  # one task's files must not stop the others' (logged)
                    logger.exception("%s: reading task %s's files failed", self._name,
                                     files.task.id)
            self._wake.wait(POLL_S)


# ---------------------------------------------------------------------- stacks
def stacks(directories, ranks, wait_s: float = STACK_WAIT_S) -> Dict[int, str]:
    """Ask ranks ``ranks`` of the task whose files dirs are ``directories`` for their Python
    stacks; ``{rank: text}`` for those that answered within ``wait_s``."""
    asked = {}
    names = []
    for directory in directories:
        try:
            names += [(directory, name) for name in os.listdir(directory)]
        except OSError:
            continue
    for directory, name in names:
        match = re.fullmatch(r"stack-(\d+)-(\d+)\.txt", name)
        if not match or int(match.group(1)) not in ranks:
            continue
        rank, pid, path = int(match.group(1)), int(match.group(2)), os.path.join(directory, name)
        if not _holds(pid, path):
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
