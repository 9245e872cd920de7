"""Where a runtime's long-lived processes run: this machine, the Slurm allocation hetflow
runs in, or a batch job of their own.

The pool's MPI world, Parsl's worker pool and RADICAL-Pilot's pilot live as long as the
runtime. A provider describes where they run in no runtime's terms, as a
:class:`Placement` (nodes, rank slots per node, the hosts of the slots, a launcher
prefix, the environment, and the batch job still to be submitted, if any); each runtime
translates that description into its own configuration (the pool: its launcher;
Parsl: an ``ExecutionProvider`` and a node file, in ``parsl_htex.py``; RADICAL-Pilot: a
resource config and pilot fields, in ``radical/configs.py``). ``slurm={...}`` on a
runtime is the shorthand for ``provider=SlurmJob({...})``; inside an allocation
(``salloc``/``sbatch``) the default is :class:`CurrentAllocation`, else
:class:`ThisMachine`.

A batch system is one class: subclass :class:`Provider` and implement, for that system,

- :meth:`~Provider.placement` (``slots`` rank slots): the nodes, slots per node, and
  either the slots' hosts (known here) or a :class:`BatchJob` (``system``, e.g.
  ``"pbs"``; partition/queue, walltime, the job script's directives such as
  ``#PBS -l select=2:ngpus=4``, and ``hosts_command``, which writes the slots' hosts
  from inside the job, from ``$PBS_NODEFILE``); after :meth:`~Provider.start`, the
  launcher prefix that starts ranks in the job it was granted;
- :meth:`~Provider.default_slots`: the slots a job gets when the user names none
  (``pbsnodes``' CPUs of the queue's nodes);
- :meth:`~Provider.start` / :meth:`~Provider.stop`: obtain the job (``qsub -I``-like, or
  ``qsub`` of a sleeping script) for a runtime that launches into it, and give it back
  (``qdel``);
- :meth:`~Provider.job_in` / :meth:`~Provider.job_active`: find, and wait for the end
  of, a job a runtime's own submitter made (``qstat``).

Each runtime maps ``BatchJob.system`` to its own submitter (Parsl's ``PBSProProvider``,
RP's ``PBSPRO`` resource manager): a runtime without one refuses the provider with a
ConfigError naming the system. The PBS commands themselves belong in one module, as
Slurm's do in ``slurm_tool.py``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from hetflow.errors import ConfigError
from hetflow.executors import allocation as batch
from hetflow.executors import slurm_tool


@dataclass(frozen=True)
class BatchJob:
    """A batch job still to be submitted for a runtime's processes (by the runtime's own
    submitter, or by :meth:`Provider.start`)."""

    system: str                             # the batch system: "slurm"
    partition: Optional[str] = None         # its partition/queue (None: the default)
    walltime_s: int = 3600
    directives: Tuple[str, ...] = ()        # job-script lines for what has no field
    options: Tuple[str, ...] = ()           # the user's extra submit options (raw)
    #: argv run inside the job, ``PATH COUNT`` appended: writes COUNT slot lines (hosts).
    hosts_command: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where a runtime's processes run, in no runtime's terms."""

    nodes: int = 1
    slots_per_node: Optional[int] = None    # None: every slot on this machine
    hosts: Optional[Tuple[str, ...]] = None  # one host per slot, if known here
    #: The ranks' prefix ("{ranks}" replaced; None: mpiexec here); with a job, in the job.
    launcher: Optional[Tuple[str, ...]] = None
    env: Dict[str, str] = field(default_factory=dict)   # what the processes need set
    gpus_per_node: Optional[int] = None     # None: this machine's
    #: The batch system whose allocation the nodes are (its environment names them).
    batch_system: Optional[str] = None
    job: Optional[BatchJob] = None          # a job still to be submitted (None: the place exists)


class Provider:
    """Where a runtime's long-lived processes run (see the module docstring). Every
    method's default means "this machine"."""

    def default_slots(self, by_start: bool = False) -> Optional[int]:
        """Rank slots when the user gives no ``max_ranks`` (None: the kernel's default).
        ``by_start``: the job is the provider's own (:meth:`start`), not a runtime's."""
        return None

    def placement(self, slots: Optional[int]) -> Placement:
        """Where ``slots`` rank slots run now (before or after :meth:`start`)."""
        return Placement(hosts=("localhost",) * (slots or 0))

    def start(self, name: str, slots: int) -> None:
        """Obtain the job of :meth:`placement` (if any) for a runtime that launches into
        it; wait until it is granted."""

    def stop(self) -> None:
        """Give the place back (idempotent); after the processes ended."""

    def job_in(self, directory: str) -> Optional[str]:
        """The batch job working under ``directory`` (one a runtime submitted), or None."""
        return None

    def job_active(self, job_id: str) -> bool:
        """Whether the batch system still lists ``job_id``."""
        return False


