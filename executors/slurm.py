"""The batch baseline: each task is its own Slurm job (``sbatch``), queue wait and all.

This is what a batch user pays for every MPI app call: the job waits in Slurm's
queue, then ``srun --mpi=pmi2 -n R`` runs the shared rank runner
(``python -m hetflow.executors._rank TASKDIR``) in it. The task dir lives on the
client's filesystem, which the nodes share, so the ranks' reports and death
evidence come back through it from any node.

- ``launched`` is when the job started (the batch script stamps ``launcher.json``),
  so ``launched - submitted`` (:attr:`~hetflow.TaskTimes.queue_s`) is the queue wait,
  and the kernel's walltime counts from there.
- walltime: ``--time`` (Slurm's limit, in whole minutes, as a backstop) plus the
  kernel's own check, which calls :meth:`SlurmExecutor._stop`: ``scancel``.
- cancel and shutdown: ``scancel``.
- a rank that dies makes ``srun`` end the step (``--kill-on-bad-exit``); a job that
  ends without its batch script's record (node failure, ``scancel`` from outside,
  Slurm's time limit) is read from ``scontrol``: the task fails with ``TaskLost``
  naming the rank (the supervisors' records, else ``srun``'s own report).
"""
from __future__ import annotations

import math
import os
import re
import shlex
import sys
import threading
import time
from typing import Dict, Optional, Sequence

from hetflow.errors import LaunchError
from hetflow.executors import slurm_tool
from hetflow.executors.allocation import partition_sinfo
from hetflow.executors.kernel import Executor, Task
from hetflow.executors.launch import tail, with_malloc_thp
from hetflow.executors.taskdir import LAUNCHER, Deaths, TaskDir, write_private

#: Seconds between looks at a running job's task dir (its batch script's records).
FILE_POLL_S = 0.05
#: Seconds between asking Slurm (``scontrol``) about a job whose script left no end record.
SLURM_POLL_S = 1.0
#: Job states after which a job runs no more (``scontrol``'s ``JobState``).
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
         "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT", "REVOKED"}

_SRUN_REPORT = re.compile(r"srun: error: \S+: tasks? ([\d,-]+): (Killed|Exited with exit code (\d+)"
                          r"|Terminated|Aborted|Segmentation fault)")


def partition_cpus(partition: Optional[str] = None) -> int:
    """How many CPUs the partition a batch job lands in has in all: ``partition``, else
    ``$SBATCH_PARTITION``, else the cluster's default (not every partition's: ``sinfo``
    lists each of them)."""
    total = 0
    for line in partition_sinfo("%C", partition, "SBATCH_PARTITION"):
        try:
            total += int(line.split("/")[3])        # allocated/idle/other/total
        except (IndexError, ValueError):
            continue
    if total < 1:
        raise LaunchError(f"sinfo found no CPUs in partition {partition or '(default)'}")
    return total


_GPU_GRES = re.compile(r"^gpu(?::[^:(,]+)?:(\d+)")


def partition_gpus(partition: Optional[str] = None) -> int:
    """How many GPUs (gres ``gpu``) the partition's nodes have in all (0 without gres)."""
    total = 0
    for line in partition_sinfo("%D %G", partition, "SBATCH_PARTITION"):
        nodes, _, gres = line.partition(" ")
        for item in gres.split(","):
            found = _GPU_GRES.match(item.strip())
            if found and nodes.isdigit():
                total += int(nodes) * int(found.group(1))
    return total


def srun_deaths(report: str) -> Deaths:
    """What ``srun`` said about tasks that ended badly (``srun: error: n1: task 1: Killed``);
    its first report is the cause."""
    match = _SRUN_REPORT.search(report)
    if not match:
        return {}
    rank = int(re.split(r"[,-]", match.group(1))[0])
    what = ("was killed by signal 9" if match.group(2) == "Killed" else
            f"exited with code {match.group(3)}" if match.group(3) else match.group(2).lower())
    return {rank: (what, "")}


