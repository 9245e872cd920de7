"""Rank side of resource sampling (the standard library and the payload module, which every
rank imports anyway: ranks start fast).

While a rank runs its share of a task with sampling on (the payload's ``files`` carries an
interval), a thread of the rank reads the rank process's own use and appends one JSON line
per sample to ``samples-<rank>.jsonl`` in the task's files dir (owner-only, beside the
rank's output; see :mod:`hetflow.executors._rankio`): one when the function starts, one
every interval, one when it returns (the first is written with the second). The client reads the lines
(:mod:`hetflow.executors.monitoring`); nothing in them is ever unpickled.

A sample's fields:

===================  ============================================================
``time``             ``time.time()`` when it was read
``rank``, ``pid``,   the rank, its process id and node
``host``
``cpu_user_s``,      CPU seconds of the rank process (its threads, and children it
``cpu_system_s``     has waited for) since it started
``cpu_percent``      CPU used since the previous sample, in percent of one core
                     (the first sample: 0)
``rss``, ``vms``     resident and virtual memory, bytes
``memory_percent``   ``rss`` against the node's memory
``ctx_voluntary``,   context switches (voluntary, involuntary), bytes read and
``ctx_involuntary``, written (``/proc/self/io``; null in the first and last samples)
``read_bytes``,
``write_bytes``
``gpus``             one entry per GPU bound to the rank (``CUDA_VISIBLE_DEVICES``):
                     ``index``, ``utilization`` (percent), ``memory_used`` (bytes, the
                     device), ``process_memory`` (bytes, this rank); null when none,
                     and in the first sample (a query can take tens of milliseconds)
``gpu_note``         why ``gpus`` is null: no GPU bound to the rank, no way to read it,
                     or the first sample
``final``            true for the sample taken when the function returned
===================  ============================================================

A task that ends within its first interval writes no file: its two samples travel with the
rank's outcome as tuples (:data:`FIELDS`, :attr:`Sampler.compact`), made the dicts above by
:func:`expand` where they are read.

Linux's ``/proc`` gives everything but the CPU times (``resource.getrusage``); elsewhere
those fields are null. GPUs are read through NVML (``pynvml``, where installed) or
``nvidia-smi``.
"""
from __future__ import annotations

import _thread
import math
import os
import struct
import time

from hetflow.executors.payload import host


def sample_name(rank: int) -> str:
    return f"samples-{rank}.jsonl"


