"""Client side of per-rank resource monitoring: the ranks' samples, on the task's record and
in Parsl's monitoring database.

Sampling is on for a runtime when ``hetflow.runtime(..., sample_s=S)`` asks for it, or when
Parsl's resource monitoring does: ``monitoring=MonitoringHub(resource_monitoring_enabled=True,
resource_monitoring_interval=S)``. Every rank of every task then samples its own process
every ``S`` seconds (:mod:`hetflow.executors._ranksample`, which lists the fields) into the
task's files dir; one thread of the client (:class:`Monitor`) reads the new lines of the
running tasks every ``min(S, 1)`` seconds and at delivery, keeps them on the task's record
(``hetflow.task_samples``) and, under a MonitoringHub, sends each as a ``RESOURCE_INFO``
message in the form Parsl's own task monitor sends (``parsl.monitoring.remote.monitor``): a
row of Parsl's ``resource`` table per sample, one series per rank process
(``psutil_process_pid``). ``parsl-visualize`` shows them.

How Parsl is told: with resource monitoring on, Parsl's DataFlowKernel wraps each app in
its ``monitor_wrapper`` and requires the executor to declare a ``remote_monitoring_radio``.
hetflow's kernel declares Parsl's ``MultiprocessingQueueRadio`` (the executor lives in the
client's process, as Parsl's ThreadPoolExecutor does, so messages go straight onto the
hub's queue) and takes the wrapper off again before the task is pickled (:func:`unwrap`):
the wrapper would import Parsl and start a monitor process on every rank, watching one rank
each. The messages the wrapper sends, the try's start on a node and its end
(``WORKER_TASK_INFO``), the kernel sends itself: when a task's first sample arrives, and at
delivery. GPU samples stay on the task's record: Parsl's table has no GPU columns.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from typing import Dict, List, Optional

from hetflow.executors._ranksample import expand, sample_name

logger = logging.getLogger(__name__)

#: The keyword arguments Parsl's monitor_wrapper adds to a call.
_PARSL_TASK, _PARSL_TRY = "_parsl_monitoring_task_id", "_parsl_monitoring_try_id"
#: MonitoringHub's default resource_monitoring_interval (if the wrapper's cannot be read).
PARSL_DEFAULT_S = 30.0
#: The most seconds between two reads of the running tasks' samples.
READ_S = 1.0


def radio():
    """The radio a hetflow executor declares to Parsl (None on a Parsl without radios)."""
    try:
        from parsl.monitoring.radios.multiprocessing import MultiprocessingQueueRadio
    except ImportError:
        return None
    return MultiprocessingQueueRadio()


def unwrap(func, kwargs: dict):
    """``(func, kwargs, parsl_ids, interval)``: the app without Parsl's monitor_wrapper, and
    what the wrapper carried (Parsl's ``(task_id, try_id)``, and its resource monitoring
    interval); ``parsl_ids`` None for a call Parsl did not wrap."""
    if _PARSL_TASK not in kwargs or not hasattr(func, "__wrapped__"):
        return func, kwargs, None, None
    kwargs = dict(kwargs)
    ids = (kwargs.pop(_PARSL_TASK), kwargs.pop(_PARSL_TRY))
    # The interval is a variable of the wrapper's closure (the DFK's resource_monitoring_interval).
    cells = dict(zip(func.__code__.co_freevars, func.__closure__ or ()))
    interval = cells["sleep_dur"].cell_contents if "sleep_dur" in cells else PARSL_DEFAULT_S
    return func.__wrapped__, kwargs, ids, interval


class TaskSamples:
    """One task's samples, by rank, as read so far from its files dirs."""

    def __init__(self, task_id: int, directories, ranks: int, interval: float,
                 parsl_ids: Optional[tuple] = None):
        self.task_id, self.directories, self.ranks = task_id, tuple(directories), ranks
        self.interval, self.parsl_ids = interval, parsl_ids
        self.by_rank: Dict[int, List[dict]] = {}
        self._offsets: Dict[int, tuple] = {}     # rank -> (path, bytes read)
        self._stamps: set = set()
        self.started = False       # Parsl was told the try runs
        self._mutex = threading.Lock()
        #: rank -> the samples that came with its outcome, as they came (None: made dicts).
        self._carried: dict = {}
        #: Every rank's samples came with its outcome: no rank left a file to read.
        self.all_carried = False
        self._pending: List[dict] = []

    def carry(self, outcomes: dict) -> None:
        """Keep the samples that came with the ranks' outcomes (a rank that ended within
        its first interval writes no file: ``_ranksample.Sampler``) as they came: they
        become dicts where they are read (:meth:`read`, :meth:`snapshot`), not per task."""
        with self._mutex:
            for rank, outcome in outcomes.items():
                compact = getattr(outcome, "samples", None)
                if compact is not None and rank not in self._carried and \
                        0 <= rank < self.ranks:
                    self._carried[rank] = compact
            self.all_carried = len(self._carried) >= self.ranks

    def _expand(self) -> None:
        for rank, compact in self._carried.items():
            if compact is not None:
                rows = expand(compact, rank)
                self._carried[rank] = None
                self._pending += rows
                self.by_rank.setdefault(rank, []).extend(rows)

    def read(self) -> List[dict]:
        """The samples written since the last read (whole lines only), and those carried."""
        with self._mutex:
            self._expand()
            new, self._pending = self._pending, []
            for rank in range(self.ranks):
                if rank not in self._carried:
                    new += self._read_rank(rank)
        return new

    def read_files(self) -> None:
        """Read the lines written since the last read onto the record (for :meth:`snapshot`)."""
        with self._mutex:
            for rank in range(self.ranks):
                if rank not in self._carried:
                    self._read_rank(rank)

    def _read_rank(self, rank: int) -> List[dict]:
        path, offset = self._offsets.get(rank, (None, 0))
        data = None
        for candidate in (path,) if path else (os.path.join(d, sample_name(rank))
                                               for d in self.directories):
            try:
                fd = os.open(candidate, os.O_RDONLY)
            except OSError:
                continue
            try:
                data = os.pread(fd, 1 << 24, offset)
            finally:
                os.close(fd)
            path = candidate
            break
        if not data:
            if path is not None:
                self._offsets[rank] = (path, offset)
            return []
        cut = data.rfind(b"\n") + 1
        self._offsets[rank] = (path, offset + cut)
        samples = []
        for line in data[:cut].splitlines():
            try:
                sample = json.loads(line)
            except ValueError:
                continue
            if isinstance(sample, dict) and sample.get("rank") == rank:
                samples.append(sample)
        self.by_rank.setdefault(rank, []).extend(samples)
        return samples

    def snapshot(self) -> Dict[int, List[dict]]:
        """``{rank: [sample, ...]}`` as read so far."""
        with self._mutex:
            self._expand()
            return {rank: list(rows) for rank, rows in sorted(self.by_rank.items())}

    def stamp(self, seconds: float) -> datetime.datetime:
        """A local timestamp for ``seconds``, unique within the task: Parsl's resource table
        keys a row by task, try and timestamp, so two ranks' samples must not share one."""
        stamp = datetime.datetime.fromtimestamp(seconds)
        while stamp in self._stamps:
            stamp += datetime.timedelta(microseconds=1)
        self._stamps.add(stamp)
        return stamp


