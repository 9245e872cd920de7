"""The worker-side half of the Parsl executor: one task's ``$PARSL_MPI_PREFIX`` job.

:func:`run_mpi_task` is the function Parsl's HighThroughputExecutor runs in its
worker (MPI mode has already set ``$PARSL_MPI_PREFIX`` for the nodes the task
was given). It starts the shared rank-side runner under that prefix through
:class:`~hetflow.executors.launch.MPILaunch`, enforces the walltime, watches the
task dir for a cancel marker, kills the whole process tree on either, and sends
back what the ranks wrote. The client turns that into the value or the typed
error with :func:`~hetflow.executors.base.collect`, exactly as ``mpirun`` does.

Imports no Parsl: it only needs ``hetflow`` importable on the worker.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import time
from typing import List, Optional


from hetflow.errors import LaunchError
from hetflow.executors._rank import read_outcomes
from hetflow._guardian import start_ticks
from hetflow.executors.launch import MPILaunch, kill_tree, launcher_env, tail
from hetflow.spec import Resources

#: Written by the client to ask the worker to stop the task (a shared run dir).
CANCEL_MARKER = "cancel"
#: Written by the worker once the launcher runs: where to find its process group.
LAUNCHER_FILE = "launcher.json"
#: How often the worker looks for the cancel marker while the job runs.
POLL_S = 0.05


def launch_command(prefix: str, python: Optional[str]) -> List[str]:
    """``$PARSL_MPI_PREFIX python -m hetflow.executors._rank``, with a resolvable launcher."""
    command = shlex.split(prefix)
    if not command:
        raise LaunchError("PARSL_MPI_PREFIX is empty: is the executor in MPI mode?")
    # Parsl writes a bare "mpiexec"; prefer the one beside this interpreter (the mpich
    # wheel's) so the launcher matches the MPI library mpi4py was built against.
    local = os.path.join(os.path.dirname(os.path.abspath(python or sys.executable)),
                         command[0])
    if os.path.sep not in command[0] and os.path.exists(local):
        command[0] = local
    elif shutil.which(command[0]) is None and not os.path.exists(command[0]):
        raise LaunchError(f"MPI launcher {command[0]!r} from PARSL_MPI_PREFIX is not on PATH",
                          command=command)
    return command + [python or sys.executable, "-m", "hetflow.executors._rank"]


#: Environment variable holding the TMPDIR the ranks should see (the client's).
RANK_TMPDIR = "HETFLOW_RANK_TMPDIR"


def run_mpi_task(payload: bytes, resources: dict, sys_path: List[str], taskdir: str,
                 python: Optional[str] = None) -> dict:
    """Run one task on the nodes Parsl gave this worker; a report dict for the client.

    Keys: ``status`` ("done", "walltime", "cancelled", "launch_error"), ``outcomes``
    (rank -> RankOutcome), ``returncode``, ``deaths``, ``stderr_tail``,
    ``launched``, ``command`` and ``logs``.
    """
    res = Resources(**resources)
    report = {"status": "done", "outcomes": {}, "returncode": None, "deaths": {},
              "stderr_tail": "", "launched": time.time(), "command": None, "logs": []}
    os.makedirs(taskdir, exist_ok=True)
    cancel_path = os.path.join(taskdir, CANCEL_MARKER)
    if os.path.exists(cancel_path):  # cancelled while it waited for nodes
        report["status"] = "cancelled"
        return report
    try:
        command = launch_command(os.environ.get("PARSL_MPI_PREFIX", ""), python)
    except LaunchError as exc:
        report.update(status="launch_error", error=str(exc), command=exc.command)
        return report
    env = launcher_env(command[0])
    # The worker pool runs with a private TMPDIR (see ParslMPIExecutor.start); the
    # ranks get the client's, as on every other executor.
    rank_tmp = env.pop(RANK_TMPDIR, None)
    if rank_tmp:
        env["TMPDIR"] = rank_tmp
    elif rank_tmp is not None:
        env.pop("TMPDIR", None)
    launch = MPILaunch(taskdir, payload, res, list(sys_path), command, env)
    report["command"] = launch.command
    report["logs"] = [launch.stdout, launch.stderr]
    try:
        launch.start()
    except LaunchError as exc:
        report.update(status="launch_error", error=str(exc))
        return report
    proc = launch.proc
    report["launched"] = time.time()
    # The client kills this group if the worker itself is lost (its children would
    # outlive it: the launcher runs in its own session so it can be killed as a tree).
    with open(os.path.join(taskdir, LAUNCHER_FILE), "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": proc.pid,
                   "start_ticks": start_ticks(proc.pid), "worker": os.getpid(),
                   "block_pgid": os.getpgid(0)}, fh)
    deadline = report["launched"] + res.walltime if res.walltime else None
    try:
        while launch.wait_step(POLL_S) is None:
            if os.path.exists(cancel_path):
                launch.cancel()
                proc.wait()
                report.update(status="cancelled", returncode=proc.returncode)
                return report
            if deadline is not None and time.time() > deadline:
                kill_tree(proc.pid)
                proc.wait()
                report.update(status="walltime", returncode=proc.returncode)
                return report
    finally:
        launch.close_watch()
    # A rank's own subprocesses may outlive the launcher: end the whole session.
    kill_tree(proc.pid)
    report.update(returncode=proc.returncode, outcomes=read_outcomes(taskdir),
                  deaths=launch.deaths(), stderr_tail=launch.stderr_tail())
    if not report["outcomes"] and not report["deaths"] and not _any_rank_started(taskdir):
        report["status"] = "launch_error"
        report["error"] = (f"the MPI launcher exited with code {proc.returncode} before any "
                           f"rank started: {tail(launch.stderr, 1000).strip()}")
    return report


def _any_rank_started(taskdir: str) -> bool:
    """A rank that reached the runner leaves ``fault-<rank>.txt`` (see ``record_deaths``)."""
    try:
        return any(name.startswith("fault-") for name in os.listdir(taskdir))
    except OSError:
        return False