def _proc(name: str) -> bytes:
    # os.open/os.read, not open(): a text file object costs several times the read itself.
    try:
        fd = os.open(f"/proc/self/{name}", os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.read(fd, 4096)
    except OSError:
        return b""
    finally:
        os.close(fd)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
try:
    _MEMORY = os.sysconf("SC_PHYS_PAGES") * _PAGE
except (AttributeError, ValueError, OSError):
    _MEMORY = 0
_HOST = host()      # the payload's: one uname a process

#: This process's id, and its ``/proc/self/statm`` kept open (read again with ``pread``
#: at offset 0, which the kernel answers afresh: 2.4 us a read, against 5.7 us to open,
#: read and close it); both forgotten in a forked child, whose /proc/self is another.
_pid = os.getpid()
_statm = -1
#: CPU seconds ``(user, system)`` of the children this process has waited for, as last read.
_children = None


def _forked() -> None:
    global _pid, _statm, _children
    _pid, _statm, _children = os.getpid(), -1, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _memory() -> tuple:
    """``(rss, vms)`` of this process in bytes, ``(None, None)`` where unreadable."""
    global _statm
    try:
        if _statm < 0:
            _statm = os.open("/proc/self/statm", os.O_RDONLY)
        statm = os.pread(_statm, 128, 0).split()
        return int(statm[1]) * _PAGE, int(statm[0]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None, None


def _usage(children: bool) -> tuple:
    """``(cpu_user_s, cpu_system_s, ctx_voluntary, ctx_involuntary)`` of this process and
    the children it has waited for. ``children`` False: the children's CPU as last read
    (one ``getrusage`` a sample, not two)."""
    import resource

    global _children
    own = resource.getrusage(resource.RUSAGE_SELF)
    if children or _children is None:
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        _children = (waited.ru_utime, waited.ru_stime)
    return (own.ru_utime + _children[0], own.ru_stime + _children[1], own.ru_nvcsw,
            own.ru_nivcsw)


def _io() -> tuple:
    """``(read_bytes, write_bytes)`` from ``/proc/self/io`` (None where unreadable)."""
    counts = {}
    for line in _proc("io").splitlines():
        key, _, value = line.partition(b":")
        if key in (b"rchar", b"wchar"):
            counts[key] = int(value)
    return counts.get(b"rchar"), counts.get(b"wchar")


#: A sample as it is taken and carried: a tuple of these fields, in this order (a dict of
#: 17 keys per sample, built and pickled on the rank and unpickled on the client, cost a
#: no-op task more than the reading did); :func:`expand` makes the dicts where they are read.
FIELDS = ("time", "cpu_user_s", "cpu_system_s", "ctx_voluntary", "ctx_involuntary", "rss",
          "vms", "read_bytes", "write_bytes", "cpu_percent", "gpus", "gpu_note", "final")


def expand(carried, rank: int) -> list:
    """The samples of ``carried`` (``(pid, host, node memory, rows)``: a rank's
    :attr:`Sampler.compact`; or ``(pid, host, bytes)``, the same :func:`pack` packed) as
    the dicts the fields above describe; ``[]`` for anything else."""
    try:
        if len(carried) == 3:       # (pid, host, packed): as the pool's client received them
            carried = unpack(carried[2], carried[0], carried[1])
        pid, host, memory, rows = carried
        return [_as_dict(row, rank, pid, host, memory) for row in rows
                if isinstance(row, tuple) and len(row) == len(FIELDS)]
    except (TypeError, ValueError, struct.error):
        return []


#: A quick task's two samples packed (:func:`pack`): the node's memory, then per sample its
#: time, CPU seconds (user, system), context switches, rss, vms and CPU percent.
_PACKED = struct.Struct("<q" + "dddqqqqd" * 2)
#: Its size in bytes.
SAMPLES_PACKED = _PACKED.size
_NO_GPU = "no GPU bound to this rank"


def pack(compact, pid: int, host: str):
    """``compact`` (a rank's carried samples) as :data:`_PACKED`'s bytes, where it holds
    nothing else: the first and last samples of this rank's process, no GPU bound, no I/O
    counters (every quick task on a node without GPUs); None otherwise."""
    try:
        own_pid, own_host, memory, rows = compact
        first, last = rows
        if own_pid != pid or own_host != host or first[12] or not last[12]:
            return None
        for row in rows:
            if row[7:9] != (None, None) or row[10] is not None or row[11] != _NO_GPU:
                return None
        return _PACKED.pack(memory, *first[:7], first[9], *last[:7], last[9])
    except (TypeError, ValueError, struct.error):
        return None


def unpack(data: bytes, pid: int, host: str) -> tuple:
    """The carried samples :func:`pack` packed (the outcome's ``pid`` and ``host``)."""
    v = _PACKED.unpack(data)
    return pid, host, v[0], ((*v[1:8], None, None, v[8], None, _NO_GPU, False),
                             (*v[9:16], None, None, v[16], None, _NO_GPU, True))


def _as_dict(row: tuple, rank: int, pid: int, host: str, memory: int) -> dict:
    (now, user, system, voluntary, involuntary, rss, vms, read, written, percent, gpus, note,
     final) = row
    return {"pid": pid, "host": host, "cpu_user_s": user, "cpu_system_s": system,
            "ctx_voluntary": voluntary, "ctx_involuntary": involuntary, "rss": rss,
            "vms": vms,
            "memory_percent": 100.0 * rss / memory if rss is not None and memory else None,
            "read_bytes": read, "write_bytes": written, "time": now, "rank": rank,
            "cpu_percent": percent, "gpus": gpus, "gpu_note": note, "final": final}


def read_gpus(visible) -> tuple:
    """``(gpus, note)`` for the devices in ``visible`` (``CUDA_VISIBLE_DEVICES``): a list of
    dicts, or None and why not."""
    if visible is None or not visible.strip():
        return None, "no GPU bound to this rank"
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    note = ""
    try:
        return _nvml(ids), ""
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - NVML present but failing: try the CLI
        note = f"NVML failed ({exc}); "
    try:
        return _smi(ids), ""
    except FileNotFoundError:
        return None, note + f"GPU(s) {visible} bound, but neither pynvml nor nvidia-smi is here"
    except Exception as exc:  # noqa: BLE001 - a sample without GPU data says why
        return None, note + f"nvidia-smi failed: {exc}"


def _nvml(ids) -> list:
    import pynvml

    pynvml.nvmlInit()
    gpus = []
    for device_id in ids:
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(device_id)) if device_id.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(device_id))
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == os.getpid()]
        gpus.append({"index": device_id,
                     "utilization": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                     "memory_used": pynvml.nvmlDeviceGetMemoryInfo(handle).used,
                     "process_memory": (mine[0] or 0) if mine else 0})
    return gpus