def resource_message(samples: TaskSamples, sample: dict, run_id: str) -> dict:
    """A sample as Parsl's task monitor words a ``RESOURCE_INFO`` message."""
    task_id, try_id = samples.parsl_ids
    return {"run_id": run_id, "task_id": task_id, "try_id": try_id,
            "resource_monitoring_interval": samples.interval,
            "hostname": sample["host"], "timestamp": samples.stamp(sample["time"]),
            "psutil_process_pid": sample["pid"],
            "psutil_process_memory_percent": sample["memory_percent"],
            "psutil_process_children_count": 0,
            "psutil_process_time_user": sample["cpu_user_s"],
            "psutil_process_time_system": sample["cpu_system_s"],
            "psutil_process_memory_virtual": sample["vms"],
            "psutil_process_memory_resident": sample["rss"],
            "psutil_process_disk_read": sample["read_bytes"],
            "psutil_process_disk_write": sample["write_bytes"],
            "psutil_process_status": "sleeping" if sample["final"] else "running",
            "psutil_cpu_num": None,
            "psutil_cpu_count": os.cpu_count(),
            "psutil_process_num_ctx_switches_voluntary": sample["ctx_voluntary"],
            "psutil_process_num_ctx_switches_involuntary": sample["ctx_involuntary"]}


