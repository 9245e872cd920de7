"""Bare metal: one ``mpiexec -n R`` launch per task. The baseline every runtime is compared to."""
from __future__ import annotations

import os
import threading
from typing import Dict, Optional, Sequence

from hetflow.executors.kernel import Executor, Task
from hetflow.executors.launch import MPILaunch, default_mpiexec, launcher_env, mpiexec_command
from hetflow.executors.taskdir import TaskDir
from hetflow.executors.watch import PEER_GRACE_S


class MpirunExecutor(Executor):
    """A Parsl executor that runs each task as its own ``mpiexec -n R`` job on this machine.

    At most ``max_ranks`` rank slots (default: the machine's cores) are in use at
    once; a task takes ``ranks x cores_per_rank`` slots. ``mpiexec`` (default: the
    one beside this interpreter, else on PATH) and ``mpiexec_args`` choose the
    launcher, ``python`` the ranks' interpreter; ``keep_task_dirs`` keeps the task
    dirs of successful tasks too (failed ones are always kept until shutdown).
    ``gpus``: this machine's GPUs (a count or their ids; default: those it sees), handed
    to tasks disjointly (see :mod:`hetflow.executors.kernel`).
    """

    def __init__(self, label: str = "mpirun", *, max_ranks: Optional[int] = None,
                 mpiexec: Optional[str] = None, mpiexec_args: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None, python: Optional[str] = None,
                 gpus=None, keep_task_dirs: bool = False):
        super().__init__(label, max_ranks=max_ranks, gpus=gpus)
        self.mpiexec = mpiexec or default_mpiexec()
        self.mpiexec_args = tuple(mpiexec_args)
        self.env = launcher_env(self.mpiexec, {**os.environ, **(env or {})})
        self.python = python
        self.keep_task_dirs = keep_task_dirs

    def _start(self, task: Task) -> None:
        taskdir = TaskDir(os.path.join(self.run_root, f"task-{task.id:06d}")).create(
            task.payload, self.rank_resources(task), self.client_sys_path())
        task.handle = MPILaunch(
            taskdir, task.resources.ranks,
            mpiexec_command(self.mpiexec, task.resources.ranks, self.mpiexec_args, self.python),
            self.env, on_vanished=lambda: self.call_later(
                PEER_GRACE_S, lambda: self._stop(task, None)))
        threading.Thread(target=self._run, args=(task,), daemon=True,
                         name=f"{self.label}-task-{task.id}").start()

    def _run(self, task: Task) -> None:
        launch: MPILaunch = task.handle
        try:
            launch.start()
            if task.error is not None:      # stopped while it was starting
                launch.kill()
            returncode = launch.wait()
        except BaseException as exc:  # noqa: BLE001 - every failure belongs on the future
            self.finish(task, error=exc)
            return
        outcomes = launch.taskdir.outcomes()
        self.complete(task, outcomes, returncode=returncode, deaths=launch.deaths(),
                       stderr_tail=launch.stderr_tail())
        if task.future.exception() is None and not self.keep_task_dirs:
            launch.taskdir.remove()

    def _stop(self, task: Task, error) -> None:
        if task.handle is not None:
            task.handle.kill()