class ThisMachine(Provider):
    """This machine: processes are the client's children."""


class _Slurm(Provider):
    """What every Slurm place answers alike: its jobs, found by ``squeue``."""

    def job_in(self, directory: str) -> Optional[str]:
        return slurm_tool.job_in(directory)

    def job_active(self, job_id: str) -> bool:
        return slurm_tool.job_listed(job_id)


class CurrentAllocation(_Slurm):
    """Inside the Slurm allocation hetflow runs in: its nodes and CPUs (Hydra starts its
    proxies on them with ``srun``)."""

    def __init__(self, found: batch.Allocation):
        self.allocation = found

    def default_slots(self, by_start: bool = False) -> Optional[int]:
        return self.allocation.total_cpus

    def placement(self, slots: Optional[int]) -> Placement:
        # A step takes its nodes' CPUs: one that holds them would make every later step
        # (a replacement, another task's) wait; hetflow places within max_ranks.
        return Placement(nodes=len(self.allocation.nodes),
                         slots_per_node=max(self.allocation.cpus),
                         hosts=tuple(self.allocation.slots(slots or 0)),
                         env={"SLURM_OVERLAP": "1"}, batch_system="slurm")


class SlurmJob(_Slurm):
    """A Slurm job of the runtime's own, submitted from here as a user on a login node
    would: ``request`` holds ``nodes``, ``ntasks``, ``partition``, ``time`` (Slurm's format,
    default 60 minutes), ``gpus_per_node`` (asked of Slurm: ``--gpus-per-node``) and
    ``args`` (more options). The pool's is an allocation (``salloc``, :meth:`start`) its
    world is launched into with ``srun``; Parsl's a block of its ``SlurmProvider``; RP's
    a pilot job (``sbatch`` through PSI/J)."""

    def __init__(self, request: dict):
        self.request = batch.check_request(request)
        self.nodes = int(self.request.get("nodes") or 1)
        self.walltime_s = batch.time_limit_s(self.request.get("time", 60), "the job")
        self.batch_allocation: Optional[batch.BatchAllocation] = None   # start()'s

    def default_slots(self, by_start: bool = False) -> Optional[int]:
        # (the partition each submitting tool defaults to: salloc's is start()'s)
        return batch.request_slots(self.request,
                                   "SALLOC_PARTITION" if by_start else "SBATCH_PARTITION")

    def placement(self, slots: Optional[int]) -> Placement:
        gpus = self.request.get("gpus_per_node")
        shape = dict(nodes=self.nodes, gpus_per_node=gpus, batch_system="slurm",
                     slots_per_node=-(-slots // self.nodes) if slots else None)
        # srun steps of start()'s allocation, once granted (a runtime's own job: in it).
        granted = self.batch_allocation is not None and self.batch_allocation.job_id
        shape["launcher"] = tuple(slurm_tool.srun_launcher(granted or None))
        if granted:
            return Placement(**shape)
        args = tuple(self.request.get("args", ()))
        return Placement(**shape, job=BatchJob(
            "slurm", partition=self.request.get("partition"), walltime_s=self.walltime_s,
            directives=tuple(f"#SBATCH {arg}" for arg in
                             [*([f"--gpus-per-node={gpus}"] if gpus else []), *args]),
            options=args,
            hosts_command=(sys.executable, "-m", "hetflow.executors.allocation", "nodefile")))

    def start(self, name: str, slots: int) -> None:
        # Wait in the batch queue; the world is launched into the allocation.
        self.batch_allocation = batch.BatchAllocation({"ntasks": slots, **self.request})
        self.batch_allocation.submit(name)

    def stop(self) -> None:
        if self.batch_allocation is not None:
            self.batch_allocation.release()


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


@dataclass(frozen=True)
class RuntimePlace:
    """What every runtime takes from its ``slurm=``/``provider=``/``max_ranks``/``gpus``
    arguments: the provider, the rank slots and the GPUs per node."""

    provider: Provider
    max_ranks: Optional[int]
    gpus: object


def runtime_place(slurm: Optional[dict], provider: Optional[Provider],
                  max_ranks: Optional[int], gpus, by_start: bool = False) -> RuntimePlace:
    """The one set-up of a runtime's place (the pool, Parsl and RADICAL-Pilot alike): the
    provider its arguments name, ``max_ranks`` defaulting to the provider's slots and
    ``gpus`` to its nodes' GPUs. ``by_start``: the runtime has the provider obtain its
    job (:meth:`Provider.start`)."""
    runs_on = provider_for(slurm, provider)
    if max_ranks is None:
        max_ranks = runs_on.default_slots(by_start)
    if gpus is None:
        gpus = runs_on.placement(None).gpus_per_node
    return RuntimePlace(runs_on, max_ranks, gpus)