def _smi(ids) -> list:
    import subprocess

    def query(kind, fields):
        out = subprocess.run(["nvidia-smi", f"--query-{kind}={fields}", "-i", ",".join(ids),
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line]

    mine = sum(int(used) for pid, used in query("compute-apps", "pid,used_memory")
               if pid == str(os.getpid()) and used.isdigit()) * 2**20
    gpus = [{"index": index, "utilization": int(util), "memory_used": int(used) * 2**20,
             "process_memory": 0} for index, util, used in query("gpu", "index,utilization.gpu,memory.used")]
    if gpus:
        gpus[0]["process_memory"] = mine     # nvidia-smi -i gives this rank's total, not per device
    return gpus


#: The task this process samples now (a rank runs one task at a time), for :func:`_loop`.
_current = None
#: Held while the sampling thread may sleep; released to wake it.
_wake = _thread.allocate_lock()
_wake.acquire()
_running = False
#: When the sampling thread looks next (``time.monotonic()``; inf: not before it is woken).
_looks_at = math.inf


def _loop() -> None:
    """The process's sampling thread: one for the life of the process, so a rank that runs
    many tasks starts it once. It wakes every interval, task or not: a task that starts
    wakes it only when its next look is further away than the task's interval (waking it
    for every task cost the task a hand-over of the interpreter lock, about 1 ms on a
    loaded machine)."""
    global _looks_at
    interval = None
    while True:
        current = _current
        if current is not None and current.interval > 0:
            interval = current.interval
        if interval is None:
            _looks_at = math.inf
            woke = _wake.acquire()
        else:
            _looks_at = time.monotonic() + interval
            woke = _wake.acquire(timeout=interval)
        current = _current
        if woke or current is None:
            continue
        with current.mutex:
            if not current.closed and time.time() - current.last >= current.interval / 2:
                current.take(final=False)
                current.flush()


def _start_thread() -> None:
    global _running
    if not _running:
        try:
            _thread.start_new_thread(_loop, ())     # not waited for, unlike threading's
            _running = True
        except RuntimeError:       # no thread to be had: the first and last samples only
            pass


class Sampler:
    """One rank's sampling for one task: a context manager around the task's function.

    What a task that ends within one interval costs is kept small: the first sample is read
    in memory (no I/O counters, no GPU query) and written with the last in one write, and one
    thread per process does the sampling in between (:func:`_loop`).
    Best-effort like the output capture: a files dir the rank cannot write costs the task
    its samples, never its run.
    """

    def __init__(self, directory: str, rank: int, interval: float):
        self.directory, self.rank, self.interval = directory, rank, interval
        self._fd = -1
        self._pending: list = []    # samples not yet written (rows: see FIELDS)
        self._cpu = 0.0             # CPU seconds at the previous sample
        self.last = 0.0             # its time
        self._visible = None        # CUDA_VISIBLE_DEVICES when the task started
        self.mutex = _thread.allocate_lock()
        self.closed = False
        #: The samples of a task that ended before anything was written (its first and last:
        #: it ran within one interval), ``(pid, host, node memory, rows)``: they go with the
        #: rank's outcome instead of a file, which cost a no-op task a file created, read and
        #: removed (~25% on pool_bench); :func:`expand` makes them the samples' dicts.
        self.compact = None
        #: The outcome that carries them, where it is made before the sampler exits.
        self.outcome = None

    @property
    def carried(self):
        """The carried samples as dicts (None: none carried, they are in the file)."""
        return None if self.compact is None else expand(self.compact, self.rank)

    def __enter__(self) -> "Sampler":
        global _current
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._visible = visible if visible and visible.strip() else None
        self.take(final=False, first=True)
        if self.interval > 0:
            _start_thread()
            _current = self
            if _looks_at > time.monotonic() + self.interval and _wake.locked():
                _wake.release()
        return self

    def __exit__(self, *exc) -> None:
        global _current
        if _current is self:
            _current = None
        with self.mutex:
            self.closed = True
            self.take(final=True)
            if self._fd < 0:
                self.compact, self._pending = (_pid, _HOST, _MEMORY, tuple(self._pending)), []
                if self.outcome is not None:
                    self.outcome.samples = self.compact
                return
            self.flush()
            os.close(self._fd)
            self._fd = -1

    def take(self, final: bool, first: bool = False) -> None:
        try:
            # One getrusage a first sample: the CPU of the children this process waited
            # for is read in every other sample, and the first takes it as last read (a
            # pool rank runs nothing between two tasks that could wait for a child; a
            # thread a task left running that did would have the child's CPU counted in the
            # next task). No I/O counters in the first and last samples (each /proc file
            # read cost a rank 35-60 us on a loaded machine, a no-op task's whole run
            # ~2 ms); the memory is in every one (parsl-visualize's resource page fails on
            # a null).
            user, system, voluntary, involuntary = _usage(children=not first)
            rss, vms = _memory()
            read, written = (None, None) if first or final else _io()
            now = time.time()
            cpu = user + system
            percent = 0.0
            if not first and 0 < self.last < now:
                percent = 100.0 * (cpu - self._cpu) / (now - self.last)
            self._cpu, self.last = cpu, now
            if self._visible is None:
                gpus, note = None, _NO_GPU
            elif first:
                gpus, note = None, "GPUs are not read when the task starts"
            else:
                gpus, note = read_gpus(self._visible)
            self._pending.append((now, user, system, voluntary, involuntary, rss, vms, read,
                                  written, percent, gpus, note, final))
        except Exception:  # noqa: BLE001 - a sample that fails is skipped, the task runs on
            pass

    def flush(self) -> None:
        if not self._pending:
            return
        import json

        try:
            if self._fd < 0:
                self._fd = os.open(os.path.join(self.directory, sample_name(self.rank)),
                                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            # Whole lines in one write to an O_APPEND file: the reader sees whole lines.
            os.write(self._fd, "".join(
                json.dumps(_as_dict(row, self.rank, _pid, _HOST, _MEMORY)) + "\n"
                for row in self._pending).encode())
        except OSError:
            pass
        self._pending = []


class _Off:
    carried = compact = outcome = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def sampling(capture, files, rank: int):
    """The sampler for this rank and task (see :class:`Sampler`), or nothing: sampling off
    (``files`` carries no interval) or no files dir. A rank in the client's own process (the
    debug runtime) captures no output, but samples into the task's node-local files dir."""
    interval = files.sample_s if files else None
    directory = getattr(capture, "directory", None)
    if directory is None and interval is not None and files.client_pid == _pid \
            and files.client_host == _HOST and os.path.isdir(files.here):
        directory = files.here
    if interval is None or directory is None:
        return _Off()
    return Sampler(directory, rank, interval)
