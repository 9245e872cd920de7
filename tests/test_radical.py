"""What only the RADICAL-Pilot executor has: its resource config, its run dir, clean exit.

The parity suite (test_parity.py) covers results and errors on the shared
pilot; this file checks, on that same pilot, where RP's files go, and once it
has closed, that nothing was left running or on disk.
"""
import getpass
import glob
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

import hetflow
from conftest import open_descriptors, shared_runtime
from mpiutil import mpiexec
from test_parity import mark_and_sleep, raise_on_rank_one
from hetflow._guardian import marked_processes
from hetflow.executors._mpishm import mapped_mpi_shm
from hetflow.executors._forensics import launcher_named as _launcher_named
from hetflow.executors.radical import (LOCAL_RESOURCE, RadicalExecutor, local_resource_config,
                                       session_processes)


@hetflow.mpi_app(ranks=2, returns="all")
def where(comm):
    return (comm.Get_rank(), comm.Get_size(), os.getcwd())


@hetflow.mpi_app(ranks=1)
def append_pid(comm, path):
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    return "appended"


def test_ranks_of_a_task_stopped_before_they_started_do_not_run_it(tmp_path):
    # A walltime or cancel that comes while RP's agent is still launching an executable
    # task: RP's cancel does not stop that launch (its executing component fails on it),
    # and kill_launch_of finds no rank yet. The ranks started after find the stop asked for.
    from hetflow.executors.payload import TaskPayload
    from hetflow.executors._supervise import KILLED_EXIT
    from hetflow.executors.taskdir import TaskDir
    from hetflow.spec import Resources

    marker = tmp_path / "ran"
    taskdir = TaskDir(str(tmp_path / "task")).create(
        TaskPayload(task_id=1, func=open, args=(str(marker), "w"), kwargs={},
                    resources=Resources(ranks=2)).dumps(),
        {"ranks": 2}, sys.path)
    taskdir.ask_to_stop()
    run = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "hetflow.executors._rank",
                          taskdir.path], capture_output=True, text=True, timeout=120)
    assert run.returncode == KILLED_EXIT, run.stderr[-2000:]
    assert not marker.exists()
    assert taskdir.pids() == {} and taskdir.outcomes() == {}


def test_local_resource_config_uses_real_slots_and_the_venv_mpi():
    config = local_resource_config(5)["local"]
    assert config["cores_per_node"] == 5
    assert config["virtenv"] == sys.prefix
    bindir = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(bindir, "mpiexec"))
    assert config["launch_methods"]["order"][0] == "MPIEXEC"
    assert bindir in config["launch_methods"]["MPIEXEC"]["pre_exec_cached"][0]


def test_a_starting_worker_is_judged_by_what_was_seen_of_it():
    # The RAPTOR worker's decisions, without RP (as pool.faults.settle_lost's are).
    from hetflow.executors.radical.worker import WORKER_STARTS, judge_start

    def judge(**seen):
        facts = dict(uid="w1", ready=False, rp_state="AGENT_EXECUTING", launch_error=None,
                     waited_s=1.0, limit_s=300.0, failed_starts=0)
        return judge_start(**{**facts, **seen})

    assert judge().up is False and judge().why == ""                 # still starting: wait
    assert judge(ready=True).up                                       # rank 0's ready file
    assert judge(ready=True, rp_state="FAILED").up                    # up wins
    assert "ended (FAILED) before it came up" in judge(rp_state="FAILED").why
    srun = judge(launch_error="srun: error: Unable to confirm allocation")
    assert srun.why == "RAPTOR worker w1's launch failed: srun: error: Unable to confirm " \
                       "allocation" and not srun.give_up
    late = judge(waited_s=301.0)
    assert late.why == "RAPTOR worker w1 did not come up within 300 s" and not late.give_up
    assert judge(waited_s=301.0, failed_starts=WORKER_STARTS - 2).give_up is False
    assert judge(waited_s=301.0, failed_starts=WORKER_STARTS - 1).give_up is True
    assert judge(failed_starts=WORKER_STARTS + 5).give_up is False    # nothing failed now


