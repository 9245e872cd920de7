"""What RADICAL-Pilot is asked for: hetflow's resource configs (this machine, the current
Slurm allocation, a pilot that is a Slurm job), the RP descriptions of the pilot, its RAPTOR
master and workers, and the clean-up of what PSI/J (RP's job submitter) leaves behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import resources as importlib_resources
from typing import Optional

from hetflow.executors.radical import lowprio
from hetflow.executors import allocation as batch

#: Resource label of hetflow's own config for this machine (resource_hetflow.json).
LOCAL_RESOURCE = "hetflow.local"
#: Resource label of hetflow's config for a pilot that is a Slurm job (``slurm=``).
SLURM_RESOURCE = "hetflow.slurm"
#: Where the RAPTOR master's and worker's classes live: RP loads them by path in the pilot,
#: which runs this venv (hetflow's RP resources set ``virtenv`` to it).
RAPTOR_DIR = os.path.dirname(os.path.abspath(__file__))


class Descriptions:
    """The RP descriptions of the pilot, the RAPTOR master and the RAPTOR workers, as dicts.

    The runtime builds each one, then hands it to the matching method here before RP sees
    it; the methods return it unchanged. A subclass may change them (a site's ``pre_exec``,
    another ``raptor_file``): the tests make RP's failures happen this way.
    """

    def pilot(self, description: dict) -> dict:
        """A pilot about to be submitted (called again for a restarted one)."""
        return description

    def master(self, description: dict) -> dict:
        """The RAPTOR master of a pilot that has come up."""
        return description

    def worker(self, description: dict, replacement: bool) -> dict:
        """A RAPTOR worker; ``replacement``: one that replaces a lost or stuck worker."""
        return description


def master_description(yield_cpu: bool = True) -> dict:
    """RP's RAPTOR master, with hetflow's fix for a lost queue announcement
    (``executors/radical/raptor_master.py``)."""
    return {"raptor_class": "Master",
            "raptor_file": os.path.join(RAPTOR_DIR, "raptor_master.py"),
            "environment": yield_cpu_env(yield_cpu)}


def yield_cpu_env(yield_cpu: bool) -> dict:
    """What tells the RAPTOR master and worker to run their own threads at the lowest
    CPU priority (``executors/radical/priority.py``)."""
    return {lowprio.ENV: "1" if yield_cpu else "0"}


def local_resource_config(cores: int, allocation: Optional[batch.Allocation] = None) -> dict:
    """hetflow's ``local`` resource: this machine, ``cores`` slots, the venv's MPI.

    Inside a Slurm ``allocation`` the pilot's nodes are the allocation's (RP's
    ``SLURM`` resource manager reads them from ``$SLURM_NODELIST``), ``cores`` per
    node: Hydra is then given the nodes' names, and starts its proxies on them with
    ``srun``. (Given ``localhost`` inside an allocation it asks Slurm for a step on a
    node the job does not have, and hangs.) The pilot's agent still runs here, where
    the client is, as a job script's processes do.
    """
    text = importlib_resources.files("hetflow.executors").joinpath(
        "resource_configs/resource_hetflow.json").read_text()
    config = json.loads(text)
    config["local"]["cores_per_node"] = cores
    if allocation is not None:
        config["local"]["resource_manager"] = "SLURM"
    config["local"]["virtenv"] = sys.prefix
    # RP probes its launcher in the pilot's original environment (before the venv is
    # activated): put the venv's bin first so it finds, and launches with, the venv's MPI.
    bindir = os.path.dirname(sys.executable)
    for method in ("MPIEXEC", "FORK"):
        config["local"]["launch_methods"][method] = {
            "pre_exec_cached": [f"export PATH={bindir}:$PATH"]}
    return config


def slurm_resource_config(cpus: int, cores: int, request: dict, tmpdir: str) -> dict:
    """hetflow's ``slurm`` resource: the pilot is a Slurm job (RP submits it with
    ``sbatch`` through PSI/J) asking for ``cpus`` per node, its agent runs in the job,
    its nodes are the job's (RP's ``SLURM`` resource manager), and Hydra starts the
    ranks on them with ``srun`` steps that overlap (as inside an allocation).

    The agent sees ``cores`` (fake) per node, as the local pilot does (master + worker
    + room for executable tasks; the kernel keeps real use within ``max_ranks``): before
    it starts, the job's bootstrap raises the core count in the agent's config
    (``agent_0.cfg``, which RP staged into the job's sandbox). The job's environment is
    not the client's (``--export=NONE``): what the agent needs is set up by its bootstrap.
    """
    config = local_resource_config(cpus)["local"]
    bindir = os.path.dirname(sys.executable)
    config.update(
        description="hetflow: a pilot that is a Slurm job (written per run by "
                    "hetflow.executors.radical)",
        default_schema="batch",
        schemas={"batch": {"job_manager_endpoint": "slurm://localhost/",
                           "filesystem_endpoint": "file://localhost/"}},
        resource_manager="SLURM", fake_resources=False,
        default_queue=request.get("partition") or "",
        # RP's temp files go to the sandbox (as the local pilot's); Hydra's proxies are
        # Slurm steps that must not wait for each other's CPUs.
        pre_bootstrap_0=[f"export TMPDIR={tmpdir}", "export SLURM_OVERLAP=1",
                         f"export PATH={bindir}:$PATH",
                         # (RP's bootstrap evals these: no quotes, no spaces in words)
                         f"{sys.executable} -m hetflow.executors.radical agent-cores "
                         f"{int(cores)}"])
    return {"slurm": config}


def minutes(limit) -> int:
    """A Slurm time limit (see ``allocation.time_limit_s``) in whole minutes, rounded up."""
    return max(1, -(-batch.time_limit_s(limit, "radical") // 60))


def job_running_in(sandbox: str) -> Optional[str]:
    """The id of the Slurm job whose working directory is under ``sandbox`` (RP's pilot
    job runs in its pilot sandbox; PSI/J names the job itself)."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        job, _, workdir = line.partition(" ")
        if workdir.startswith(sandbox + os.sep):
            return job
    return None


def remove_psij_files(sandbox: str, job_id: Optional[str]) -> None:
    """Remove what PSI/J left in its work dir for the pilot job: the job script (it
    names the sandbox) and its output file (named by the job id)."""
    work = os.path.expanduser(os.path.join("~", ".psij", "work", "slurm"))
    deadline = time.monotonic() + 30     # the job writes its output file as it ends
    while job_id is not None and time.monotonic() < deadline:
        try:
            listed = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"],
                                    capture_output=True, text=True, timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            break
        if job_id not in listed:
            break
        time.sleep(0.2)
    try:
        names = os.listdir(work)
    except OSError:
        return
    for name in names:
        path = os.path.join(work, name)
        try:
            if job_id is not None and name.startswith(f"{job_id}."):
                os.unlink(path)
            elif name.endswith(".job"):
                with open(path, errors="replace") as fh:
                    if sandbox in fh.read():
                        os.unlink(path)
        except OSError:
            continue


def raise_agent_cores(cores: int, path: str = "agent_0.cfg") -> None:
    """Give the pilot job's agent ``cores`` per node (see :func:`slurm_resource_config`)."""
    with open(path) as fh:
        config = json.load(fh)
    config["cores_per_node"] = cores
    config["cores"] = config["nodes"] * cores
    with open(path, "w") as fh:
        json.dump(config, fh)
