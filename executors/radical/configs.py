"""What RADICAL-Pilot is asked for: hetflow's resource configs (this machine, the current
Slurm allocation, a pilot that is a Slurm job), translated from the provider's
:class:`~hetflow.executors.providers.Placement`; the RP descriptions of the pilot, its RAPTOR
master and workers, and the clean-up of what PSI/J (RP's job submitter) leaves behind.
"""
from __future__ import annotations

import json
import os
import sys
import time
from importlib import resources as importlib_resources
from typing import Callable, Optional

from hetflow.errors import ConfigError
from hetflow.executors.providers import BatchJob, Placement
from hetflow.executors.radical import lowprio
from hetflow.executors import allocation as batch

#: Resource label of hetflow's own config for this machine (resource_hetflow.json).
LOCAL_RESOURCE = "hetflow.local"
#: Resource label of hetflow's config for a pilot that is a Slurm job (``slurm=``).
SLURM_RESOURCE = "hetflow.slurm"
#: Where the RAPTOR master's and worker's classes live: RP loads them by path in the pilot,
#: which runs this venv (hetflow's RP resources set ``virtenv`` to it).
RAPTOR_DIR = os.path.dirname(os.path.abspath(__file__))
#: RP's resource manager (and PSI/J's job manager scheme) for a provider's batch system.
RESOURCE_MANAGERS = {"slurm": ("SLURM", "slurm")}


# ---------------------------------------------------------------- the provider, translated
def check(place: Placement) -> None:
    """ConfigError for what a pilot cannot be on ``place``."""
    for system in filter(None, [place.batch_system, place.job and place.job.system]):
        if system not in RESOURCE_MANAGERS:
            raise ConfigError(f"radical has no resource manager for batch system {system!r} "
                              f"(known: {sorted(RESOURCE_MANAGERS)})")
    if place.job is not None and place.job.options:
        raise ConfigError("radical's pilot job takes nodes, ntasks, partition and "
                          "time (RP writes the job script: no extra sbatch args)")


def resource_label(place: Placement) -> str:
    """hetflow's RP resource for ``place``: a pilot job of its own, or a pilot here."""
    return SLURM_RESOURCE if place.job is not None else LOCAL_RESOURCE


def resource_config(place: Placement, cores: int, tmpdir: str) -> dict:
    """hetflow's RP resource configs for a pilot on ``place`` claiming ``cores`` per node."""
    manager = RESOURCE_MANAGERS[place.batch_system][0] if place.batch_system else None
    if place.job is None:
        return local_resource_config(cores, manager)
    return {**local_resource_config(cores), **slurm_resource_config(
        place.slots_per_node, cores, place.job, tmpdir)}


def pilot_fields(place: Placement, cores: int) -> dict:
    """The pilot description's fields for ``place`` (``cores`` per node)."""
    job = place.job
    if job is None:
        if place.batch_system is None:
            return {"cores": cores}
        return {"nodes": place.nodes, "cores": place.nodes * cores}   # every node, fully
    fields = {"nodes": place.nodes, "cores": place.nodes * place.slots_per_node,
              "runtime": _whole_minutes(job.walltime_s)}
    if place.gpus_per_node:
        fields["gpus"] = place.nodes * place.gpus_per_node
    if job.partition:
        fields["queue"] = job.partition
    return fields


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


def local_resource_config(cores: int, resource_manager: Optional[str] = None) -> dict:
    """hetflow's ``local`` resource: this machine, ``cores`` slots, the venv's MPI.

    Inside a batch allocation (``resource_manager``: RP's ``SLURM``) the pilot's nodes
    are the allocation's (read from ``$SLURM_NODELIST``), ``cores`` per
    node: Hydra is then given the nodes' names, and starts its proxies on them with
    ``srun``. (Given ``localhost`` inside an allocation it asks Slurm for a step on a
    node the job does not have, and hangs.) The pilot's agent still runs here, where
    the client is, as a job script's processes do.
    """
    text = importlib_resources.files("hetflow.executors").joinpath(
        "resource_configs/resource_hetflow.json").read_text()
    config = json.loads(text)
    config["local"]["cores_per_node"] = cores
    if resource_manager is not None:
        config["local"]["resource_manager"] = resource_manager
    config["local"]["virtenv"] = sys.prefix
    # RP probes its launcher in the pilot's original environment (before the venv is
    # activated): put the venv's bin first so it finds, and launches with, the venv's MPI.
    bindir = os.path.dirname(sys.executable)
    for method in ("MPIEXEC", "FORK"):
        config["local"]["launch_methods"][method] = {
            "pre_exec_cached": [f"export PATH={bindir}:$PATH"]}
    return config


def slurm_resource_config(cpus: int, cores: int, job: BatchJob, tmpdir: str) -> dict:
    """hetflow's ``slurm`` resource: the pilot is a batch ``job`` (RP submits it with
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
    manager, scheme = RESOURCE_MANAGERS[job.system]
    config.update(
        description="hetflow: a pilot that is a Slurm job (written per run by "
                    "hetflow.executors.radical)",
        default_schema="batch",
        schemas={"batch": {"job_manager_endpoint": f"{scheme}://localhost/",
                           "filesystem_endpoint": "file://localhost/"}},
        resource_manager=manager, fake_resources=False,
        default_queue=job.partition or "",
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
    return _whole_minutes(batch.time_limit_s(limit, "radical"))


def _whole_minutes(seconds: int) -> int:
    return max(1, -(-seconds // 60))


def remove_psij_files(place: Placement, sandbox: str, job_id: Optional[str],
                      job_active: Callable[[str], bool]) -> None:
    """Remove what PSI/J left in its work dir for the pilot job on ``place`` (none for a
    pilot here): the job script (it names the sandbox) and its output file (named by the
    job id), once ``job_active`` (the provider's) says the job has ended."""
    if place.job is None:
        return
    work = os.path.expanduser(os.path.join("~", ".psij", "work", RESOURCE_MANAGERS[
        place.job.system][1]))
    deadline = time.monotonic() + 30     # the job writes its output file as it ends
    while job_id is not None and time.monotonic() < deadline and job_active(job_id):
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
                        # the job's launcher log, named by PSI/J's id as the script is (PSI/J
                        # removes it on seeing the job end; the close does not wait for that)
                        log = os.path.join(work, name[:-len(".job")] + "_launcher.log")
                        if os.path.exists(log):
                            os.unlink(log)
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