def _gpu_args(resources) -> list:
    """What a task's job and step ask of Slurm for its GPUs."""
    return [f"--gpus-per-task={resources.gpus_per_rank}"] if resources.gpus_per_rank else []


class SlurmExecutor(Executor):
    """A Parsl executor that submits every task as its own Slurm batch job.

    ``partition`` chooses the partition (default: Slurm's default), ``sbatch_args``
    and ``srun_args`` add options to the job and to its step, ``python`` is the
    ranks' interpreter (default: this one; the nodes must see it). ``max_ranks``
    (default: the partition's CPUs) bounds the rank slots in use at once.
    ``keep_task_dirs`` keeps successful tasks' dirs too. GPUs are Slurm's to schedule: a
    task with ``gpus_per_rank`` asks for them (``--gpus-per-task``) and Slurm binds each
    rank's; ``gpus`` (default: the partition's gres ``gpu`` count) only refuses a task
    needing more than the partition has.
    """

    reports_launch = True

    def __init__(self, label: str = "slurm", *, max_ranks: Optional[int] = None,
                 partition: Optional[str] = None, sbatch_args: Sequence[str] = (),
                 srun_args: Sequence[str] = (), python: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, keep_task_dirs: bool = False,
                 gpus: Optional[int] = None):
        if max_ranks is None:
            max_ranks = partition_cpus(partition)
        super().__init__(label, max_ranks=max_ranks,
                         gpus=partition_gpus(partition) if gpus is None else gpus)
        self.partition = partition
        self.sbatch_args = tuple(sbatch_args)
        self.srun_args = tuple(srun_args)
        self.python = python or sys.executable
        # (the job's environment, sbatch --export=ALL)
        self.env = with_malloc_thp({**os.environ, **(env or {})})
        self.keep_task_dirs = keep_task_dirs
        slurm_tool.require_batch()

    def _gpus_needed(self, resources) -> int:
        return 0          # Slurm queues the job until its GPUs are free

    def rank_resources(self, task: Task) -> dict:
        # A GPU task keeps Slurm's binding; a CPU task sees none ("", as on every runtime):
        # Slurm leaves CUDA_VISIBLE_DEVICES unset for a job without GPUs, and on a node
        # whose devices are not constrained (cgroups' ConstrainDevices) it could use them
        # all, and hetflow.torch would pick NCCL on another task's GPU.
        gpus = task.resources.gpus_per_rank
        return {**super().rank_resources(task), "devices": None if gpus else []}

    # ------------------------------------------------------------------ the job
    def _script(self, task: Task, taskdir: TaskDir) -> str:
        """The batch script: stamp the start, run the ranks under ``srun``, record its end."""
        res = task.resources
        srun = [*slurm_tool.srun_step(res.ranks, res.cores_per_rank,
                                      [*_gpu_args(res), *self.srun_args]),
                self.python, "-m", "hetflow.executors._rank", taskdir.path]
        record = shlex.quote(taskdir.file(LAUNCHER))
        tmp = shlex.quote(taskdir.file("." + LAUNCHER + ".job.tmp"))
        # launcher.json (see taskdir): written atomically, read while the job runs.
        stamp = ('printf \'{"job": "%s", "host": "%s", "pid": %d, "launched": %s%s}\' '
                 f'"$SLURM_JOB_ID" "$(hostname)" $$ "$launched" "$1" > {tmp} && '
                 f'mv -f {tmp} {record}')
        return "\n".join([
            "#!/bin/bash",
            f"# hetflow task {task.id} ({self.label}): one Slurm job per task",
            "umask 077",
            "launched=$(date +%s.%N)",
            f"stamp() {{ {stamp}; }}",
            "stamp ''",
            " ".join(shlex.quote(a) for a in srun),
            "rc=$?",
            'stamp ", \\"returncode\\": $rc"',
            "exit $rc",
            ""])

    def _sbatch(self, task: Task, taskdir: TaskDir) -> str:
        res = task.resources
        script = taskdir.file("job.sh")
        write_private(script, self._script(task, taskdir).encode())
        cmd = [f"--job-name=hetflow-{self.label}-{task.id}",
               f"--ntasks={res.ranks}", f"--cpus-per-task={res.cores_per_rank}",
               f"--chdir={taskdir.path}", f"--output={taskdir.stdout}",
               f"--error={taskdir.stderr}", "--no-requeue", "--export=ALL", *_gpu_args(res)]
        if self.partition:
            cmd.append(f"--partition={self.partition}")
        if res.walltime is not None:   # Slurm counts whole minutes: a backstop to ours
            cmd.append(f"--time={max(1, math.ceil(res.walltime / 60)) + 1}")
        return slurm_tool.sbatch([*cmd, *self.sbatch_args, script], self.env)

    def _start(self, task: Task) -> None:
        taskdir = TaskDir(os.path.join(self.run_root, f"task-{task.id:06d}")).create(
            task.payload, self.rank_resources(task), self.client_sys_path())
        task.handle = _Job(taskdir)
        threading.Thread(target=self._run, args=(task,), daemon=True,
                         name=f"{self.label}-task-{task.id}").start()

    def _run(self, task: Task) -> None:
        job: _Job = task.handle
        try:
            with job.lock:
                if task.error is None:          # not stopped before it was submitted
                    job.id = self._sbatch(task, job.taskdir)
            if job.id is None:
                self.finish(task)              # the kernel's verdict
                return
            returncode, detail = self._wait(task, job)
        except BaseException as exc:  # noqa: BLE001 - every failure belongs on the future
            self.finish(task, error=exc)
            return
        taskdir = job.taskdir
        stderr = tail(taskdir.stderr)
        self.complete(task, taskdir.outcomes(), returncode=returncode, stderr_tail=stderr,
                       deaths=taskdir.deaths(lambda: srun_deaths(tail(taskdir.stderr, 20000))),
                       detail=detail)
        if task.future.exception() is None and not self.keep_task_dirs:
            taskdir.remove()

    def _wait(self, task: Task, job: "_Job"):
        """Wait for the job's end: ``(srun's exit code or None, detail for a lost task)``."""
        asked = 0.0
        while True:
            info = job.taskdir.read_launcher()
            if info is not None and job.launched is None:
                job.launched = float(info["launched"])
                self.launched(task, at=job.launched)
            if info is not None and "returncode" in info:
                return int(info["returncode"]), ""
            if time.monotonic() - asked >= SLURM_POLL_S:
                asked = time.monotonic()
                state = slurm_tool.job_info(job.id)
                if state is None or state.get("JobState") in ENDED:
                    return self._ended_without_record(job, state)
            time.sleep(FILE_POLL_S)

    def _ended_without_record(self, job: "_Job", state: Optional[dict]):
        """The job ended but its script did not record srun's end: Slurm says why."""
        info = job.taskdir.read_launcher() or {}
        if "returncode" in info:                # it did, just now
            return int(info["returncode"]), ""
        what = state.get("JobState", "?") if state else "gone from Slurm's records"
        reason = state.get("Reason", "None") if state else ""
        detail = f"; Slurm job {job.id} ended {what}"
        if reason and reason != "None":
            detail += f" ({reason})"
        return None, detail

    def _stop(self, task: Task, error) -> None:
        job: _Job = task.handle
        if job is None:
            return
        with job.lock:                          # a job being submitted gets its id first
            if job.id is not None:
                slurm_tool.scancel(job.id)

    def parsl_config_options(self) -> dict:
        return {}


class _Job:
    """A task's Slurm job: its dir, id (once submitted) and start time (once it ran)."""

    def __init__(self, taskdir: TaskDir):
        self.taskdir = taskdir
        self.id: Optional[str] = None
        self.launched: Optional[float] = None
        self.lock = threading.Lock()
