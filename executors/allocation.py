"""The batch allocation hetflow runs in, if any: its nodes and CPUs, from Slurm's environment.

Inside ``salloc`` or ``sbatch`` a runtime must size itself from the allocation
(not from this node's cores) and name the allocation's nodes to its launcher:
Hydra given ``-hosts localhost,...`` inside an allocation asks Slurm for a step on
a node that is not in it and hangs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional

from hetflow.executors import slurm_tool
from hetflow.executors.slurm_tool import srun_prefix  # noqa: F401 - the pool's import


@dataclass(frozen=True)
class Allocation:
    """A Slurm job's nodes (in Slurm's order) and each node's CPUs."""

    job_id: str
    nodes: tuple
    cpus: tuple

    @property
    def total_cpus(self) -> int:
        return sum(self.cpus)

    def slots(self, count: int) -> List[str]:
        """``count`` slot names: each node once per CPU, nodes in order (node-packed), then
        round again over the same order if ``count`` oversubscribes the allocation."""
        order = [node for node, cpus in zip(self.nodes, self.cpus) for _ in range(cpus)]
        return [order[i % len(order)] for i in range(count)] if order else []


def expand_hostlist(hostlist: str) -> List[str]:
    """Slurm's compressed host list (``n[1-2],login3``) as names, by ``scontrol`` if present."""
    named = slurm_tool.hostnames(hostlist)
    if named:
        return named
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", hostlist):
        match = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not match:
            names.append(part)
            continue
        for rng in match.group(2).split(","):
            lo, _, hi = rng.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{match.group(1)}{i:0{len(lo)}d}")
    return names


def expand_counts(spec: str) -> List[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``2(x2),1``) as one count per node."""
    counts = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def current(environ=None) -> Optional[Allocation]:
    """The Slurm allocation this process runs in, or None outside one."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    hostlist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job or not hostlist:
        return None
    nodes = expand_hostlist(hostlist)
    cpus = expand_counts(env.get("SLURM_JOB_CPUS_PER_NODE", ""))
    if len(cpus) != len(nodes):
        cpus = [1] * len(nodes)
    return Allocation(job, tuple(nodes), tuple(cpus))


def default_slots() -> int:
    """Rank slots a runtime has by default: the allocation's CPUs inside one, else this
    machine's cores."""
    found = current()
    return found.total_cpus if found is not None else (os.cpu_count() or 1)


REQUEST_KEYS = ("nodes", "ntasks", "partition", "time", "gpus_per_node", "args")


def check_request(request: dict) -> dict:
    """A pilot's Slurm request (``slurm=`` of a runtime) with its keys checked; a copy."""
    unknown = set(request) - set(REQUEST_KEYS)
    if unknown:
        from hetflow.errors import ConfigError
        raise ConfigError(f"unknown Slurm request key(s) {sorted(unknown)}; known: "
                          f"{', '.join(REQUEST_KEYS)}")
    gpus = request.get("gpus_per_node")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        from hetflow.errors import ConfigError
        raise ConfigError(f"slurm gpus_per_node must be a count (int >= 0), got {gpus!r}")
    return dict(request)


def time_limit_s(limit, runtime: str) -> int:
    """A pilot's Slurm time limit (``time`` of its request), minutes (``30``, ``"30"``) or
    ``"HH:MM:SS"``, in seconds; anything else is a ``ConfigError`` naming ``runtime``."""
    text = str(limit).strip()
    parts = text.split(":")
    if len(parts) not in (1, 3) or not all(p.isdigit() for p in parts):
        from hetflow.errors import ConfigError
        raise ConfigError(f"slurm time must be minutes or 'HH:MM:SS' for {runtime}, "
                          f"got {limit!r}")
    if len(parts) == 1:
        return int(text) * 60
    hours, minutes, seconds = map(int, parts)
    return hours * 3600 + minutes * 60 + seconds


