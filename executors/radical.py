"""RADICAL-Pilot: one pilot per runtime session, each MPI task an RP MPI task inside it.

Each hetflow task becomes one RP *MPI executable task* (``ranks=R``) that runs
hetflow's shared rank-side runner, ``python -m hetflow.executors._rank TASKDIR``,
under the pilot's ``mpiexec``: the pilot's agent places and launches it, and the
ranks report through the task dir exactly as under the ``mpirun`` executor, so
values and errors are identical by construction.

Why executable tasks and not RAPTOR MPI function tasks (the Radical-Cylon way):
RAPTOR runs every task's function inside the long-lived ranks of one
``MPIWorker``; RP ignores a function task's ``timeout`` and cannot cancel it
while it runs, and a rank that crashes (``os._exit``, a segfault) takes the whole
worker down with every other task on it. Executable tasks get walltime
(``timeout``), cancellation (``cancel_tasks``) and crash isolation from the agent.
The price is an interpreter + MPI start per task (see the README's figures).
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from hetflow.errors import (ConfigError, ExecutorBroken, LaunchError, TaskCancelled, TaskLost,
                            WalltimeExceeded)
from hetflow.executors._radical_config import (LOCAL_RESOURCE, end_processes,
                                               local_resource_config, scoped_environ,
                                               write_local_config)
from hetflow.executors._rank import read_deaths, read_outcomes
from hetflow.executors.base import HetflowExecutor, collect
from hetflow.executors.launch import default_mpiexec
from hetflow.spec import Resources


def _rp():
    """``radical.pilot``, imported lazily (it is slow) and without its import-order warning.

    radical.utils warns when ``logging`` was imported first (fork-safety of its
    locks); by the time a Parsl executor starts that is always the case.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import radical.pilot as rp
    return rp


@dataclass
class _Entry:
    """One submitted task, from submission to delivery."""

    task_id: int
    future: Future
    resources: Resources
    taskdir: str
    uid: str = ""
    launched: float = float("nan")
    cancelled: bool = False
    done: bool = False


@dataclass
class StartupTimes:
    """Seconds each phase of the runtime's start and close took (for the reports)."""

    session_s: float = float("nan")
    pilot_active_s: float = float("nan")
    close_s: float = float("nan")
    killed_at_close: list = field(default_factory=list)


