"""Where a runtime's long-lived processes run: this machine, the Slurm allocation hetflow
runs in, or a batch job of their own.

The pool's MPI world, Parsl's worker pool and RADICAL-Pilot's pilot live as long as the
runtime. Each runtime asks its provider the same few questions (how many rank slots by
default, how they spread over nodes, how to start and end the job) and one or two of its
own (the Parsl ``ExecutionProvider``, the RP resource config). ``slurm={...}`` on a
runtime is the shorthand for ``provider=SlurmJob({...})``; inside an allocation
(``salloc``/``sbatch``) the default is :class:`CurrentAllocation`, else
:class:`ThisMachine`.

A batch system is one class: subclass :class:`Provider` and answer its questions for
that system (``SlurmJob`` is the example). Every method's default means "this machine";
:meth:`Provider.check` refuses what a runtime cannot do with the system's request.
"""
from __future__ import annotations

from typing import List, Optional

from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider, SlurmProvider

from hetflow.errors import ConfigError
from hetflow.executors import allocation as batch
from hetflow.executors.taskdir import private_umask


class Provider:
    """Where a runtime's long-lived processes run (see the module docstring)."""

    #: RP resource label of hetflow's config for this kind of pilot.
    rp_resource = "hetflow.local"

    def default_slots(self, runtime: str) -> Optional[int]:
        """Rank slots when the user gives no ``max_ranks`` (None: the kernel's default)."""
        return None

    def ranks_per_node(self, slots: int) -> Optional[int]:
        """How ``slots`` spread over the nodes, node-packed (None: all on this machine)."""
        return None

    def gpus_per_node(self) -> Optional[int]:
        """GPUs of each node the runtime's processes get (None: this machine's)."""
        return None

    def check(self, runtime: str) -> None:
        """Raise ConfigError for what ``runtime`` cannot do with this provider's request."""

    def start(self, runtime: str, name: str, slots: int) -> None:
        """Wait until the processes' place exists (a job granted); before anything starts."""

    def stop(self) -> None:
        """Give the place back (idempotent); after the processes ended."""

    # ---- the pool: how the MPI world is launched
    def pool_launcher(self) -> Optional[List[str]]:
        """A launcher prefix for the pool's world (``{ranks}`` replaced), or None: mpiexec."""
        return None

    # ---- Parsl: the ExecutionProvider of the worker pool's block, and its node list
    def parsl_provider(self, slots: int, worker_init: str):
        return _PrivateLocalProvider(launcher=SimpleLauncher(), init_blocks=1, min_blocks=1,
                                     max_blocks=1, nodes_per_block=1, worker_init=worker_init)

    def parsl_nodefile(self, path: str, slots: int) -> str:
        """Write the worker pool's node file (one line per slot) now, or return the shell
        line that writes it inside the block."""
        with open(path, "w") as fh:
            fh.write("localhost\n" * slots)
        return ""

    # ---- RADICAL-Pilot: hetflow's resource config and the pilot's fields
    def rp_resource_config(self, cores: int, slots: int, tmpdir: str) -> dict:
        """hetflow's RP resource config for a pilot claiming ``cores`` per node."""
        from hetflow.executors.radical.configs import local_resource_config

        return local_resource_config(cores)

    def rp_environment(self) -> dict:
        return {}

    def rp_pilot_fields(self, cores: int, ranks_per_node: Optional[int]) -> dict:
        return {"cores": cores}

    def rp_job_id(self, sandbox: str) -> Optional[str]:
        """The batch job that is the pilot, once it is active (None: none)."""
        return None

    def rp_cleanup(self, sandbox: str, job_id: Optional[str]) -> None:
        """Remove what submitting the pilot left outside its sandbox."""


class ThisMachine(Provider):
    """This machine: processes are the client's children."""


class CurrentAllocation(Provider):
    """Inside the Slurm allocation hetflow runs in: its nodes and CPUs (Hydra starts its
    proxies on them with ``srun``)."""

    def __init__(self, found: batch.Allocation):
        self.allocation = found

    def default_slots(self, runtime: str) -> Optional[int]:
        return self.allocation.total_cpus

    def ranks_per_node(self, slots: int) -> Optional[int]:
        return max(self.allocation.cpus)

    def parsl_nodefile(self, path: str, slots: int) -> str:
        # Hydra given "localhost" inside an allocation asks Slurm for a step there, and hangs.
        with open(path, "w") as fh:
            fh.write("".join(f"{node}\n" for node in self.allocation.slots(slots)))
        return ""

    def rp_resource_config(self, cores: int, slots: int, tmpdir: str) -> dict:
        from hetflow.executors.radical.configs import local_resource_config

        return local_resource_config(cores, self.allocation)

    def rp_environment(self) -> dict:
        # A step takes its nodes' CPUs: the worker's would hold them and every later step
        # (an executable task, a replacement worker) wait; hetflow places within max_ranks.
        return {"SLURM_OVERLAP": "1"}

    def rp_pilot_fields(self, cores: int, ranks_per_node: Optional[int]) -> dict:
        nodes = len(self.allocation.nodes)       # every node of the allocation, fully
        return {"nodes": nodes, "cores": nodes * cores}


