"""The slurm runtime beyond the parity suite: the queue wait is its own phase, and a
launcher that does not wire the ranks into one world fails loudly.

(The parity and fault suites run on it too: ``conftest.PARITY_EXECUTORS``.)
"""
import os
import subprocess
import time

import pytest

import hetflow
from conftest import PARTITION_NODES, SECOND_PARTITION

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


@hetflow.mpi_app(ranks=2, returns="all")
def sizes(comm):
    return comm.Get_size()


@hetflow.mpi_app(ranks=1)
def hostname(comm):
    import socket

    return socket.gethostname()


def test_queue_wait_is_its_own_phase(tmp_path):
    # Another user's job holds every CPU of the cluster for a while: hetflow's job waits
    # in Slurm's queue, and that wait is the task's queue phase, not its function's time.
    hold_s = 4
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=4", f"--output={tmp_path}/blocker.out",
         "--wrap", f"sleep {hold_s}"], capture_output=True, text=True, check=True)
    job = blocker.stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 60
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                             text=True).stdout.strip() != "RUNNING":
            assert time.time() < deadline, "the blocking job never started"
            time.sleep(0.1)
        with hetflow.runtime("slurm", max_ranks=4):
            fut = hostname()
            assert fut.result(timeout=120) in ("n1", "n2")
            times = hetflow.task_times(fut)
    finally:
        subprocess.run(["scancel", job])
    assert times.submitted <= times.launched <= times.started <= times.finished
    assert times.queue_s >= hold_s / 2, times       # it waited behind the blocker
    assert times.queue_s > times.function_s
    assert times.as_dict()["queue_s"] == times.queue_s


def test_srun_without_pmi_fails_loudly():
    # With MpiDefault=none, `srun --mpi=none -n 2` starts two 1-rank worlds and exits 0;
    # the rank runner sees the world is not the task's and says so.
    with hetflow.runtime("slurm", max_ranks=4, srun_args=["--mpi=none"]):
        with pytest.raises(hetflow.TaskFailed, match="world of 1 rank"):
            sizes().result(timeout=120)
    with hetflow.runtime("slurm", max_ranks=4):
        assert sizes().result(timeout=120) == [2, 2]


@hetflow.mpi_app(ranks=4, returns="all")
def where(comm):
    import socket

    return socket.gethostname()


def _job_state(job):
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState"), fields.get("NodeList")


def test_pool_started_by_the_batch_system():
    # As a user on a login node: the pool asks Slurm for its own 2-node allocation, runs
    # its world there, and gives the allocation back at shutdown.
    with hetflow.runtime("pool", slurm={"nodes": 2, "ntasks": 4, "time": "5"}) as dfk:
        pool = dfk.executors["pool"]
        job = pool.batch.job_id
        assert pool.max_ranks == 4
        assert _job_state(job) == ("RUNNING", "n[1-2]")
        assert where().result(timeout=120) == ["n1", "n1", "n2", "n2"]
    deadline = time.time() + 30
    while _job_state(job)[0] not in ("CANCELLED", "COMPLETED", None):
        assert time.time() < deadline, _job_state(job)
        time.sleep(0.2)


@hetflow.mpi_app(ranks=2, returns="all")
def pair_where(comm, meet):
    """Each task's rank 0 waits in ``meet`` until the other task has arrived too, so
    both hold their nodes at once (a task that finished first would free its node)."""
    import os
    import socket
    import time

    if comm.Get_rank() == 0:
        open(os.path.join(meet, str(os.getpid())), "w").close()
        deadline = time.time() + 60
        while len(os.listdir(meet)) < 2:
            if time.time() > deadline:
                raise TimeoutError("the other 2-rank task did not start beside this one")
            time.sleep(0.02)
    comm.Barrier()
    return socket.gethostname()


def _gone(job):
    """Wait until Slurm no longer runs ``job`` (the runtime gave it back at shutdown)."""
    deadline = time.time() + 60
    while _job_state(job)[0] not in ("CANCELLED", "COMPLETED", None):
        assert time.time() < deadline, _job_state(job)
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_parsl_started_by_the_batch_system(tmp_path):
    # Parsl's SlurmProvider submits the block (the worker pool) as a 2-node job; the
    # pool writes its node file from the job, and Hydra places the ranks on its nodes.
    with hetflow.runtime("parsl", slurm={"nodes": 2, "ntasks": 4, "time": "5"}) as dfk:
        parsl = dfk.executors["parsl"]
        assert parsl.max_ranks == 4
        assert where().result(timeout=240) == ["n1", "n1", "n2", "n2"]
        pair = [pair_where(str(tmp_path)), pair_where(str(tmp_path))]   # a node each
        assert sorted(f.result(timeout=90) for f in pair) == [["n1", "n1"], ["n2", "n2"]]
        (job,) = parsl.provider.resources
        assert _job_state(job) == ("RUNNING", "n[1-2]")
    _gone(job)