class Monitor:
    """Reads the running tasks' samples for one executor; sends them to Parsl's hub."""

    def __init__(self, executor):
        self._executor = executor
        self._tasks: Dict[int, TaskSamples] = {}
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._read_s = READ_S

    def interval(self, parsl_interval) -> Optional[float]:
        """The sampling interval of a task: the runtime's ``sample_s``, else Parsl's."""
        own = getattr(self._executor, "sample_s", None)
        return own if own is not None else parsl_interval

    def watch(self, task, directories, interval: float, parsl_ids) -> TaskSamples:
        """Follow ``task``'s samples from now until :meth:`finish`."""
        samples = TaskSamples(task.id, directories, task.resources.ranks, interval, parsl_ids)
        with self._mutex:
            self._tasks[task.id] = samples
            self._read_s = min(self._read_s, max(interval, 0.05)) if interval > 0 else \
                self._read_s
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"{self._executor.label}-samples")
                self._thread.start()
        return samples

    def finish(self, task) -> None:
        """The task was delivered: read its last samples, tell Parsl the try ended, and
        remove its sample files."""
        samples = getattr(task, "samples", None)
        if samples is None:
            return
        with self._mutex:
            self._tasks.pop(task.id, None)
        # The files go with the task's others: their last lines are read now. Where no one
        # forwards them to Parsl, the samples that came with the outcomes stay as they came.
        if samples.parsl_ids is None or getattr(self._executor, "monitoring_messages",
                                                None) is None:
            if not samples.all_carried:
                samples.read_files()
            return
        self._forward(samples, samples.read())
        if samples.started:
            ends = [s[-1]["time"] for s in samples.by_rank.values() if s]
            self._worker_task_info(samples, max(ends), last=True,
                                   host=samples.by_rank[min(samples.by_rank)][0]["host"])

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed:
            with self._mutex:
                tasks = list(self._tasks.values())
            for samples in tasks:
                try:
                    self._forward(samples, samples.read())
                except Exception:
                    logger.exception("reading task %s's samples failed", samples.task_id)
            self._wake.wait(self._read_s)

    def _forward(self, samples: TaskSamples, new: List[dict]) -> None:
        queue = getattr(self._executor, "monitoring_messages", None)
        if not new or samples.parsl_ids is None or queue is None:
            return
        from parsl.monitoring.message_type import MessageType

        if not samples.started:
            samples.started = True
            first = min(new, key=lambda s: s["time"])
            self._worker_task_info(samples, first["time"], last=False, host=first["host"])
        run_id = self._executor.run_id
        for sample in new:
            queue.put((MessageType.RESOURCE_INFO, resource_message(samples, sample, run_id)))

    def _worker_task_info(self, samples: TaskSamples, at: float, last: bool, host: str) -> None:
        """What Parsl's monitor_wrapper sends from a worker when a try starts or ends."""
        queue = getattr(self._executor, "monitoring_messages", None)
        if queue is None:
            return
        from parsl.monitoring.message_type import MessageType

        task_id, try_id = samples.parsl_ids
        queue.put((MessageType.WORKER_TASK_INFO, {
            "run_id": self._executor.run_id, "try_id": try_id, "task_id": task_id,
            "hostname": host, "block_id": None, "first_msg": not last, "last_msg": last,
            "timestamp": datetime.datetime.fromtimestamp(at)}))
