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

The follower visits running tasks only (the kernel adds a task when it starts and removes it
when it is delivered), one :meth:`Follower.visit` each, and a visit reads nothing when the
task's files have not grown since the last one (a ``stat`` of each dir, an ``fstat`` of each
open output file): a visit costs the same however many tasks have run or wait. When the
kernel stops a running task, :mod:`hetflow.executors.stacks` asks the ranks for their stacks.

The channel is the file system: the dir is the client's own and owner-only, and only text
and file names are read from it; no socket is opened and nothing is unpickled.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Dict, Optional

from hetflow._private import private_dir
from hetflow.executors import _rankio
from hetflow.executors.stacks import stacks, with_source  # noqa: F401 - their old home

logger = logging.getLogger("hetflow.tasks")

#: How much of a task's captured output its record keeps.
TAIL_BYTES = 64 * 1024
#: How often the follower reads the running tasks' files.
POLL_S = 0.05
#: A dir changed this recently may change again within the same timestamp (file systems
#: stamp with a coarse clock): it is read again at the next visit all the same.
RECENT_NS = 100_000_000
#: Default seconds between a task's first rank returning and the warning about the others.
HANG_WARNING_S = 30.0
#: The named ``output`` modes.
MODES = ("console", "files", "off")


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
                 write_lock: threading.Lock, paused=None, made: bool = True):
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
        self._read_to: Dict[int, int] = {}     # rank -> bytes of its output read so far
        self._stamps: tuple = ()               # the dirs' mtimes when last read
        self._partial: Dict[int, bytes] = {}
        self._tail = bytearray()
        self._log = None
        self.returned: Dict[int, float] = task.times.returned
        self.warned = False
        self.closed = False
        self.made = made       # False: its ranks write no files (nothing to read or remove)

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
            data = handle.read()
        except OSError:
            return b""
        self._read_to[rank] = self._read_to.get(rank, 0) + len(data)
        return data

    def grown(self) -> bool:
        """Whether the task's files may hold something not read yet: a file made or removed
        in a dir (its mtime moved, or moved too recently to tell), or an output file longer
        than what was read of it."""
        now = time.time_ns()
        stamps = []
        for directory in self.directories:
            try:
                stamps.append(os.stat(directory).st_mtime_ns)
            except OSError:
                stamps.append(None)
        stamps = tuple(stamps)
        changed = stamps != self._stamps or any(s is not None and now - s < RECENT_NS
                                                for s in stamps)
        self._stamps = stamps
        if changed:
            return True
        for rank, handle in self._handles.items():
            try:
                if os.fstat(handle.fileno()).st_size > self._read_to.get(rank, 0):
                    return True
            except (OSError, ValueError):
                return True
        return False

    def follow(self, hang_warning_s: float) -> None:
        """One visit of the follower: read what was written, note returned ranks, warn about
        a hang; a task whose files have not grown costs a ``stat`` per dir and nothing more."""
        with self._mutex:
            if self.closed:
                return
            if self.made and self.grown():
                self.poll()
                self._scan_returned()
            self._warn(hang_warning_s)

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
        self._scan_returned()
        self._warn(hang_warning_s)

    def _scan_returned(self) -> None:
        for rank in range(self.ranks):
            if rank not in self.returned:
                for directory in self.directories:
                    try:
                        self.returned[rank] = os.stat(os.path.join(
                            directory, _rankio.returned_name(rank))).st_mtime
                        break
                    except OSError:
                        continue

    def _warn(self, hang_warning_s: float) -> None:
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
            self._handles, self._partial, self._read_to = {}, {}, {}
            if self._log is not None:
                self._log.close()
                self._log = None
            if not success or not self.made:
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
    """The thread that reads every running task's files (one per runtime ``label``, whose
    tasks' dirs are in ``node_root`` and ``run_root``)."""

    def __init__(self, label: str, node_root: str, run_root: str, output, hang_warning_s,
                 progress=lambda: None):
        self._name = f"{label}-output"
        self.label, self.node_root, self.run_root, self.output = label, node_root, run_root, output
        self._hang_warning_s = hang_warning_s   # a callable: the runtime's setting now
        self._progress = progress               # a callable: the runtime's progress bar, or None
        self._tasks: Dict[int, TaskFiles] = {}
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.write_lock = threading.Lock()

    def directories(self, task_id: int) -> tuple:
        """A task's files dirs: for ranks on this node (in memory where it can) and for ranks
        elsewhere (in the run dir, which the nodes share)."""
        name = f"task-{task_id:06d}"
        return os.path.join(self.node_root, name), os.path.join(self.run_root, name)

    def follow(self, task, make: bool = True) -> None:
        """Make the task's node-local files dir (owner-only; ``make=False``: its ranks write
        none) and follow it while it runs (the hang watch)."""
        if task.files is None:
            # A task whose ranks write no files dir has none to read, list or remove.
            directories = self.directories(task.id) if make else ()
            if make:
                try:   # in the owner-only node root: mkdir's mode can only narrow under a umask
                    os.mkdir(directories[0], 0o700)
                except OSError:  # there already, or its parents are not: tightened or made
                    private_dir(directories[0])
            task.files = TaskFiles(task, self.label, directories, self.output, self.run_root,
                                   self.write_lock, getattr(self._progress(), "paused", None),
                                   made=make)
        self.add(task.files)

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

    def visit(self, files: TaskFiles, hang_warning_s: float) -> None:
        """The follower's work for one running task, each :data:`POLL_S`."""
        files.follow(hang_warning_s)

    def _run(self) -> None:
        while not self._closed:
            with self._mutex:
                tasks = list(self._tasks.values())
            hang_warning_s = self._hang_warning_s()
            for files in tasks:
                try:
                    self.visit(files, hang_warning_s)
                except Exception:  # one task's files must not stop the others' (logged)
                    logger.exception("%s: reading task %s's files failed", self._name,
                                     files.task.id)
            self._wake.wait(POLL_S)
