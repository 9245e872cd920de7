"""Bare metal: one ``mpiexec -n R`` launch per task. The baseline every runtime is compared to."""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Dict, Optional, Sequence

from hetflow.errors import ExecutorBroken, TaskCancelled
from hetflow.executors.base import HetflowExecutor, SlotScheduler, collect
from hetflow.executors.launch import (MPILaunch, default_mpiexec, launcher_env, mpiexec_command,
                                      now, timestamps)


class MpirunExecutor(HetflowExecutor):
    """A Parsl executor that runs each task as its own ``mpiexec -n R`` job on this machine.

    At most ``max_ranks`` rank slots (default: the machine's cores) are in use at
    once; a task takes ``ranks x cores_per_rank`` slots. Tasks that don't fit yet
    wait in FIFO order; a task that can never fit fails at once with
    :class:`~hetflow.ResourcesUnavailable`.
    """

    def __init__(self, label: str = "mpirun", *, max_ranks: Optional[int] = None,
                 mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None, python: Optional[str] = None,
                 gpus: Optional[int] = None, keep_task_dirs: bool = False):
        super().__init__(label=label, max_ranks=max_ranks, gpus=gpus)
        self.mpiexec = mpiexec or default_mpiexec()
        self.mpiexec_args = tuple(mpiexec_args)
        self.env = launcher_env(self.mpiexec, {**os.environ, **(env or {})})
        self.python = python
        self.keep_task_dirs = keep_task_dirs
        self._cond = threading.Condition()
        self._scheduler = SlotScheduler(self.max_ranks)
        self._running: Dict[int, MPILaunch] = {}
        self._queued: Dict[Future, int] = {}
        self._stopping = False
        self._dispatcher: Optional[threading.Thread] = None

    def start(self) -> None:
        self.task_root = os.path.join(self.run_dir, f"{self.label}-tasks")
        os.makedirs(self.task_root, exist_ok=True)
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"{self.label}-dispatch",
                                            daemon=True)
        self._dispatcher.start()

    def submit(self, func, resource_specification, *args, **kwargs) -> Future:
        if self._stopping:
            raise ExecutorBroken(f"executor {self.label!r} is shut down")
        task_id, resources, future = self.new_task(resource_specification)
        launch = MPILaunch(
            os.path.join(self.task_root, f"task-{task_id:06d}"),
            self.payload(task_id, func, args, kwargs, resources), resources,
            self.client_sys_path(),
            mpiexec_command(self.mpiexec, resources.ranks, self.mpiexec_args, self.python),
            self.env)
        with self._cond:
            self._queued[future] = task_id
            self._scheduler.push((task_id, future, launch), resources.cores)
            self._cond.notify()
        return future

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                ready = self.next_ready(self._scheduler, self._cond)
                if ready is None:
                    return
                for (task_id, future, launch), slots in ready:
                    self._queued.pop(future, None)
                    self._running[task_id] = launch
                    threading.Thread(target=self._run, args=(task_id, future, launch, slots),
                                     name=f"{self.label}-task-{task_id}", daemon=True).start()

    def _run(self, task_id: int, future: Future, launch: MPILaunch, slots) -> None:
        launched = now()
        value, error, outcomes = None, None, {}
        try:
            launch.start()
            outcomes, returncode, error = launch.wait(task_id, self.label)
            if error is None:
                value = collect(outcomes, launch.resources, task_id=task_id,
                                returncode=returncode, stderr_tail=launch.stderr_tail(),
                                executor=self.label, deaths=launch.deaths())
        except BaseException as exc:  # noqa: BLE001 - every failure belongs on the future
            error = exc
        finally:
            with self._cond:
                self._running.pop(task_id, None)
                self._scheduler.release(slots)
                self._cond.notify()
        if error is None and not self.keep_task_dirs:
            launch.cleanup()
        self.deliver(future, value, error, timestamps(outcomes, launched))

    def cancel(self, future: Future) -> bool:
        """Cancel a queued or running task: its future fails with TaskCancelled."""
        with self._cond:
            task_id = self._queued.pop(future, None)
            if task_id is not None:
                for entry in list(self._scheduler.queue):
                    if entry[0][1] is future:
                        self._scheduler.queue.remove(entry)
                self.deliver(future, error=TaskCancelled(f"task {task_id} ({self.label}) was "
                                                         "cancelled before it started"))
                return True
            launch = self._running.get(future.parsl_executor_task_id)
        if launch is None:
            return False
        launch.cancel()
        return True

    def shutdown(self) -> None:
        with self._cond:
            queued = self.drain_queue(self._scheduler, self._cond)
            running = list(self._running.values())
        for launch in running:
            launch.cancel()
        self.fail_unfinished((task_id, future) for task_id, future, _ in queued)
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=10)
        super().shutdown()
