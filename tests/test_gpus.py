"""GPUs as a scheduled resource, on plain data (no MPI): the one rank binding, the queue's
devices, the pool's GPU slots, and what the Slurm runtime and pilots ask Slurm for. The
same scheduling under real concurrency, on every runtime, is in test_parity.py
(``test_gpu_tasks_get_disjoint_devices_and_wait_for_free_ones``)."""
import os

import pytest

import hetflow
from hetflow.executors.pool.scheduler import PoolScheduler
from hetflow.executors._rank import bind_gpus, visible_devices
from hetflow.executors.scheduler import SlotScheduler
from hetflow.spec import Resources, gpu_ids


def test_each_local_rank_gets_its_own_block():
    assert [visible_devices(["7", "4", "9"], r, 1) for r in range(4)] == ["7", "4", "9", ""]
    assert [visible_devices(list("abcd"), r, 2) for r in range(3)] == ["a,b", "c,d", ""]
    assert visible_devices(["0", "1"], 0, 0) == ""          # a CPU task sees no GPU


def test_binding_leaves_the_launchers_alone_without_device_ids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    bind_gpus(None, 0, 1)                                   # Slurm's binding, or no GPUs
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    bind_gpus(["5", "6"], 1, 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"


def test_gpus_option_takes_a_count_or_device_ids(monkeypatch):
    assert gpu_ids(2) == ["0", "1"]
    assert gpu_ids([3, "GPU-1a2b"]) == ["3", "GPU-1a2b"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,-1,2")
    assert gpu_ids(None) == ["3", "1"]                      # CUDA stops at the first -1
    for bad in (-1, ["1", "1"], ["0,1"], [True], 1.5):
        with pytest.raises(hetflow.ConfigError, match="gpus"):
            gpu_ids(bad)


def test_gpu_tasks_wait_for_free_devices_and_cpu_tasks_pass():
    sched = SlotScheduler(4, devices=["7", "4"])
    sched.push("a", 2, gpus=2)
    sched.push("b", 1, gpus=1)      # a slot is free, no device: waits
    sched.push("cpu", 1)            # passes it
    ready = sched.pop_ready()
    assert ready == [("a", [0, 1], ["7", "4"]), ("cpu", [2], [])]
    assert sched.pop_ready() == []
    sched.release([0, 1])
    sched.release_devices(["4", "7"])
    assert sched.free_devices == ["7", "4"]                 # in declared order again
    assert sched.pop_ready() == [("b", [0], ["7"])]


def test_a_task_needing_more_gpus_than_declared_is_refused_at_call_time():
    from hetflow.executors.mpirun import MpirunExecutor

    executor = MpirunExecutor(max_ranks=4, gpus=["7", "4"])
    executor.check_resources(Resources(ranks=2, gpus_per_rank=1))
    with pytest.raises(hetflow.ResourcesUnavailable, match=r"3 GPU\(s\).*\['7', '4'\]"):
        executor.check_resources(Resources(ranks=3, gpus_per_rank=1))


class _Task:
    def __init__(self, gpus):
        self.gpus = gpus


def test_pool_gives_gpu_tasks_gpu_slots_and_cpu_tasks_the_others_first():
    sched = PoolScheduler(gpus_of=lambda task: task.gpus)
    for slot in range(4):
        sched.add_slot(slot, 0, "n1", slot, gpu=slot < 2)   # ranks 0, 1 bound a GPU each
    sched.release(range(4))
    assert sched.take(_Task(0), 1) == [2]
    assert sched.take(_Task(1), 1) == [0]
    assert sched.take(_Task(1), 2) is None                  # one GPU slot left
    assert sched.take(_Task(0), 2) == [1, 3]                # CPU slots short: GPU ones too
    assert sched.world_sizes(gpu=True) == {0: 2}


def test_slurm_jobs_and_pilots_ask_slurm_for_gpus():
    from hetflow.executors import allocation, providers
    from hetflow.executors.parsl_htex import parsl_provider
    from hetflow.executors.radical import configs
    from hetflow.executors.slurm import _gpu_args

    assert _gpu_args(Resources(ranks=2, gpus_per_rank=1)) == ["--gpus-per-task=1"]
    assert _gpu_args(Resources(ranks=2)) == []
    job = providers.SlurmJob({"nodes": 2, "gpus_per_node": 4, "time": 5})
    place = job.placement(4)
    assert place.gpus_per_node == 4
    assert "#SBATCH --gpus-per-node=4\n" in parsl_provider(place, "").scheduler_options
    assert configs.pilot_fields(place, 4)["gpus"] == 8
    with pytest.raises(hetflow.ConfigError, match="gpus_per_node"):
        allocation.check_request({"gpus_per_node": "two"})


RAPTOR_RANKS = '''
import os, sys
from mpi4py import MPI
import mpiutil
from hetflow.executors.radical.rank import raptor_rank
from hetflow.executors.payload import TaskPayload
from hetflow.executors.taskdir import TaskDir
from hetflow.spec import Resources

world = MPI.COMM_WORLD
taskdir = TaskDir(os.path.join(sys.argv[1], "task"))
if world.Get_rank() == 0:
    taskdir.create(b"", {}, [])
world.Barrier()
os.environ["CUDA_VISIBLE_DEVICES"] = "9"     # what the worker rank had before the task
payload = TaskPayload(0, os.getenv, ("CUDA_VISIBLE_DEVICES",), {},
                      Resources(ranks=2, gpus_per_rank=1)).dumps()
ok = raptor_rank(world, payload, taskdir.path, [], devices=["7", "4"], gpus_per_rank=1)
world.Barrier()
mpiutil.report((ok, taskdir.outcomes()[world.Get_rank()].load_value(),
                os.environ["CUDA_VISIBLE_DEVICES"]))
'''


def test_raptor_ranks_bind_their_own_device_for_the_task_only(tmp_path):
    from mpiutil import run_mpi

    got = run_mpi(RAPTOR_RANKS, 2, args=[tmp_path]).values(2)
    # each worker rank saw its own device during the task, and its own setting after it
    assert got == [(True, "7", "9"), (True, "4", "9")]
