"""MPI apps through the bare-metal mpirun executor, under real mpiexec with 1-3 ranks."""
import os
import time

import pytest

import hetflow
from hetflow.executors.scheduler import SlotScheduler


@hetflow.mpi_app(ranks=2, returns="all")
def sizes(comm, x):
    return (comm.Get_rank(), comm.Get_size(), x)


@hetflow.mpi_app(ranks=2)
def raise_on_rank_one(comm):
    if comm.Get_rank() == 1:
        raise KeyError("rank one")
    comm.Barrier()


@hetflow.mpi_app(ranks=3)
def exit_on_rank_one(comm):
    if comm.Get_rank() == 1:
        os._exit(3)
    comm.Barrier()


@hetflow.mpi_app(ranks=1, walltime=1)
def sleeper(comm):
    time.sleep(60)


@hetflow.mpi_app(ranks=1)
def allreduce_sum(comm, x):
    return comm.allreduce(x)


@pytest.fixture(scope="module")
def dfk():
    with hetflow.runtime("mpirun", max_ranks=4) as loaded:
        yield loaded


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_communicator_has_requested_size(dfk, ranks):
    got = sizes.options(ranks=ranks)(ranks).result()
    assert got == [(r, ranks, ranks) for r in range(ranks)]


@pytest.mark.timeout(60)
def test_heterogeneous_tasks_in_flight_see_their_own_size(dfk):
    one = sizes.options(ranks=1)("a")
    two = sizes(x="b", hetflow_resources={"ranks": 2})
    assert one.result() == [(0, 1, "a")]
    assert two.result() == [(0, 2, "b"), (1, 2, "b")]


@pytest.mark.timeout(60)
def test_future_as_dependency(dfk):
    first = allreduce_sum.options(ranks=2)(3)
    second = allreduce_sum.options(ranks=3)(first)
    assert first.result() == 6
    assert second.result() == 18


@pytest.mark.timeout(60)
def test_exception_on_rank_one_names_rank_and_traceback(dfk):
    with pytest.raises(hetflow.TaskFailed) as info:
        raise_on_rank_one().result()
    assert info.value.rank == 1
    assert isinstance(info.value.exception, KeyError)
    assert "raise KeyError" in info.value.remote_traceback or "KeyError" in info.value.remote_traceback


@pytest.mark.timeout(60)
def test_exit_on_one_rank_is_task_lost_naming_it(dfk):
    with pytest.raises(hetflow.TaskLost) as info:
        exit_on_rank_one().result()
    assert info.value.rank == 1
    assert "os._exit(3)" in str(info.value)


@pytest.mark.timeout(60)
def test_walltime_exceeded(dfk):
    start = time.time()
    with pytest.raises(hetflow.WalltimeExceeded):
        sleeper().result()
    assert time.time() - start < 30


@pytest.mark.timeout(60)
def test_more_ranks_than_max_is_rejected(dfk):
    with pytest.raises(hetflow.ResourcesUnavailable, match="max_ranks=4"):
        sizes.options(ranks=5)(1).result()
    # the executor still works afterwards
    assert sizes.options(ranks=1)(0).result() == [(0, 1, 0)]


@pytest.mark.timeout(60)
def test_task_times_recorded(dfk):
    fut = sizes(1)
    fut.result()
    times = hetflow.task_times(fut)
    assert times.submitted <= times.launched <= times.started <= times.finished <= times.delivered


def test_bad_resources_fail_at_call_time():
    with pytest.raises(hetflow.ConfigError):
        hetflow.mpi_app(ranks=0)
    with pytest.raises(hetflow.ConfigError, match="unknown resource"):
        sizes.options(nodes=2)


def test_scheduler_backfill_is_bounded():
    sched = SlotScheduler(2, max_bypass=1)
    sched.push("big", 2)
    sched.push("small1", 1)
    sched.push("small2", 1)
    sched.free = [0]  # one slot busy
    assert [item for item, *_ in sched.pop_ready()] == ["small1"]
    assert sched.pop_ready() == []  # the big task may not be bypassed again


#: Under mpiexec -n 2: rank 1 reaches the rank runner ``LATE_S`` late (a slow import of the
#: task's modules); rank 0 reports the CPU seconds it used in the runner meanwhile.
LATE_PEER = '''
import os, sys, time
from mpi4py import MPI
import mpiutil
from hetflow.executors._rank import run_on_rank
from hetflow.executors.payload import TaskPayload
from hetflow.spec import Resources

LATE_S = float(sys.argv[1])
comm = MPI.COMM_WORLD
payload = TaskPayload(task_id=1, func=os.getpid, args=(), kwargs={},
                      resources=Resources(ranks=2)).dumps()
comm.Barrier()
if comm.Get_rank() == 1:
    time.sleep(LATE_S)
cpu, wall = time.process_time(), time.monotonic()
outcome = run_on_rank(payload, comm)
mpiutil.report({"ok": outcome.ok, "cpu_s": time.process_time() - cpu,
                "wall_s": time.monotonic() - wall})
'''


