"""A provider describes where a runtime's processes run in no runtime's terms (a
``Placement``); each runtime translates it into its own configuration. These tests take
each kind of place through each runtime's translation into the real Parsl, RADICAL-Pilot
and pool objects, and check that Slurm's commands are run from one module only."""
from __future__ import annotations

import ast
import os
import subprocess

import pytest
import radical.pilot as rp
from parsl.providers import LocalProvider, SlurmProvider

import hetflow
from conftest import ROOT
from hetflow.executors.allocation import Allocation
from hetflow.executors.parsl_htex import ParslMPIExecutor, nodefile_lines, parsl_provider
from hetflow.executors.pool import PoolExecutor
from hetflow.executors.pool.worlds import launcher_prefix
from hetflow.executors.providers import (BatchJob, CurrentAllocation, Placement, SlurmJob,
                                         ThisMachine)
from hetflow.executors.radical import RadicalExecutor, configs

ALLOCATION = Allocation("7", ("n1", "n2"), (2, 2))
REQUEST = {"nodes": 2, "ntasks": 4, "partition": "debug", "time": "30", "gpus_per_node": 1}


def _places():
    return {"here": ThisMachine(), "allocation": CurrentAllocation(ALLOCATION),
            "job": SlurmJob(REQUEST)}


def test_a_placement_round_trips_into_parsl(tmp_path):
    places = _places()
    for name, provider in places.items():
        built = parsl_provider(provider.placement(4), "echo init")
        assert isinstance(built, SlurmProvider if name == "job" else LocalProvider), name
        assert built.worker_init.strip() == "echo init"
    job = parsl_provider(places["job"].placement(4), "")
    assert (job.partition, job.nodes_per_block, job.cores_per_node, job.walltime) == (
        "debug", 2, 2, "00:30:00")
    assert job.scheduler_options.startswith("#SBATCH --gpus-per-node=1\n")
    assert parsl_provider(SlurmJob({"nodes": 1, "args": ["--exclusive"]}).placement(2),
                          "").scheduler_options.startswith("#SBATCH --exclusive\n")

    # The node file: written here where the hosts are known, else inside the job, where
    # the command the translation returns reads the job's own environment.
    lines = {}
    for name, provider in places.items():
        path = str(tmp_path / f"nodefile-{name}")
        command = nodefile_lines(provider.placement(4), path, 4)
        assert (command != "") == (name == "job"), name
        if command:
            env = {**os.environ, "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[3-4]",
                   "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
            subprocess.run(command, shell=True, check=True, env=env)
        lines[name] = open(path).read().split()
    assert lines == {"here": ["localhost"] * 4, "allocation": ["n1", "n1", "n2", "n2"],
                     "job": ["n3", "n3", "n4", "n4"]}

    # The executor's own set-up takes the same translation.
    ex = ParslMPIExecutor(slurm=REQUEST)
    assert isinstance(ex.provider, SlurmProvider)
    assert (ex.max_ranks, ex.gpus, ex.provider.nodes_per_block) == (4, 1, 2)
    ex = ParslMPIExecutor(provider=CurrentAllocation(ALLOCATION))
    assert isinstance(ex.provider, LocalProvider) and ex.max_ranks == 4


def test_a_placement_round_trips_into_radical():
    made = {}
    for name, provider in _places().items():
        place = provider.placement(4)
        configs.check(place)
        resources = {label: rp.ResourceConfig(from_dict=config)
                     for label, config in configs.resource_config(place, 9, "/tmp/x").items()}
        pilot = rp.PilotDescription({"resource": configs.resource_label(place),
                                     **configs.pilot_fields(place, 9)})
        made[name] = (resources, pilot, dict(place.env))
    resources, pilot, env = made["here"]
    assert resources["local"].resource_manager == "FORK"
    assert (pilot.resource, pilot.cores, pilot.nodes, env) == ("hetflow.local", 9, 0, {})
    resources, pilot, env = made["allocation"]
    assert (resources["local"].resource_manager, resources["local"].cores_per_node) == (
        "SLURM", 9)
    assert (pilot.resource, pilot.nodes, pilot.cores) == ("hetflow.local", 2, 18)
    assert env == {"SLURM_OVERLAP": "1"}
    resources, pilot, env = made["job"]
    slurm = resources["slurm"]
    assert (slurm.resource_manager, slurm.default_queue, slurm.cores_per_node) == (
        "SLURM", "debug", 2)
    assert slurm.schemas["batch"]["job_manager_endpoint"] == "slurm://localhost/"
    assert (pilot.resource, pilot.nodes, pilot.cores, pilot.gpus, pilot.runtime,
            pilot.queue) == ("hetflow.slurm", 2, 4, 2, 30, "debug")

    ex = RadicalExecutor(slurm=REQUEST)
    assert (ex.resource, ex.max_ranks, ex.gpus, ex.pilot.place.slots_per_node) == (
        "hetflow.slurm", 4, 1, 2)
    with pytest.raises(hetflow.ConfigError, match="no extra sbatch args"):
        RadicalExecutor(slurm={**REQUEST, "args": ["--exclusive"]})


def test_a_placement_round_trips_into_the_pool():
    here = PoolExecutor(provider=ThisMachine(), max_ranks=2)
    assert (here.launcher, here.max_ranks) == (None, 2) and here.mpiexec
    inside = PoolExecutor(provider=CurrentAllocation(ALLOCATION))
    assert (inside.launcher, inside.max_ranks) == (None, 4)
    job = PoolExecutor(slurm=REQUEST)
    assert (job.max_ranks, job.gpus, job.mpiexec) == (4, 1, None)
    command = launcher_prefix(4, launcher=job.launcher, mpiexec=None, mpiexec_args=(),
                              hostfile=None)
    assert [os.path.basename(command[0]), *command[1:]] == [
        "srun", "--mpi=pmi2", "--overlap", "--ntasks=4", "--kill-on-bad-exit=0"]
    with pytest.raises(hetflow.ConfigError, match="not both"):
        PoolExecutor(slurm=REQUEST, launcher=["mpiexec"])


def test_a_runtime_refuses_a_batch_system_it_has_no_submitter_for():
    place = Placement(nodes=2, slots_per_node=2, job=BatchJob("pbs", walltime_s=60))
    with pytest.raises(hetflow.ConfigError, match="parsl has no ExecutionProvider .*'pbs'"):
        parsl_provider(place, "")
    with pytest.raises(hetflow.ConfigError, match="radical has no resource manager .*'pbs'"):
        configs.check(place)


#: Slurm's commands (slurm_tool.COMMANDS, spelled out: the test must not trust the module).
SLURM_COMMANDS = {"salloc", "sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo"}


def _names_a_slurm_command(text: str) -> bool:
    words = text.split()
    return bool(words) and words[0] in SLURM_COMMANDS and (
        len(words) == 1 or words[1].startswith("-"))


def slurm_commands_outside_slurm_tool(root=ROOT):
    """``path:line: 'text'`` of every string in hetflow's code (docstrings aside) that is a
    Slurm command, or a command line starting with one, outside ``executors/slurm_tool.py``."""
    found = []
    for top in ("executors", "hetflow"):
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)
                if not name.endswith(".py") or rel == os.path.join("executors", "slurm_tool.py"):
                    continue
                tree = ast.parse(open(path).read(), rel)
                docstrings = {id(node.value) for node in ast.walk(tree)
                              if isinstance(node, ast.Expr)}
                found += sorted(f"{rel}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                                and id(node) not in docstrings
                                and _names_a_slurm_command(node.value))
    return found


def test_only_slurm_tool_runs_slurm_commands(tmp_path):
    assert slurm_commands_outside_slurm_tool() == []
    # The check finds what it looks for: a module running squeue and srun by bare name
    # (and lets slurm_tool.py, and prose about the commands, be).
    (tmp_path / "executors").mkdir()
    (tmp_path / "executors" / "bare.py").write_text(
        '"""Asks squeue; srun -n 2 runs the step."""\nimport subprocess\n'
        'subprocess.run(["squeue", "-h"])\nsubprocess.run("srun -n 2 hostname", shell=True)\n'
        'print("sinfo failed: no partition")\n')
    (tmp_path / "executors" / "slurm_tool.py").write_text('COMMANDS = ("sinfo",)\n')
    assert slurm_commands_outside_slurm_tool(str(tmp_path)) == [
        "executors/bare.py:3: 'squeue'", "executors/bare.py:4: 'srun -n 2 hostname'"]