def test_a_raptor_task_is_recycled_when_its_worker_died_or_its_peers_hang():
    from hetflow.executors.radical.executor import task_verdict
    from hetflow.executors.watch import PEER_GRACE_S

    assert task_verdict(worker_lost=True, rank_failed=False, failed_seen=None, now=5.0) == \
        (True, None)
    assert task_verdict(worker_lost=False, rank_failed=False, failed_seen=None, now=5.0) == \
        (False, None)
    # a rank raised: its peers get PEER_GRACE_S from when that was first seen
    assert task_verdict(worker_lost=False, rank_failed=True, failed_seen=None, now=5.0) == \
        (False, 5.0)
    assert task_verdict(worker_lost=False, rank_failed=True, failed_seen=5.0,
                        now=5.0 + PEER_GRACE_S) == (False, 5.0)
    assert task_verdict(worker_lost=False, rank_failed=True, failed_seen=5.0,
                        now=5.1 + PEER_GRACE_S) == (True, 5.0)


def test_bad_options_fail_at_construction():
    with pytest.raises(hetflow.ConfigError, match="mode"):
        RadicalExecutor(mode="fast")
    with pytest.raises(hetflow.ConfigError, match="config_dir"):
        RadicalExecutor(resource="mysite.slurm")
    with pytest.raises(hetflow.ConfigError, match="not a directory"):
        RadicalExecutor(resource="mysite.slurm", config_dir="/nonexistent/hetflow")


def test_user_resource_config_dir_is_handed_to_rp(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "resource_mysite.json").write_text(json.dumps({"slurm": {"cores_per_node": 128}}))
    ex = RadicalExecutor(resource="mysite.slurm", config_dir=str(site), max_ranks=4)
    ex.pilot.base = str(tmp_path / "run")
    saved = {k: os.environ.get(k) for k in ("RADICAL_CONFIG_USER_DIR", "PATH")}
    try:
        ex.pilot.set_environment()
        user_dir = os.environ["RADICAL_CONFIG_USER_DIR"]
        copied = os.path.join(user_dir, ".radical", "pilot", "configs", "resource_mysite.json")
        assert json.load(open(copied)) == {"slurm": {"cores_per_node": 128}}
        assert user_dir.startswith(ex.base)
    finally:
        for key, value in ex.pilot.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert {k: os.environ.get(k) for k in saved} == saved


@pytest.mark.on_shared_runtime("radical")
def test_rp_files_all_go_to_the_sandbox_dir_and_lost_starts_are_survived(shared_executor):
    # The shared pilot was started with sandbox_dir= (tests/conftest.py): RP's session
    # dir, pilot sandbox and task sandboxes all live there, its processes are found there.
    ex = shared_executor
    assert ex.resource == LOCAL_RESOURCE == "hetflow.local"
    sandbox = os.path.abspath(ex.sandbox_dir)
    assert ex.base == sandbox and ex.sandbox.startswith(sandbox + os.sep)
    ranks = where().result(timeout=120)
    assert [(r, s) for r, s, _ in ranks] == [(0, 2), (1, 2)]
    assert all(cwd.startswith(sandbox + os.sep) for _, _, cwd in ranks)
    assert os.listdir(os.path.join(sandbox, "sessions"))
    assert os.listdir(os.path.join(sandbox, "sandbox"))
    assert session_processes(sandbox), "the pilot's processes should be found"
    assert set(ex.timings) >= {"session_s", "pilot_s", "raptor_s"}
    # Its RAPTOR master dropped its first queue announcement (rp_faults, set by conftest), as a
    # ZeroMQ PUB socket does under load, and announced again: the pilot runs.
    (log,) = glob.glob(os.path.join(ex.sandbox, "*", "*", "pilot.0000", "raptor.0000.log"))
    assert "announcing it again" in open(log).read()
    # Its first pilot's agent blocked in its start-up (rp_faults, set by conftest), as RP's
    # agent now and then never reports itself active, and its second pilot's master was held
    # unplaced (rp_faults), as RP's agent scheduler now and then holds every task: the
    # runtime started a new pilot for each; the third runs.
    # (A worker replaced by the test above, if it ran first, comes after these two.)
    assert len([r for r in ex.restarts if "RAPTOR worker" not in r]) == 2, ex.restarts
    assert "did not report the pilot active" in ex.restarts[0], ex.restarts
    assert "did not place the RAPTOR master" in ex.restarts[1], ex.restarts
    assert len(glob.glob(os.path.join(ex.sandbox, "*", "rp.session.*"))) == 3


def _replaced_within_a_short_start(ex, before: int, timeout: float, failure: str) -> None:
    """Give the RAPTOR worker that is starting 5 s to come up (worker_start_s) and wait until
    the runtime has replaced it (``ex.restarts`` longer than ``before``); then 300 s again, so
    the next worker takes what it takes."""
    ex.worker_start_s = 5.0
    deadline = time.time() + timeout
    while len(ex.restarts) == before:
        assert time.time() < deadline, failure
        time.sleep(0.02)
    ex.worker_start_s = 300.0


