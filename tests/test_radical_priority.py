"""RP's own processes yield the CPU to a running task (executors/radical/priority.py), and a
task's walltime counts from its ranks' start (docs/api.md), on the shared pilot."""
import os
import time

import psutil
import pytest

import hetflow
from hetflow.executors.radical import lowprio as _lowprio
from hetflow.executors.radical import session_processes
from hetflow.executors.radical.priority import daemon_sessions


def _group_nice(pid: int) -> int:
    """The nice of ``pid``'s autogroup. A process in the root autogroup (a session started
    before autogroups, as a container's first process may be) reads an empty file: the root
    group weighs as nice 0 and its nice cannot be set."""
    with open(f"/proc/{pid}/autogroup") as fh:
        fields = fh.read().split()
    return int(fields[-1]) if fields else 0


@hetflow.mpi_app(ranks=2, returns="all")
def priorities_while_running(comm, marker):
    """Wait until the client has looked (``marker`` exists), then report this rank's
    group's nice, the running thread's nice, and the other threads' nices."""
    import threading

    deadline = time.time() + 120
    while not os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.05)
    me = threading.get_native_id()
    others = {os.getpriority(os.PRIO_PROCESS, tid) for tid in _lowprio.thread_ids(os.getpid())
              if tid != me}
    return _group_nice(os.getpid()), os.getpriority(os.PRIO_PROCESS, me), sorted(others)


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroups here")
@pytest.mark.on_shared_runtime("radical")
def test_rp_daemons_yield_the_cpu_to_a_running_task_and_get_it_back(shared_executor, tmp_path):
    ex = shared_executor
    base = os.path.abspath(ex.base)
    client_sid = os.getsid(0)
    sessions = daemon_sessions(session_processes(base), client_sid)
    # the client's bridges and components, the agent, the master: sessions of their own
    assert len(sessions) >= 10, sessions
    marker = str(tmp_path / "looked")
    future = priorities_while_running(marker)
    deadline = time.time() + 120
    while not ex._yielder.lowered:
        assert time.time() < deadline and not future.done(), "RP's sessions were never lowered"
        time.sleep(0.05)
    lowered = {sid: _group_nice(pid) for sid, pid in
               daemon_sessions(session_processes(base), client_sid).items()}
    assert set(lowered.values()) == {19}, lowered
    assert _group_nice(os.getpid()) == 0          # the client's own session is never touched
    open(marker, "w").close()
    ranks = future.result(timeout=120)
    # each rank: its session at 0, the thread running the task at 0, RP's threads at 19
    assert [(group, mine) for group, mine, _ in ranks] == [(0, 0), (0, 0)], ranks
    assert all(19 in others for _, _, others in ranks), ranks
    deadline = time.time() + 60
    while ex._yielder.lowered:                    # no task runs: RP gets its CPU back
        assert time.time() < deadline, "RP's sessions were not raised back"
        time.sleep(0.05)
    assert {_group_nice(pid) for pid in sessions.values() if psutil.pid_exists(pid)} == {0}


@hetflow.mpi_app(ranks=2, walltime=600)
def my_start(comm):
    return psutil.Process().create_time()


@pytest.mark.on_shared_runtime("radical")
def test_walltime_counts_from_the_ranks_start(shared_executor):
    # A walltime task runs as an RP executable task (fresh ranks): the kernel's launch stamp,
    # from which its walltime counts, is its first rank's start, not its submission to RP.
    future = my_start()
    created = future.result(timeout=300)
    times = hetflow.task_times(future)
    assert times.launched >= created - 0.02, (times, created)    # /proc's clock: 10 ms ticks
    assert times.launched <= times.started


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except OSError:
        return False


@hetflow.mpi_app(ranks=2, returns="all")
def wait_for(comm, marker):
    deadline = time.time() + 120
    while not os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.05)
    return comm.allreduce(1)