class SlurmJob(Provider):
    """A Slurm job of the runtime's own, submitted from here as a user on a login node
    would: ``request`` holds ``nodes``, ``ntasks``, ``partition``, ``time`` (Slurm's format,
    default 60 minutes), ``gpus_per_node`` (asked of Slurm: ``--gpus-per-node``) and
    ``args`` (more options). The pool's is an allocation
    (``salloc``) its world is launched into with ``srun``; Parsl's a block of its
    ``SlurmProvider``; RP's a pilot job (``sbatch`` through PSI/J)."""

    rp_resource = "hetflow.slurm"
    #: The environment variable holding the partition each submitting tool defaults to.
    _PARTITION_ENV = {"pool": "SALLOC_PARTITION"}

    def __init__(self, request: dict):
        self.request = batch.check_request(request)
        self.nodes = int(self.request.get("nodes") or 1)
        self.batch_allocation: Optional[batch.BatchAllocation] = None   # the pool's

    def default_slots(self, runtime: str) -> Optional[int]:
        return batch.request_slots(self.request,
                                   self._PARTITION_ENV.get(runtime, "SBATCH_PARTITION"))

    def ranks_per_node(self, slots: int) -> Optional[int]:
        return -(-slots // self.nodes)

    def gpus_per_node(self) -> Optional[int]:
        return self.request.get("gpus_per_node")

    def check(self, runtime: str) -> None:
        if runtime == "radical" and self.request.get("args"):
            raise ConfigError("radical's pilot job takes nodes, ntasks, partition and "
                              "time (RP writes the job script: no extra sbatch args)")

    def start(self, runtime: str, name: str, slots: int) -> None:
        if runtime == "pool":    # wait in the batch queue; the world is launched into it
            self.batch_allocation = batch.BatchAllocation({"ntasks": slots, **self.request})
            self.batch_allocation.submit(name)

    def stop(self) -> None:
        if self.batch_allocation is not None:
            self.batch_allocation.release()

    def pool_launcher(self) -> Optional[List[str]]:
        job = self.batch_allocation.job_id if self.batch_allocation is not None else None
        return ["srun"] + ([f"--jobid={job}"] if job else []) + [
            "--ntasks={ranks}", "--kill-on-bad-exit=0"]

    def parsl_provider(self, slots: int, worker_init: str):
        # One block, the job: ``slots`` CPUs over its nodes (--cpus-per-task of the one
        # task per node Parsl asks for).
        gpus = [f"--gpus-per-node={self.gpus_per_node()}"] if self.gpus_per_node() else []
        options = "".join(f"#SBATCH {arg}\n" for arg in [*gpus, *self.request.get("args", ())])
        return _PrivateSlurmProvider(
            partition=self.request.get("partition"), nodes_per_block=self.nodes,
            cores_per_node=-(-slots // self.nodes), exclusive=False,
            walltime=hours_minutes_seconds(self.request.get("time", 60)),
            init_blocks=1, min_blocks=1, max_blocks=1, launcher=SimpleLauncher(),
            scheduler_options=options, worker_init=worker_init)

    def parsl_nodefile(self, path: str, slots: int) -> str:
        import shlex
        import sys

        # Inside the block's job, from its environment: the client cannot know the nodes.
        return (f"{shlex.quote(sys.executable)} -m hetflow.executors.allocation "
                f"nodefile {shlex.quote(path)} {slots}")

    def rp_resource_config(self, cores: int, slots: int, tmpdir: str) -> dict:
        from hetflow.executors.radical.configs import local_resource_config, slurm_resource_config

        return {**local_resource_config(cores), **slurm_resource_config(
            self.ranks_per_node(slots), cores, self.request, tmpdir)}

    def rp_pilot_fields(self, cores: int, ranks_per_node: Optional[int]) -> dict:
        from hetflow.executors.radical.configs import minutes

        fields = {"nodes": self.nodes, "cores": self.nodes * ranks_per_node,
                  "runtime": minutes(self.request.get("time", 60))}
        if self.gpus_per_node():
            fields["gpus"] = self.nodes * self.gpus_per_node()
        if self.request.get("partition"):
            fields["queue"] = self.request["partition"]
        return fields

    def rp_job_id(self, sandbox: str) -> Optional[str]:
        from hetflow.executors.radical.configs import job_running_in

        return job_running_in(sandbox)

    def rp_cleanup(self, sandbox: str, job_id: Optional[str]) -> None:
        from hetflow.executors.radical.configs import remove_psij_files

        remove_psij_files(sandbox, job_id)


def provider_for(slurm: Optional[dict] = None, provider: Optional[Provider] = None) -> Provider:
    """The provider a runtime's ``slurm=`` / ``provider=`` arguments name (one at most);
    by default the allocation hetflow runs in, else this machine."""
    if slurm is not None and provider is not None:
        raise ConfigError("give slurm= (shorthand for provider=SlurmJob(...)) or provider=, "
                          "not both")
    if provider is not None:
        if not isinstance(provider, Provider):
            raise ConfigError(f"provider must be a hetflow.executors.providers.Provider, "
                              f"got {provider!r}")
        return provider
    if slurm is not None:
        return SlurmJob(slurm)
    found = batch.current()
    return CurrentAllocation(found) if found is not None else ThisMachine()


def hours_minutes_seconds(limit) -> str:
    """A Slurm time limit (see ``allocation.time_limit_s``) as ``HH:MM:SS``."""
    total = batch.time_limit_s(limit, "parsl")
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


class _PrivateLocalProvider(LocalProvider):
    """Parsl's LocalProvider whose blocks (submit script, its output files, the worker
    pool and everything under it) are created owner-only (see ``taskdir.private_umask``):
    a block may be started later, by Parsl's strategy thread, outside ``hetflow.runtime``'s
    start-up."""

    def submit(self, command, tasks_per_node, job_name="parsl.localprovider"):
        with private_umask():
            return super().submit(command, tasks_per_node, job_name)


class _PrivateSlurmProvider(SlurmProvider):
    """Parsl's SlurmProvider whose submit scripts and job output are owner-only."""

    def submit(self, command, tasks_per_node, job_name="parsl.slurm"):
        with private_umask():
            return super().submit(command, tasks_per_node, job_name)
