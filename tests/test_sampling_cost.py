"""What per-rank resource sampling costs a task, counted (not timed: the machine is shared):
the calls and bytes a rank spends on a quick task's samples, how they travel on the pool, and
the Python calls they add to the client (see hetflow.executors._ranksample, .monitoring)."""
import os
import threading
import time

import pytest
from callcount import run_counted

import hetflow
from hetflow.executors.monitoring import READ_S

pytestmark = pytest.mark.timeout(180)


#: What sampling may add, counted (not timed: the machine is shared). Measured on a 2-rank
#: no-op task, pool, 200 tasks: the client's Python calls per task with sampling on less
#: those with it off, 11.6 while each carried sample was a dict made on the client (and
#: the outcomes read and forwarded to no one), 3.7 since; then 10.3 once a plain success
#: travelled packed but one with samples pickled, 3 since they are packed too and left so
#: until read (TaskSamples made, watch, carry): the 3 gated here, in the sampling code.
MAX_CLIENT_CALLS_ADDED = 3
#: A rank's sampling of a task that ends within its interval: 4 getrusage, 2 /proc/self/statm
#: opened, read and closed, and 416 pickled bytes of samples while they were dicts; now
#: 3 getrusage (the children's CPU once, at the end), 2 preads of a kept fd, 176 bytes.
MAX_GETRUSAGE, MAX_CARRIED_BYTES = 3, 250


def test_a_quick_tasks_sampling_costs_its_rank_few_calls_and_bytes(tmp_path):
    import collections
    import json
    import pickle
    import sys

    from hetflow.executors._ranksample import Sampler, expand, sample_name

    with Sampler(str(tmp_path), 0, 30.0):     # the first: the fd kept open, the thread
        pass
    calls = collections.Counter()

    def hook(frame, event, arg):
        if event == "c_call":
            calls[getattr(arg, "__name__", "")] += 1

    sys.setprofile(hook)
    try:
        with Sampler(str(tmp_path), 0, 30.0) as quick:
            pass
    finally:
        sys.setprofile(None)
    assert calls["getrusage"] <= MAX_GETRUSAGE, calls
    assert calls["open"] == calls["close"] == 0, calls        # nothing opened per task
    assert len(pickle.dumps(quick.compact, protocol=5)) <= MAX_CARRIED_BYTES
    # What readers get is the same as from a file: the same fields, the same kinds of value.
    with Sampler(str(tmp_path), 1, 0.05):
        time.sleep(0.2)
    with open(tmp_path / sample_name(1)) as fh:
        written = [json.loads(line) for line in fh]
    carried = expand(quick.compact, 0)
    assert [sorted(s) for s in carried] == [sorted(written[0])] * 2
    assert [s["final"] for s in carried] == [False, True] and written[-1]["final"]
    for key in ("cpu_user_s", "cpu_system_s", "rss", "vms", "memory_percent", "pid", "host",
                "time", "gpu_note"):
        assert type(carried[1][key]) is type(written[-1][key]), key
    assert carried[1]["cpu_user_s"] + carried[1]["cpu_system_s"] >= \
        carried[0]["cpu_user_s"] + carried[0]["cpu_system_s"]


def test_a_quick_tasks_samples_travel_packed_on_the_pool(tmp_path):
    # Pickling the outcome only because it carries samples cost the pool's client 3-4
    # times what reading a packed one does: a quick task's two samples are packed with it.
    from hetflow.executors._ranksample import _HOST, Sampler, expand
    from hetflow.executors.payload import RankOutcome, dumps
    from hetflow.executors.pool import wire

    with Sampler(str(tmp_path), 0, 30.0) as quick:
        pass
    outcome = RankOutcome(rank=1, host=_HOST, pid=os.getpid(), ok=True, value=dumps(7),
                          started=1.0, finished=2.0)
    outcome.samples = quick.compact
    frames = wire.outcome_frames(5, outcome)
    assert frames[2][:1] == b"T" and b"no GPU" not in frames[2]       # not pickled
    task_id, read, _ = wire.read_outcome(frames[1], frames[2], frames[3])
    assert (task_id, read.rank, read.host, read.pid) == (5, 1, _HOST, os.getpid())
    assert expand(read.samples, 1) == expand(quick.compact, 1) and read.value == dumps(7)
    # A sample with more in it (a GPU's note, I/O counters) travels pickled, whole.
    pid, host, memory, (first, last) = quick.compact
    outcome.samples = (pid, host, memory, (first, last[:11] + ("GPU 0 bound, ...", True)))
    outcome.value = dumps(7)
    frames = wire.outcome_frames(5, outcome)
    assert frames[2][:1] != b"T"
    assert wire.read_outcome(frames[1], frames[2], frames[3])[1].samples == outcome.samples


@hetflow.mpi_app(ranks=2)
def noop2(comm):
    return None


def _sampling_calls_per_task(tasks: int, **options) -> tuple:
    """The client's Python calls per task into the sampling code (executors/monitoring.py
    and _ranksample.py), every thread counted but the samples thread; that thread's reads
    of a task's samples; and the counted run's wall seconds."""
    counted_calls, reads = [0], [0]
    counting = [False]

    def hook(frame, event, arg):
        if counting[0] and event == "call" and frame.f_code.co_filename.endswith(_SAMPLING):
            if threading.current_thread().name.endswith("-samples"):
                reads[0] += frame.f_code.co_name == "read"
            else:
                counted_calls[0] += 1

    def warm():
        for _ in range(10):
            noop2().result(timeout=120)

    def run():
        t0 = time.monotonic()
        for _ in range(tasks):
            noop2().result(timeout=120)
        return time.monotonic() - t0

    wall_s = run_counted(hook, counting, warm, run, **options)
    return counted_calls[0] / tasks, reads[0], wall_s


#: Where the client's share of sampling runs.
_SAMPLING = (os.path.join("executors", "monitoring.py"),
             os.path.join("executors", "_ranksample.py"))


def test_sampling_adds_few_client_calls_per_task():
    # Counted in the sampling code only: what the whole client runs per task varies by a few
    # calls with timing (how many outcomes one broker wake-up reads, ZeroMQ's EAGAIN), which
    # once made an on/off pair of whole counts differ by more than 5 in a loaded xdist worker.
    # Per task now: watch, TaskSamples and carry; before (66039f1) also TaskSamples.read,
    # _forward and the dicts made of every carried sample, 11.6 whole-client calls in all.
    # The samples thread's reads come with time, not tasks (a pass every READ_S over the
    # tasks running then): counted apart, and gated by its passes. Counted with the rest,
    # they made a loaded run (a few seconds long) add 3.01-3.05 calls a task.
    off, _, _ = _sampling_calls_per_task(100)
    on, reads, wall_s = _sampling_calls_per_task(100, sample_s=1.0)
    assert on - off <= MAX_CLIENT_CALLS_ADDED, (on, off)
    # tasks run one at a time: at most one task's samples read per pass
    assert reads <= wall_s / READ_S + 2, (reads, wall_s)