@pytest.mark.on_shared_runtime("radical")
def test_a_worker_that_never_comes_up_is_replaced_and_queued_tasks_run_once(
        shared_executor, tmp_path, monkeypatch):
    # A RAPTOR worker whose launch hangs never registers with the master (seen inside a Slurm
    # allocation: its srun failed on a node whose slurmd did not answer, and Hydra waited on),
    # and every task sent meanwhile waited in the master's queue until the runtime closed.
    ex = shared_executor
    monkeypatch.setattr(ex.pilot.descriptions, "next_workers", ["hang", "hang"])
    monkeypatch.setattr(ex, "worker_start_s", ex.worker_start_s)   # restored after
    before = len(ex.restarts)
    # A failed rank recycles the worker; its next two replacements hang (rp_faults).
    with pytest.raises(hetflow.TaskFailed):
        raise_on_rank_one().result(timeout=120)
    log = tmp_path / "runs"
    first = next(ex.pilot.uid_counter)        # the RP tasks of this test's tasks come after it
    appended = append_pid(str(log))
    never = tmp_path / "never"
    doomed = mark_and_sleep(str(never), 600)
    time.sleep(1)
    # Cancelling a task the master holds recycles the (first hanging) worker: the other one
    # runs again under a new RP task, while its first copy is still in the master's queue.
    assert hetflow.cancel(doomed) is True
    with pytest.raises(hetflow.TaskCancelled):
        doomed.result(timeout=60)
    # The second hanging worker is replaced once it has had worker_start_s (made short here,
    # and long again as soon as it is replaced: the next worker takes what it takes).
    _replaced_within_a_short_start(ex, before, 60, "the hanging worker was not replaced")
    assert len(ex.restarts) == before + 1, ex.restarts
    assert "did not come up within 5 s" in ex.restarts[-1]
    assert appended.result(timeout=240) == "appended"      # on the worker started then
    # Every RP task sent since has ended: the copies the master held ran and did nothing
    # (the cancelled task's would sleep 600 s). (The failed task's never ends in RP: its
    # worker was killed under it.)
    deadline = time.time() + 60
    while not all(t.state in ("DONE", "FAILED", "CANCELED") for t in ex.pilot.tmgr.get_tasks()
                  if t.uid.startswith("hetflow.") and int(t.uid.split(".")[1]) > first):
        assert time.time() < deadline, "an RP task never ended"
        time.sleep(0.2)
    assert len(log.read_text().split()) == 1, "the task ran more than once"
    assert not never.exists(), "the cancelled task ran"
    assert len(ex.restarts) == before + 1, ex.restarts
    assert where().result(timeout=120)