@pytest.mark.timeout(120)
def test_rank_waits_for_a_late_peer_asleep():
    # MPICH's blocking calls busy-poll: before the runner waited for its peers in a slept-on
    # barrier, rank 0 spun in comm.Dup() for the whole delay (checked: 3.0 CPU-s of the 3 s;
    # with the barrier, ~0.02), taking the CPU the late rank needed on an oversubscribed
    # node. CPU seconds, not wall time: a spinning wait uses the CPU even on a loaded machine.
    from mpiutil import run_mpi

    late_s = 3.0
    run = run_mpi(LATE_PEER, 2, args=[str(late_s)]).check()
    first, second = run.values(2)
    assert first["ok"] and second["ok"], (first, second)
    assert first["wall_s"] >= late_s * 0.9, first        # it did wait for the late rank
    assert first["cpu_s"] < 0.3 * late_s, first


def test_malloc_huge_pages_keep_the_users_choices():
    from hetflow.executors.launch import MALLOC_THP, with_malloc_thp

    assert with_malloc_thp({})["GLIBC_TUNABLES"] == MALLOC_THP
    assert with_malloc_thp({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] \
        == "glibc.malloc.arena_max=2:" + MALLOC_THP
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert with_malloc_thp(dict(chosen)) == chosen
    assert "GLIBC_TUNABLES" not in with_malloc_thp({"HETFLOW_FRAME_ALLOCATOR": "keep"})


#: Writes a byte into each 4 KiB page of a fresh 32 MiB Arrow buffer (the system allocator,
#: as the engine's ranks use it) and prints the page faults that took.
FRESH_ARROW_BUFFER = """
import resource, numpy as np, pyarrow as pa
view = np.frombuffer(pa.allocate_buffer(32 << 20, memory_pool=pa.system_memory_pool()), np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
view[::4096] = 1
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return fh.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.timeout(120)
def test_ranks_fault_in_arrow_buffers_by_huge_pages():
    import subprocess
    import sys

    from hetflow.executors.launch import default_mpiexec, launcher_env

    mode = _thp_mode()
    if mode == "never":
        pytest.skip("this kernel's transparent huge pages are off")

    def faults(env):
        out = subprocess.run([sys.executable, "-c", FRESH_ARROW_BUFFER], env=env, check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return int(out.split()[-1])

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    with_thp = faults(launcher_env(default_mpiexec(), plain))   # what a rank is started with
    assert with_thp < 1024, with_thp                            # 16 huge pages (~17 faults)
    if mode == "madvise":   # only asked-for memory gets huge pages: the 8,192 small ones
        assert faults(plain) >= 4096


#: Per buffer size: the page faults of writing every 4 KiB page of a NumPy buffer of that many
#: bytes, from np.empty and from the engine's _arrays.empty, allocated with the engine's
#: allocator settings (as a rank has them); the KiB resident past its data up to the next
#: 2 MiB boundary (from /proc/self/pagemap, page by page); and where it starts within a
#: 2 MiB page.
ENGINE_BUFFERS = """
import json, resource, struct, numpy as np
from hetflow.frame import _arrays, _backend
_backend._tune_allocators()
PAGE, HUGE = 4096, 2 << 20
def resident_kib(lo, hi):  # 4 KiB pages of [lo, hi) in memory (bit 63 of their pagemap entry)
    lo, hi = lo // PAGE, -(-hi // PAGE)
    if hi <= lo:
        return 0
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(lo * 8)
        entries = struct.unpack(f"{hi - lo}Q", fh.read((hi - lo) * 8))
    return sum(e >> 63 for e in entries) * PAGE // 1024
out = {}
for nbytes in (16_000_000, (7 << 21) + 100_000):
    for how, make in (("numpy", np.empty), ("engine", _arrays.empty)):
        buf = make(nbytes, np.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buf[::4096] = 1
        buf[-1] = 1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        lo = buf.ctypes.data
        end = lo + nbytes
        beyond = resident_kib(-(-end // PAGE) * PAGE, -(-end // HUGE) * HUGE)
        out[f"{how} {nbytes}"] = [faults, beyond, lo % HUGE]
        del buf
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_engine_buffers_are_mapped_in_whole_huge_pages():
    # glibc maps a large buffer at a length the kernel does not align to 2 MiB, so its first
    # and last partial 2 MiB were faulted in 4 KiB at a time (~520 faults whatever its size);
    # _arrays.empty asks for a length that is mapped on a 2 MiB boundary (hetflow.frame).
    import json
    import subprocess
    import sys

    from hetflow.executors.launch import default_mpiexec, launcher_env

    if _thp_mode() == "never":
        pytest.skip("this kernel's transparent huge pages are off")
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", ENGINE_BUFFERS], capture_output=True, text=True,
                         env=launcher_env(default_mpiexec(), plain), timeout=60)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    for nbytes in (16_000_000, (7 << 21) + 100_000):
        faults, beyond_kib, start = got[f"engine {nbytes}"]
        assert start == 16, got            # on a 2 MiB boundary, past glibc's 16-byte header
        assert beyond_kib <= 1024, got     # at most 1 MiB resident past its data
    # 16 MB: 7 whole huge pages, and the last one, more than half full, kept huge (np.empty's
    # buffer took ~330-540 faults here, depending on where its mapping fell)
    assert got["engine 16000000"][0] <= 8 + 4, got
    # 14 MiB and 100 kB: 7 huge pages, and the last 100 kB on 4 KiB pages (25 of them)
    assert 7 + 24 <= got[f"engine {(7 << 21) + 100_000}"][0] <= 7 + 25 + 4, got