class RadicalExecutor(HetflowExecutor):
    """A Parsl executor that runs each MPI task inside one RADICAL-Pilot pilot.

    max_ranks: the pilot's core count (default: this machine's cores); a task
        needs ``ranks x cores_per_rank`` of them, more fails at once with
        ResourcesUnavailable; tasks that don't fit yet wait in the agent.
    resource: RP resource label. Default: hetflow's own single-node config
        (``hetflow.localhost``: the real slot count, this environment's mpiexec).
        For an HPC machine give its label (e.g. ``"tacc.frontera"``, or your own
        ``"mysite.cluster"``) and ``resource_config_dir``, a directory holding
        ``.radical/pilot/configs/resource_<site>.json``, plus what the batch
        system needs in ``pilot_description`` (``project``, ``queue``, ``nodes``, ...).
    sandbox_dir: where the RP session, pilot sandbox and logs go (default: under
        the Parsl run dir, i.e. hetflow's run dir); removed on exit unless
        ``keep_sandbox``.
    interface: network interface RP's message bridges bind to (``"lo"`` keeps a
        local pilot on loopback; None lets RP choose, as a multi-node pilot needs).
    start_timeout: seconds to wait for the pilot to become active.
    """

    def __init__(self, label: str = "radical", *, max_ranks: Optional[int] = None,
                 resource: Optional[str] = None, resource_config_dir: Optional[str] = None,
                 pilot_description: Optional[Dict[str, Any]] = None,
                 sandbox_dir: Optional[str] = None, keep_sandbox: bool = False,
                 interface: Optional[str] = "lo", mpiexec: Optional[str] = None,
                 python: Optional[str] = None, start_timeout: float = 300.0,
                 pilot_runtime_min: int = 24 * 60, gpus: Optional[int] = None):
        super().__init__(label=label, max_ranks=max_ranks, gpus=gpus)
        if resource_config_dir is not None and resource is None:
            raise ConfigError("resource_config_dir needs resource=<site>.<machine> (the label "
                              "of a config in that dir)")
        if resource_config_dir is not None and not os.path.isdir(resource_config_dir):
            raise ConfigError(f"resource_config_dir {resource_config_dir!r} is not a directory")
        if not (isinstance(start_timeout, (int, float)) and start_timeout > 0):
            raise ConfigError(f"start_timeout must be > 0 seconds, got {start_timeout!r}")
        self.resource = resource or LOCAL_RESOURCE
        self.resource_config_dir = resource_config_dir
        self.pilot_description = dict(pilot_description or {})
        self.sandbox_dir = sandbox_dir
        self.keep_sandbox = keep_sandbox
        self.interface = interface
        self.mpiexec = mpiexec or default_mpiexec()
        self.python = python or sys.executable
        self.start_timeout = float(start_timeout)
        self.pilot_runtime_min = pilot_runtime_min
        if self.resource == LOCAL_RESOURCE and self.gpus:
            # hetflow's local config declares no GPUs: RP would never place a GPU task.
            self.gpus = 0
        self.times = StartupTimes()
        self.session = None
        self.pilot = None
        self._tmgr = None
        self._env: Optional[scoped_environ] = None
        self._entries: Dict[str, _Entry] = {}       # RP uid -> entry
        self._by_id: Dict[int, _Entry] = {}         # hetflow task id -> entry
        self._submit_lock = threading.RLock()
        self._finished: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._finisher: Optional[threading.Thread] = None
        self._stopping = False

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Start an RP session and one pilot; return once the pilot is ACTIVE."""
        self.base = os.path.abspath(self.sandbox_dir or os.path.join(self.run_dir,
                                                                     f"{self.label}-rp"))
        self.task_root = os.path.join(self.base, "tasks")
        os.makedirs(self.task_root, exist_ok=True)
        config_home = self.resource_config_dir
        if self.resource == LOCAL_RESOURCE:
            config_home = os.path.join(self.base, "config")
            write_local_config(config_home, local_resource_config(
                self.max_ranks, self.mpiexec, self.base))
        self._env = scoped_environ({
            "RADICAL_CONFIG_USER_DIR": config_home,
            "RADICAL_BASE": os.path.join(self.base, "radical"),
            "RADICAL_REPORT": "FALSE",
            "RADICAL_DEFAULT_IFACE": self.interface,
            # the agent's MPIEXEC launcher and the tasks find this environment's tools
            "PATH": os.path.dirname(self.mpiexec) + os.pathsep + os.environ.get("PATH", ""),
        })
        self._env.apply()
        self._finisher = threading.Thread(target=self._finish_loop, daemon=True,
                                          name=f"{self.label}-finish")
        self._finisher.start()
        try:
            self._start_pilot()
        except BaseException:
            self._close()
            raise

    def _start_pilot(self) -> None:
        rp = _rp()
        t0 = time.time()
        self.session = rp.Session(cfg={"base": self.base, "client_sandbox": self.base})
        self.times.session_s = time.time() - t0
        pmgr = rp.PilotManager(session=self.session)
        self._tmgr = rp.TaskManager(session=self.session)
        self._tmgr.register_callback(self._state_cb)
        description = {"resource": self.resource, "cores": self.max_ranks,
                       "runtime": self.pilot_runtime_min,
                       "sandbox": os.path.join(self.base, "sandbox")}
        description.update(self.pilot_description)
        try:
            self.pilot = pmgr.submit_pilots(rp.PilotDescription(description))
        except Exception as exc:
            raise LaunchError(f"RADICAL-Pilot refused the pilot for {self.resource!r}: {exc}",
                              logs=[self.session.path]) from exc
        self._tmgr.add_pilots(self.pilot)
        self.pilot.wait([rp.PMGR_ACTIVE] + rp.FINAL, timeout=self.start_timeout)
        self.times.pilot_active_s = time.time() - t0 - self.times.session_s
        if self.pilot.state != rp.PMGR_ACTIVE:
            raise LaunchError(
                f"the RADICAL-Pilot pilot on {self.resource!r} is {self.pilot.state} after "
                f"{self.start_timeout:.0f} s (wanted PMGR_ACTIVE); keep_sandbox=True keeps the logs",
                logs=[self.session.path, description["sandbox"]])

    def shutdown(self) -> None:
        """Fail unfinished tasks, close the session, end any process left, remove the sandbox."""
        with self._submit_lock:
            self._stopping = True
            pending = [e for e in self._entries.values() if not e.done]
            for entry in pending:
                entry.done = True
        for entry in pending:
            self.deliver(entry.future, error=ExecutorBroken(
                f"executor {self.label!r} shut down before task {entry.task_id} finished"))
        self._close()
        super().shutdown()

    def _close(self) -> None:
        t0 = time.time()
        try:
            if self.session is not None:
                self.session.close(download=False)
        finally:
            self.session = None
            self._finished.put(None)
            # The pilot's bootstrap runs detached from this process: find leftovers by path.
            self.times.killed_at_close = end_processes([self.base])
            if self._env is not None:
                self._env.restore()
            if not self.keep_sandbox:
                shutil.rmtree(self.base, ignore_errors=True)
            self.times.close_s = time.time() - t0

    # ------------------------------------------------------------------ tasks
    def submit(self, func, resource_specification, *args, **kwargs) -> Future:
        rp = _rp()
        if self._stopping or self._tmgr is None:
            raise ExecutorBroken(f"executor {self.label!r} is not running")
        task_id, resources, future = self.new_task(resource_specification)
        taskdir = os.path.join(self.task_root, f"task-{task_id:06d}")
        os.makedirs(taskdir)
        with open(os.path.join(taskdir, "task.pkl"), "wb") as fh:
            fh.write(self.payload(task_id, func, args, kwargs, resources))
        with open(os.path.join(taskdir, "meta.json"), "w") as fh:
            json.dump({"resources": asdict(resources), "sys_path": self.client_sys_path()}, fh)
        description = rp.TaskDescription({
            "executable": self.python,
            "arguments": ["-m", "hetflow.executors._rank", taskdir],
            "ranks": resources.ranks,
            "cores_per_rank": resources.cores_per_rank,
            "gpus_per_rank": resources.gpus_per_rank,
            "sandbox": taskdir,
            # the agent kills the launch after this many seconds of running
            "timeout": float(resources.walltime or 0.0),
        })
        entry = _Entry(task_id=task_id, future=future, resources=resources, taskdir=taskdir)
        with self._submit_lock:  # hold it so the state callback finds the entry
            task = self._tmgr.submit_tasks(description)
            entry.uid = task.uid
            self._entries[task.uid] = entry
            self._by_id[task_id] = entry
        return future

    def _state_cb(self, task, state) -> None:
        rp = _rp()
        with self._submit_lock:
            entry = self._entries.get(task.uid)
        if entry is None:
            return
        if state == rp.AGENT_EXECUTING and entry.launched != entry.launched:
            entry.launched = time.time()
        elif state in rp.FINAL:
            # Deliver off RP's callback thread: a result can trigger dependent submits.
            self._finished.put((entry, state, task.exit_code, task.stderr or "",
                                task.exception_detail or ""))

    def _finish_loop(self) -> None:
        while (item := self._finished.get()) is not None:
            entry = item[0]
            with self._submit_lock:
                if entry.done:
                    continue
                entry.done = True
            try:
                self._finish(*item)
            except BaseException as exc:  # noqa: BLE001 - never lose a future
                self.deliver(entry.future, error=exc)

    def _finish(self, entry: _Entry, state, exit_code, stderr: str, detail: str) -> None:
        rp = _rp()
        name = f"task {entry.task_id} ({self.label})"
        outcomes = read_outcomes(entry.taskdir) if os.path.isdir(entry.taskdir) else {}
        stamps = {}
        root = outcomes.get(0)
        if root is not None:
            stamps = {"started": root.started, "finished": root.finished,
                      # the state notice can reach the client after rank 0 started
                      "launched": min(entry.launched, root.started)
                      if entry.launched == entry.launched else root.started}
        elif entry.launched == entry.launched:
            stamps = {"launched": entry.launched}
        value, error = None, None
        if entry.cancelled:
            error = TaskCancelled(f"{name} was cancelled")
        elif state == rp.CANCELED and entry.resources.walltime:
            error = WalltimeExceeded(
                f"{name} exceeded its walltime of {entry.resources.walltime} s and was stopped",
                walltime=entry.resources.walltime, task_id=entry.task_id)
        elif state == rp.CANCELED:
            error = TaskLost(f"{name} was cancelled by RADICAL-Pilot (pilot gone?)",
                             task_id=entry.task_id, stderr_tail=stderr[-4000:])
        else:
            try:
                value = collect(outcomes, entry.resources, task_id=entry.task_id,
                                returncode=exit_code if state == rp.FAILED else None,
                                stderr_tail=(stderr + "\n" + detail).strip()[-4000:],
                                executor=self.label, deaths=read_deaths(entry.taskdir))
            except Exception as exc:  # noqa: BLE001 - the typed error for the future
                error = exc
        if error is None:
            shutil.rmtree(entry.taskdir, ignore_errors=True)
        with self._submit_lock:
            self._entries.pop(entry.uid, None)
            self._by_id.pop(entry.task_id, None)
        self.deliver(entry.future, value, error, stamps)

    def cancel(self, future: Future) -> bool:
        """Cancel a waiting or running task: RP kills its launch, the future gets TaskCancelled."""
        with self._submit_lock:
            entry = self._by_id.get(getattr(future, "parsl_executor_task_id", None))
            if entry is None or entry.done or entry.future is not future:
                return False
            entry.cancelled = True
        self._tmgr.cancel_tasks([entry.uid])
        return True

    def parsl_config_options(self) -> dict:
        return {}


__all__ = ["RadicalExecutor", "StartupTimes"]