@hetflow.mpi_app(ranks=1)
def quick(comm):
    return "ran"


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroups here")
@pytest.mark.on_shared_runtime("radical")
def test_rp_daemons_stop_while_every_task_computes_and_continue_for_a_new_one(
        shared_executor, tmp_path):
    ex = shared_executor
    base = os.path.abspath(ex.base)
    marker = str(tmp_path / "go")
    yielder = ex._yielder
    # No periodic continue (only a submit can wake RP), and no freeze of the idle pilot
    # (test below): what is stopped here is stopped while a task computes.
    yielder.frozen_max_s = yielder.idle_after_s = 600
    yielder.thaw()
    freezes, idle_freezes = yielder.freezes, yielder.idle_freezes
    held = wait_for(marker)
    deadline = time.time() + 120
    while not yielder.frozen or yielder.freezes == freezes:
        assert time.time() < deadline and not held.done(), "RP's daemons were never stopped"
        time.sleep(0.05)
    assert yielder.idle_freezes == idle_freezes      # stopped while the task computes
    stopped = [p.pid for p in session_processes(base) if _stopped(p.pid)]
    assert len(stopped) >= 10, stopped            # bridges, components, agent, master
    # A task submitted now is RP's to dispatch: its daemons continue first, and it runs
    # (stopped, RP could not dispatch it before the 600 s above).
    try:
        assert quick().result(timeout=120) == "ran"
        open(marker, "w").close()
        assert held.result(timeout=120) == [2, 2]
        deadline = time.time() + 60
        while yielder.frozen:
            assert time.time() < deadline, "RP's daemons were not continued"
            time.sleep(0.05)
        assert not [p.pid for p in session_processes(base) if _stopped(p.pid)]
    finally:
        yielder.frozen_max_s, yielder.idle_after_s = 30.0, 1.0
        open(marker, "w").close()


def _ticks(pids) -> int:
    """User + system CPU ticks (/proc/PID/stat) of the live ``pids``, together."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def _await_idle_freezes(yielder, count: int, what: str) -> None:
    deadline = time.time() + 60
    while yielder.idle_freezes < count or not yielder.frozen:
        assert time.time() < deadline, what
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroups here")
@pytest.mark.on_shared_runtime("radical")
def test_an_idle_pilots_daemons_stop_and_continue_for_heartbeats_and_a_new_task(
        shared_executor):
    # RP idle (no task, no worker starting): its ~16 daemons polled on at ~0.6 cores of this
    # 2-core node (measured, docs/runtimes/radical.md). They are stopped ~1 s after RP's last
    # task ended, continued every frozen_max_s for RP's heartbeats, and at once for a task.
    ex = shared_executor
    yielder = ex._yielder
    base = os.path.abspath(ex.base)
    assert quick().result(timeout=120) == "ran"
    before = yielder.idle_freezes
    _await_idle_freezes(yielder, before + 1, "the idle pilot's daemons were never stopped")
    yielder.frozen_max_s = 600                     # no heartbeat continue in the window
    try:
        stopped = [p.pid for p in session_processes(base) if _stopped(p.pid)]
        assert len(stopped) >= 10, stopped         # bridges, components, agent, master
        # Over 5 s of idleness the stopped daemons take no CPU at all (a count, whatever the
        # load): before, they took ~0.6 cores, ~300 ticks.
        ticks = _ticks(stopped)
        time.sleep(5)
        assert yielder.frozen and _ticks(stopped) == ticks
        assert all(_stopped(pid) for pid in stopped if psutil.pid_exists(pid))
        # RP's heartbeats: continued for thaw_for_s every frozen_max_s, then stopped again.
        yielder.frozen_max_s = 1.0
        _await_idle_freezes(yielder, yielder.idle_freezes + 2, "no stop after a heartbeat")
    finally:
        yielder.frozen_max_s = 30.0
    # A task handed to the idle pilot continues RP first, and runs; then RP is idle again.
    freezes = yielder.idle_freezes
    assert quick().result(timeout=120) == "ran"
    _await_idle_freezes(yielder, freezes + 1, "the pilot was not stopped once idle again")
