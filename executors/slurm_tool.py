"""Every Slurm command hetflow runs (``salloc``, ``sbatch``, ``squeue``, ``scontrol``,
``scancel``, ``sinfo``, and the ``srun`` of a launcher or a job script), and the one way
they are found: :func:`path`, Slurm's tools on ``PATH``.

No other module of hetflow names a Slurm command (``tests/test_providers.py`` checks it):
a site whose tools live elsewhere changes ``PATH``, or this module. Parsl's
``SlurmProvider`` and RADICAL-Pilot's PSI/J submit their own jobs with their own calls.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence

from hetflow.errors import LaunchError

#: Slurm's commands hetflow runs.
COMMANDS = ("salloc", "sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")


def which(name: str) -> Optional[str]:
    """The path of Slurm's ``name``, or None where it is not installed."""
    if name not in COMMANDS:
        raise ValueError(f"{name!r} is not one of hetflow's Slurm commands {COMMANDS}")
    return shutil.which(name)


def path(name: str) -> str:
    """The path of Slurm's ``name`` (``sbatch``, ``scontrol``, ...), or LaunchError."""
    found = which(name)
    if not found:
        raise LaunchError(f"Slurm's {name!r} is not on PATH: this needs a Slurm cluster "
                          f"(see `make slurm-up` for a test cluster)")
    return found


def run(name: str, args: Sequence[str], timeout: Optional[float] = 30,
        env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run Slurm's ``name`` with ``args`` (text output captured); LaunchError if it is
    missing, cannot start or outlives ``timeout``. Its exit code is the caller's to read."""
    cmd = [path(name), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"{name} failed: {exc}", command=cmd) from exc


# ---------------------------------------------------------------- what hetflow asks of Slurm
def hostnames(hostlist: str) -> Optional[List[str]]:
    """Slurm's compressed host list (``n[1-2],login3``) as names (``scontrol show
    hostnames``); None where ``scontrol`` is missing or fails."""
    if which("scontrol") is None:
        return None
    try:
        out = run("scontrol", ["show", "hostnames", hostlist])
    except LaunchError:
        return None
    return out.stdout.split() if out.returncode == 0 and out.stdout.split() else None


def sinfo(field: str, partition: Optional[str]) -> List[List[str]]:
    """``sinfo``'s ``%P field`` lines for ``partition`` (every partition if None), each
    split once; LaunchError (with sinfo's words) if it fails."""
    args = ["-h", "-o", f"%P {field}"] + (["-p", partition] if partition else [])
    out = run("sinfo", args)
    if out.returncode != 0:
        raise LaunchError(f"sinfo failed ({out.returncode}): {out.stderr.strip()}",
                          command=["sinfo", *args])
    return [line.split(None, 1) for line in out.stdout.splitlines() if line.strip()]


def salloc(options: Sequence[str], timeout: Optional[float] = None) -> str:
    """Wait until Slurm grants an allocation (``salloc --no-shell`` with ``options``);
    its job id. ``timeout``: give up after that many seconds in the queue."""
    args = ["--no-shell", *options]
    if timeout is not None:
        args.append(f"--immediate={max(1, int(timeout))}")
    out = run("salloc", args, timeout=None if timeout is None else timeout + 30)
    found = re.search(r"Granted job allocation (\d+)", out.stderr)
    if out.returncode != 0 or not found:
        raise LaunchError(f"salloc did not grant an allocation ({out.returncode}): "
                          f"{out.stderr.strip()}", command=["salloc", *args])
    return found.group(1)


def sbatch(options: Sequence[str], env: Dict[str, str]) -> str:
    """Submit a batch job (``sbatch --parsable``, the script last in ``options``); its id."""
    args = ["--parsable", *options]
    out = run("sbatch", args, timeout=60, env=env)
    if out.returncode != 0:
        raise LaunchError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}",
                          command=["sbatch", *args])
    return out.stdout.strip().split(";")[0]


def scancel(job_id: str) -> None:
    """Cancel ``job_id`` (quietly: a job that has ended already is no error)."""
    try:
        run("scancel", ["--quiet", str(job_id)], timeout=60)
    except LaunchError:
        pass


def job_info(job_id: str) -> Optional[Dict[str, str]]:
    """``scontrol show job``'s fields for ``job_id``, or None once Slurm forgot it."""
    out = run("scontrol", ["show", "job", "-o", str(job_id)])
    if out.returncode != 0:
        return None
    return dict(field.split("=", 1) for field in out.stdout.split() if "=" in field)


def job_in(directory: str) -> Optional[str]:
    """The id of the queued or running job whose working directory is under
    ``directory`` (``squeue``), or None."""
    try:
        out = run("squeue", ["-h", "-o", "%i %Z"]).stdout
    except LaunchError:
        return None
    for line in out.splitlines():
        job, _, workdir = line.partition(" ")
        if workdir.startswith(directory + os.sep):
            return job
    return None


def job_listed(job_id: str) -> bool:
    """Whether ``squeue`` still lists ``job_id`` (False where it cannot be asked)."""
    try:
        return job_id in run("squeue", ["-h", "-j", job_id, "-o", "%i"]).stdout.split()
    except LaunchError:
        return False


def srun_launcher(job_id: Optional[str]) -> List[str]:
    """A launcher prefix (``{ranks}`` replaced) that starts an MPI world's ranks as a
    step of ``job_id`` (of the allocation this process runs in if None)."""
    return [path("srun")] + ([f"--jobid={job_id}"] if job_id else []) + [
        "--ntasks={ranks}", "--kill-on-bad-exit=0"]


def srun_step(ranks: int, cores_per_rank: int, extra: Sequence[str]) -> List[str]:
    """The ``srun`` of a batch script: ``ranks`` ranks of an MPI app, a rank's death
    ending the step."""
    return [path("srun"), "--mpi=pmi2", "--kill-on-bad-exit=1", f"--ntasks={ranks}",
            f"--cpus-per-task={cores_per_rank}", *extra]


def srun_prefix(launcher: List[str]) -> List[str]:
    """An ``srun`` launcher prefix made safe for MPI worlds: ``--mpi=pmi2`` unless it names
    a plugin (Slurm's default ``MpiDefault=none`` gives each rank a 1-rank world, silently;
    the mpich wheel refuses PMIx), and ``--overlap`` (a world started while others hold
    the allocation's CPUs, e.g. a replacement, would otherwise wait for them)."""
    if not launcher or os.path.basename(launcher[0]) != "srun":
        return list(launcher)
    extra = []
    if not any(arg == "--mpi" or arg.startswith("--mpi=") for arg in launcher[1:]):
        extra.append("--mpi=pmi2")
    if "--overlap" not in launcher[1:]:
        extra.append("--overlap")
    return [launcher[0], *extra, *launcher[1:]]


def require_batch() -> None:
    """LaunchError unless the tools of a job per task (``sbatch``, ``scancel``) are here."""
    path("sbatch")
    path("scancel")