@pytest.mark.timeout(600)
@pytest.mark.slurm_partition(SECOND_PARTITION)
def test_radical_started_by_the_batch_system():
    # The pilot is a Slurm job (hetflow's Slurm resource config) in the partition it
    # names (not the default one): its agent runs in the job on its first node, its
    # RAPTOR worker's ranks on both nodes, node by node.
    first, second = PARTITION_NODES[SECOND_PARTITION]
    psij = os.path.expanduser("~/.psij/work/slurm")
    before = set(os.listdir(psij)) if os.path.isdir(psij) else set()
    with hetflow.runtime("radical", startup_timeout=300,
                         slurm={"nodes": 2, "ntasks": 4, "time": "8",
                                "partition": SECOND_PARTITION}) as dfk:
        radical = dfk.executors["radical"]
        job = radical.slurm_job_id
        assert radical.max_ranks == 4
        assert job is not None and _job_state(job) == ("RUNNING", f"n[{first[1:]}-{second[1:]}]")
        assert where().result(timeout=120) == [first, first, second, second]
        assert sizes().result(timeout=120) == [2, 2]
    _gone(job)
    # PSI/J (RP's job submitter) leaves the job's script, output and launcher log in ~/.psij:
    # removed (PSI/J's own clean-up comes with its queue poll, which the close does not wait for)
    assert not os.path.exists(os.path.join(psij, f"{job}.out"))
    assert set(os.listdir(psij)) <= before, set(os.listdir(psij)) - before


def test_pilot_slurm_requests_are_checked():
    from hetflow.executors.parsl_htex import ParslMPIExecutor
    from hetflow.executors.radical import RadicalExecutor

    with pytest.raises(hetflow.ConfigError, match="unknown Slurm request key"):
        ParslMPIExecutor(slurm={"nodes": 2, "gpus": 1})
    with pytest.raises(hetflow.ConfigError, match="minutes or 'HH:MM:SS'"):
        ParslMPIExecutor(slurm={"nodes": 2, "time": "1-00"})
    # One reading of the time limit, in each pilot's unit: Parsl's HH:MM:SS, RP's minutes.
    from hetflow.executors.parsl_htex import hours_minutes_seconds as _hours_minutes_seconds
    from hetflow.executors.radical.configs import minutes as _minutes
    for limit, hms, minutes in [(30, "00:30:00", 30), ("90", "01:30:00", 90),
                                ("01:02:03", "01:02:03", 63), (" 5 ", "00:05:00", 5)]:
        assert (_hours_minutes_seconds(limit), _minutes(limit)) == (hms, minutes)
    for bad in ("1-00", "1:00", "", "-5", "1.5"):
        for read in (_hours_minutes_seconds, _minutes):
            with pytest.raises(hetflow.ConfigError, match="minutes or 'HH:MM:SS'"):
                read(bad)
    with pytest.raises(hetflow.ConfigError, match="not both"):
        RadicalExecutor(slurm={"nodes": 2}, resource="site.slurm", config_dir="/")
    with pytest.raises(hetflow.ConfigError, match="no extra sbatch args"):
        RadicalExecutor(slurm={"nodes": 2, "args": ["--exclusive"]})
    assert RadicalExecutor(slurm={"nodes": 2}).max_ranks == 4     # the nodes' CPUs (sinfo)


def test_partition_sizes_are_the_partitions_own(monkeypatch, tmp_path):
    # sinfo lists every partition (the test cluster has two of 4 CPUs each): a runtime
    # with no partition sizes itself from the one its jobs land in, not from all of them.
    from hetflow.executors.allocation import partition_cpus_per_node, partition_sinfo
    from hetflow.executors.slurm import SlurmExecutor, partition_cpus

    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    listed = subprocess.run(["sinfo", "-h", "-o", "%P %C"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert listed[::2] == ["debug*", SECOND_PARTITION], listed     # 8 CPUs in all
    assert partition_cpus() == partition_cpus("debug") == partition_cpus(SECOND_PARTITION) == 4
    assert SlurmExecutor().max_ranks == 4
    assert partition_sinfo("%N") == ["n[1-2]"]                     # the default: debug*
    assert partition_sinfo("%N", SECOND_PARTITION) == ["n[3-4]"]
    monkeypatch.setenv("SBATCH_PARTITION", SECOND_PARTITION)        # where sbatch sends jobs
    assert partition_sinfo("%N", env_var="SBATCH_PARTITION") == ["n[3-4]"]
    assert partition_sinfo("%N", "debug", env_var="SBATCH_PARTITION") == ["n[1-2]"]
    with pytest.raises(hetflow.LaunchError, match="no CPUs in partition nowhere"):
        partition_cpus("nowhere")
    # sinfo itself failing (a config it cannot read): its own words, not a count
    conf = tmp_path / "slurm.conf"
    conf.write_text("")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(hetflow.LaunchError, match=r"(?s)sinfo failed .*ClusterName"):
        partition_cpus()
    assert partition_cpus_per_node() == 1                           # the pilots' fallback


def test_parsl_ranks_packed_by_node():
    # Parsl's prefix lists one entry per core slot; Hydra would deal the ranks round robin.
    from hetflow.executors._parsl_worker import pack_hosts

    prefix = "mpiexec -n 4 -ppn 1 -hosts n1,n1,n2,n2".split()
    assert pack_hosts(prefix) == "mpiexec -n 4 -hosts n1:2,n2:2".split()
    # 2 ranks x 2 cores: a rank per node, on the first entry of its slots.
    assert pack_hosts("mpiexec -n 2 -ppn 1 -hosts n1,n1,n2,n2".split(), 2) == \
        "mpiexec -n 2 -hosts n1:1,n2:1".split()
    one_host = "mpiexec -n 2 -ppn 1 -hosts localhost,localhost".split()
    assert pack_hosts(one_host) == one_host