def request_slots(request: dict, env_var: str = "SBATCH_PARTITION") -> int:
    """Rank slots a request asks for: ``ntasks``, else its nodes' CPUs (``sinfo``; the
    partition as :func:`partition_sinfo` finds it: a pilot job is an ``sbatch`` job)."""
    return request.get("ntasks") or (
        request.get("nodes", 1) * partition_cpus_per_node(request.get("partition"), env_var))


class BatchAllocation:
    """An allocation a pilot asks the batch system for itself, as a user on a login node
    would (``salloc --no-shell``), and gives back at shutdown (``scancel``).

    ``request``: ``nodes``, ``ntasks``, ``partition``, ``time`` (Slurm's format, e.g.
    ``"30"`` minutes; without it the allocation outlives a SIGKILLed client until the
    partition's limit), ``args`` (more ``salloc`` options).
    """

    def __init__(self, request: dict):
        self.request = check_request(request)
        self.job_id: Optional[str] = None

    def submit(self, name: str, timeout: Optional[float] = None) -> str:
        """Wait until Slurm grants the allocation; its job id."""
        r = self.request
        options = [f"--job-name={name}"]
        options += [f"--nodes={r['nodes']}"] if r.get("nodes") else []
        options += [f"--ntasks={r['ntasks']}"] if r.get("ntasks") else []
        options += [f"--partition={r['partition']}"] if r.get("partition") else []
        options += [f"--time={r['time']}"] if r.get("time") else []
        options += [f"--gpus-per-node={r['gpus_per_node']}"] if r.get("gpus_per_node") else []
        self.job_id = slurm_tool.salloc([*options, *r.get("args", ())], timeout)
        return self.job_id

    def release(self) -> None:
        """Give the allocation back (idempotent)."""
        if self.job_id is not None:
            slurm_tool.scancel(self.job_id)
            self.job_id = None


def partition_sinfo(field: str, partition: Optional[str] = None,
                    env_var: Optional[str] = None) -> List[str]:
    """``sinfo``'s ``field`` (``"%C"``, ``"%c"``, ...) on each of its lines for the
    partition a job is sent to: ``partition``, else ``$env_var`` (the submitting tool's
    own, ``SBATCH_PARTITION`` or ``SALLOC_PARTITION``), else the cluster's default (the
    one ``sinfo`` marks ``*``). Without a partition ``sinfo`` lists every partition, and
    a node in several is listed once in each. ``LaunchError`` (with sinfo's words) if
    ``sinfo`` fails."""
    partition = partition or (os.environ.get(env_var) if env_var else None) or None
    rows = slurm_tool.sinfo(field, partition)
    if partition is None:
        rows = [row for row in rows if row[0].endswith("*")]
    return [row[1].strip() for row in rows if len(row) == 2]


def partition_cpus_per_node(partition: Optional[str] = None,
                            env_var: str = "SALLOC_PARTITION") -> int:
    """The fewest CPUs a node of the partition a job lands in has (``sinfo``; see
    :func:`partition_sinfo`), 1 if unknown."""
    from hetflow.errors import LaunchError

    try:
        cpus = [int(c.rstrip("+")) for c in partition_sinfo("%c", partition, env_var)]
    except (LaunchError, ValueError):
        return 1
    return min(cpus) if cpus else 1


def write_nodefile(path: str, count: int, environ=None) -> List[str]:
    """Write ``count`` slot lines (one node name each, node-packed, see
    :meth:`Allocation.slots`) for the allocation this process runs in; the lines.

    Run inside a batch job whose nodes the client cannot know in advance (a Parsl
    block submitted by ``SlurmProvider``): ``python -m hetflow.executors.allocation
    nodefile PATH COUNT``.
    """
    found = current(environ)
    if found is None:
        raise RuntimeError("not inside a Slurm allocation (no $SLURM_JOB_ID / node list)")
    lines = found.slots(count)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(f"{node}\n" for node in lines))
    return lines


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "nodefile":
        sys.exit("usage: python -m hetflow.executors.allocation nodefile PATH COUNT")
    write_nodefile(sys.argv[2], int(sys.argv[3]))
