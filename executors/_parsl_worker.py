"""The worker-side half of the Parsl executor: one task's ``$PARSL_MPI_PREFIX`` job.

:func:`run_mpi_task` is the function Parsl's HighThroughputExecutor runs in its
worker (MPI mode has already set ``$PARSL_MPI_PREFIX`` for the nodes the task
was given). It writes the task dir, starts the shared rank-side runner under
that prefix through :class:`~hetflow.executors.launch.MPILaunch`, kills the
whole process tree when the client leaves the cancel marker (walltime, cancel
and shutdown are all decided by the client's kernel) or when a rank's peers
outlive its failure by the failed-peer grace, and sends back what the ranks
wrote. The client turns that into the value or the typed error, as ``mpirun`` does.

Imports no Parsl: it only needs ``hetflow`` importable on the worker.
"""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import time
from typing import List, Optional

from hetflow._guardian import start_ticks
from hetflow.errors import LaunchError
from hetflow.executors.launch import MPILaunch, launcher_env, tail
from hetflow.executors.taskdir import LAUNCHER, TaskDir
from hetflow.executors.watch import PEER_GRACE_S, Watch

#: Written by the worker once the launcher runs: where to find its process group.
LAUNCHER_FILE = LAUNCHER
#: Environment variable holding the TMPDIR the ranks should see (the client's).
RANK_TMPDIR = "HETFLOW_RANK_TMPDIR"
#: How often the worker looks for the client's cancel marker while the job runs.
POLL_S = 0.05


def launch_command(prefix: str, python: Optional[str], cores_per_rank: int = 1) -> List[str]:
    """``$PARSL_MPI_PREFIX python -m hetflow.executors._rank``, with a resolvable launcher
    and the ranks packed node by node (see :func:`pack_hosts`)."""
    command = pack_hosts(shlex.split(prefix), cores_per_rank)
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


def pack_hosts(command: List[str], cores_per_rank: int = 1) -> List[str]:
    """Parsl's ``mpiexec -n R -ppn 1 -hosts n1,n1,n2,n2`` (one entry per core slot) as
    ``mpiexec -n R -hosts n1:2,n2:2``: Hydra merges repeated hosts and deals the ranks
    round robin (n1, n2, n1, n2); a task that fits on one node must run on one node,
    its rank 0 on the first. Rank ``i`` takes the first of its ``cores_per_rank``
    entries. A list with a single host, or another launcher, is left as it is."""
    try:
        at = command.index("-hosts")
        ranks = int(command[command.index("-n") + 1])
    except (ValueError, IndexError):
        return command
    entries = command[at + 1].split(",")
    if len(set(entries)) < 2 or len(entries) < ranks * cores_per_rank:
        return command
    counts: dict = {}
    for i in range(ranks):
        node = entries[i * cores_per_rank]
        counts[node] = counts.get(node, 0) + 1
    packed = command[:at + 1] + [",".join(f"{n}:{c}" for n, c in counts.items())] \
        + command[at + 2:]
    if "-ppn" in packed:
        ppn = packed.index("-ppn")
        del packed[ppn:ppn + 2]
    return packed


def _rank_env(launcher: str) -> dict:
    """The launcher's environment, with the client's TMPDIR back for the ranks.

    The worker pool runs with a private TMPDIR (see ``ParslMPIExecutor._start_runtime``).
    """
    env = launcher_env(launcher)
    rank_tmp = env.pop(RANK_TMPDIR, None)
    if rank_tmp:
        env["TMPDIR"] = rank_tmp
    elif rank_tmp is not None:
        env.pop("TMPDIR", None)
    return env


def run_mpi_task(payload: bytes, resources: dict, sys_path: List[str], taskdir: str,
                 python: Optional[str] = None) -> dict:
    """Run one task on the nodes Parsl gave this worker; a report dict for the client.

    Keys: ``status`` ("done", "stopped": the client asked, "launch_error"),
    ``outcomes`` (rank -> RankOutcome), ``returncode``, ``deaths`` (cause first),
    ``stderr_tail``, ``command``, ``logs`` and, for a launch error, ``error``.
    """
    tdir = TaskDir(taskdir).create(payload, resources, sys_path)
    report = {"status": "done", "outcomes": {}, "returncode": None, "deaths": {},
              "stderr_tail": "", "command": None, "logs": []}
    if tdir.stop_requested():              # stopped before it reached this worker
        report["status"] = "stopped"
        return report
    try:
        command = launch_command(os.environ.get("PARSL_MPI_PREFIX", ""), python,
                                 resources.get("cores_per_rank") or 1)
    except LaunchError as exc:
        report.update(status="launch_error", error=str(exc), command=exc.command)
        return report
    # The failed-peer grace runs here, beside the job: the client cannot reach its ranks.
    watch = Watch("parsl-worker-watch")
    launch = MPILaunch(tdir, resources["ranks"], command, _rank_env(command[0]),
                       on_vanished=lambda: watch.after(PEER_GRACE_S, launch.kill))
    report.update(command=launch.command, logs=[tdir.stdout, tdir.stderr])
    try:
        launched = time.time()
        launch.start()
        # The client kills this tree if the worker itself is lost (the launcher runs in
        # its own session, so it would outlive the worker); with the manager lost, also
        # the worker pool's group, whose workers outlive it blocked on dead pipes.
        tdir.write_launcher({"host": socket.gethostname(), "pid": launch.proc.pid,
                             "launched": launched,
                             "start_ticks": start_ticks(launch.proc.pid),
                             "worker": os.getpid(), "block_pgid": os.getpgid(0)})
        returncode = None
        while returncode is None:
            returncode = launch.wait_step(POLL_S)
            if returncode is None and report["status"] == "done" and tdir.stop_requested():
                report["status"] = "stopped"
                launch.kill()
    except LaunchError as exc:
        report.update(status="launch_error", error=str(exc))
        return report
    finally:
        watch.close()
        # A rank's own subprocesses may outlive the launcher: end the whole session.
        launch.kill()
        launch.close_watch()
    report.update(returncode=returncode, outcomes=tdir.outcomes(), deaths=launch.deaths(),
                  stderr_tail=launch.stderr_tail())
    if report["status"] == "done" and not report["outcomes"] and not report["deaths"] \
            and not tdir.any_rank_started():
        report["status"] = "launch_error"
        report["error"] = (f"the MPI launcher exited with code {returncode} before any "
                           f"rank started: {tail(tdir.stderr, 1000).strip()}")
    return report