@pytest.mark.on_shared_runtime("radical")
def test_a_worker_whose_srun_failed_is_replaced_at_once(shared_executor, monkeypatch):
    # Inside a Slurm allocation Hydra starts its proxies with srun; when srun fails (seen under
    # load: slurmctld did not answer it in time) Hydra waits on, and the worker would be
    # replaced only after worker_start_s. Its launch's stderr has the srun error: the runtime
    # reads it and replaces the worker then (rp_faults makes the next replacement print one and
    # hang, as Hydra does).
    ex = shared_executor
    monkeypatch.setattr(ex.pilot.descriptions, "next_workers", ["srun"])
    monkeypatch.setattr(ex, "worker_start_s", 300.0)      # not the path under test
    before = len(ex.restarts)
    with pytest.raises(hetflow.TaskFailed):          # a failed rank recycles the worker
        raise_on_rank_one().result(timeout=120)
    assert where().result(timeout=240)               # on the worker after the failed one
    new = ex.restarts[before:]
    assert len(new) == 1 and "launch failed: srun: error: Unable to confirm" in new[0], new


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.on_shared_runtime("radical")
def test_a_worker_killed_before_it_came_up_leaves_nothing_in_dev_shm(shared_executor,
                                                                     monkeypatch):
    # A worker killed while its ranks are past MPI_Init but not up has MPICH's segments still
    # named in /dev/shm (its ranks unlink them once up). Inside Slurm its ranks run under
    # slurmstepd, outside the launcher's tree whose kill reads the mappings: the runtime finds
    # them by their working dir, the worker's task sandbox. (Here, outside Slurm, the tree's
    # kill would find them too: that method is called alone, the launcher still running.)
    ex = shared_executor
    monkeypatch.setattr(ex.pilot.descriptions, "next_workers", ["init"])
    monkeypatch.setattr(ex, "worker_start_s", 300.0)      # replaced below, not by the clock
    before = len(ex.restarts)
    with pytest.raises(hetflow.TaskFailed):          # a failed rank recycles the worker
        raise_on_rank_one().result(timeout=120)
    deadline = time.time() + 120
    while True:                       # until every rank of its replacement is past MPI_Init
        uid = ex.worker.uid
        sandbox = ex.pilot.task_sandbox(uid)
        mapped = {p.pid: mapped_mpi_shm(p.pid)
                  for p in (session_processes(sandbox) if sandbox else [])}
        ranks = [pid for pid, paths in mapped.items() if paths]
        if len(ranks) == ex.max_ranks:
            break
        assert time.time() < deadline, f"the hanging worker's ranks did not map MPICH's " \
                                       f"segments: {mapped}"
        time.sleep(0.2)
    named = set().union(*mapped.values())
    assert not ex.worker.up
    launcher = ex.worker.launcher({})
    assert launcher is not None and psutil.pid_exists(launcher)
    assert ex.worker.kill_ranks(uid) >= len(ranks)
    assert not [path for path in named if os.path.exists(path)], named
    deadline = time.time() + 30
    while [pid for pid in ranks if _running(pid)]:
        assert time.time() < deadline, "the worker's ranks outlived the kill"
        time.sleep(0.1)
    # the runtime goes on: the worker is replaced (its launch fails, or the clock runs out)
    _replaced_within_a_short_start(ex, before, 120, "the killed worker was not replaced")
    assert where().result(timeout=240)
    assert len(ex.restarts) == before + 1, ex.restarts


@pytest.mark.on_shared_runtime("radical")
def test_raptor_worker_leaves_nothing_in_dev_shm(shared_executor):
    # Every rank of the RAPTOR worker unlinks its MPICH segments' names once the worker is up
    # (executors/radical/raptor_worker.py), as the other runtimes' ranks do (test_shm.py): a worker
    # recycled or killed (its ranks never reach MPI_Finalize) then leaves nothing in /dev/shm,
    # also on a node none of whose ranks ever ran a task.
    assert where().result(timeout=120)               # the worker is up
    ranks = [p for p in session_processes(shared_executor.base)
             if any("raptor-worker" in part for part in p.cmdline())]
    assert len(ranks) == shared_executor.max_ranks, ranks
    names = set()
    for proc in ranks:
        with open(f"/proc/{proc.pid}/maps") as fh:
            names |= {line.split(None, 5)[5].strip() for line in fh
                      if "/dev/shm/mpich_shm_" in line}
    assert names, "MPICH mapped no named segment: the mpich wheel's MPI is expected here"
    assert all(n.endswith(" (deleted)") for n in names), names


@pytest.mark.after_shared_runtime
@pytest.mark.parametrize("name", ["radical"])
def test_rp_sandbox_removed_and_no_process_left(name):
    # What the shared pilot's life (above, and the parity suite's tests) left behind once
    # it closed: nothing. Run alone, this test gives the shared runtime a life of its own.
    if name not in shared_runtime.lives:
        shared_runtime.use(name)
        shared_runtime.close()
    life = shared_runtime.lives[name]
    ex = life.executor
    assert life.scratch is not None and ex.sandbox_dir.startswith(life.scratch)
    # Its start took the life's own temp dir (conftest.SharedRuntime): its run dir was
    # there, and its tasks' ranks had it as TMPDIR; after the close it is empty.
    assert ex.run_dir.startswith(life.tmp + os.sep) and not os.path.exists(ex.run_dir)
    # (torch keeps its compile cache there on purpose, torchinductor_<user>: not a leak)
    torch_cache = f"torchinductor_{getpass.getuser()}"
    in_tmp = [p for p in life.tmp_left if p.split(os.sep)[0] != torch_cache]
    assert in_tmp == [], in_tmp[:50]
    assert life.scratch_left == [], life.scratch_left      # sandbox_dir itself removed
    assert "close_s" in ex.timings
    assert session_processes(os.path.abspath(ex.sandbox_dir)) == []
    assert not marked_processes(life.token)
    # A child the client had before the runtime outlived its close and its restarts (which
    # once killed every child of the client).
    assert life.bystander_outlived
    deadline = time.time() + 30                 # processes are reaped asynchronously
    while True:
        left = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in life.children and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    assert left == []
    for key in ("RADICAL_PILOT_BASE", "RADICAL_BASE", "RADICAL_CONFIG_USER_DIR", "TMPDIR"):
        assert os.environ.get(key) == life.environ.get(key), key
    # The client's descriptors are back to what they were before the start (the life
    # started, replaced pilots and workers, ran every shared test's tasks and closed; counted
    # from after RP's process-wide ZeroMQ context opened, see conftest.SharedRuntime)
    deadline = time.time() + 30
    while len(open_descriptors()) > len(life.fds) and time.time() < deadline:
        time.sleep(0.2)
    now = open_descriptors()
    assert len(now) <= len(life.fds), {fd: now[fd] for fd in now if now[fd] != life.fds.get(fd)}


def test_rp_client_listeners_end_before_their_sockets_are_closed(tmp_path, monkeypatch, capfd):
    # What a closed session leaves in the client, hetflow closes (release_client_handles).
    # RP's subscribers and queue getters poll their sockets from threads of their own
    # (0.5 s per poll). Closed under a poll, a socket ends its thread with 'listener died'
    # (ZMQ sockets are not thread-safe): seen once the radical close got fast. A getter's
    # listener also stays in RP's class-wide table by address, where a later session's
    # getter on a reused port would find it, dead, with its closed socket.
    import zmq
    from radical.utils.zmq.pubsub import Subscriber
    from radical.utils.zmq.queue import Getter

    from hetflow.executors.radical.hygiene import release_client_handles, rp_zmq_objects

    monkeypatch.chdir(tmp_path)                 # RP's loggers may write here
    before = rp_zmq_objects()
    ctx = zmq.Context()
    pub, rep = ctx.socket(zmq.PUB), ctx.socket(zmq.REP)   # a bridge's two ends, silent
    try:
        sub = Subscriber("hetflow_test", url=f"tcp://127.0.0.1:"
                         f"{pub.bind_to_random_port('tcp://127.0.0.1')}",
                         topic="t", cb=lambda *args: None)
        get = Getter("hetflow_test", url=f"tcp://127.0.0.1:"
                     f"{rep.bind_to_random_port('tcp://127.0.0.1')}", cb=lambda *args: None)
        threads = [sub._thread, Getter._callbacks[get._url]["thread"]]
        assert all(thread.is_alive() for thread in threads)
        release_client_handles(str(tmp_path / "base"), before)
        for thread in threads:                  # ended by release_client_handles (joined)
            thread.join(timeout=5)
        assert sub._sock.closed and get._q.closed
        assert get._url not in Getter._callbacks
    finally:
        pub.close(linger=0)
        rep.close(linger=0)
        ctx.term()
    out, err = capfd.readouterr()
    assert "listener died" not in out + err and "Traceback" not in out + err, out + err


def test_worker_launcher_is_found_in_this_runtimes_sandbox_only(tmp_path):
    # RP names a RAPTOR worker's hostfile after the worker's uid, the same in every
    # session ("raptor.0000.0000"): looking for a worker's mpiexec by that name alone
    # found, and killed, the worker of another runtime on this machine.
    fake = tmp_path / "mpiexec"                   # a script: its process is named mpiexec
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    fake.chmod(0o700)
    launchers = {}
    for run in ("theirs", "mine"):
        hostfile = tmp_path / run / "sandbox" / "pilot.0000" / "raptor.0000.0000.hf"
        hostfile.parent.mkdir(parents=True)
        hostfile.touch()
        launchers[run] = subprocess.Popen([str(fake), "-np", "2", "-f", str(hostfile)])
    try:
        for run, launcher in launchers.items():
            # exec'd: its name, and then its arguments. The kernel names the process
            # before it lays out the new arguments, and a cmdline read in between is
            # empty (a run of the suite caught that window).
            proc = psutil.Process(launcher.pid)
            while proc.name() != "mpiexec" or f"{os.sep}{run}{os.sep}" not in " ".join(
                    proc.cmdline()):
                time.sleep(0.01)
        for run, launcher in launchers.items():
            sandbox = str(tmp_path / run / "sandbox") + os.sep
            assert _launcher_named(sandbox, "/raptor.0000.0000.hf") == launcher.pid
        assert _launcher_named(str(tmp_path / "other") + os.sep, "/raptor.0000.0000.hf") is None
    finally:
        for launcher in launchers.values():
            launcher.kill()
            launcher.wait()
