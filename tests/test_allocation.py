"""Every runtime inside a Slurm allocation (``salloc``), on 2 nodes and on 1 (mpirun,
parsl, pool, radical).

Each test re-invokes pytest inside ``salloc -N2 -n4`` (or ``-N1 -n2``) on a subset
of the parity and fault suites for one runtime, as a user who starts hetflow inside
an allocation would: the runtime must size itself from the allocation and start its
ranks inside it (Hydra given ``localhost`` there hangs; ``srun`` without
``--mpi=pmi2`` gives 1-rank worlds). The pool runs with the ``srun`` launcher the
pool page (docs/runtimes/pool.md) documents. Nothing may hang: every run has a timeout.

The subsets are chosen for CI time: on 2 nodes, a result, every world size (1-3
ranks, so tasks span nodes), heterogeneous tasks at once, a raised exception, a
walltime, a cancel and a rank killed from outside (then the next task); on 1 node,
a result, the world sizes and the killed rank (radical: without the killed rank, see
MODULES).
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import HERE, ROOT, on_second_partition

pytestmark = pytest.mark.slurm

ALLOCATIONS = {"2 nodes": ["-N2", "-n4"], "1 node": ["-N1", "-n2"]}
SUBSETS = {
    "2 nodes": ("test_root_result or test_returns_all or test_heterogeneous or "
                "test_exception_on_rank_one or test_walltime_exceeded or "
                "test_cancel_running_task or test_rank_killed_from_outside"),
    # 2 CPUs: the 3-rank size does not fit (max_ranks comes from the allocation)
    "1 node": ("(test_root_result or test_returns_all or test_rank_killed_from_outside) "
               "and not {name}-3"),
}
#: The options each runtime runs with inside the allocation (max_ranks from it).
OPTIONS = {
    "mpirun": {},
    "parsl": {},
    "pool": {"launcher": ["srun", "--ntasks={ranks}", "--kill-on-bad-exit=0"]},
    # radical: its local pilot takes the allocation's nodes (RP's SLURM resource manager),
    # so Hydra names them rather than localhost (which hangs there).
    "radical": {"startup_timeout": 240},
}
RUN_TIMEOUT_S = {"radical": 900}   # pilot start is slow (a busy 2-core machine: ~1 min)
#: The suite modules a run takes (each starts its runtime once). radical's pilot start is
#: the dearest part of these runs, so on 1 node it runs the parity subset only: the
#: killed rank (test_faults) and the worker's recycling are proven on 2 nodes.
MODULES = {("radical", "1 node"): ["test_parity.py"]}


#: Runtimes whose runs take the second partition (conftest.SECOND_PARTITION), in a chain of
#: Slurm tests beside the others: radical's pilots are the longest runs.
ON_SECOND_PARTITION = {"radical"}


def _allocation_param(name, shape):
    """One run's parameters. Its pytest timeout lies above the run's own (``timeout`` inside
    the allocation, then ``subprocess.run``'s), so a run that is too slow is ended by those,
    which release the allocation and end the runtime's processes. With pytest-timeout's
    default (300 s) firing first, both stayed: the partition taken, and the runtime running,
    for up to the run's own timeout (seen beside a CPU load: a radical run past 300 s)."""
    base = (on_second_partition(name, shape) if name in ON_SECOND_PARTITION
            else pytest.param(name, shape))
    return pytest.param(*base.values, marks=[
        *base.marks, pytest.mark.timeout(RUN_TIMEOUT_S.get(name, 480) + 90)])


@pytest.mark.parametrize("name, shape", [_allocation_param(name, shape)
                                         for name in OPTIONS for shape in ALLOCATIONS])
def test_parity_and_faults_inside_an_allocation(name, shape, request):
    timeout = RUN_TIMEOUT_S.get(name, 480)
    options = {name: {"max_ranks": None, **OPTIONS[name]}}
    marker = request.node.get_closest_marker("slurm_partition")
    partition = [f"--partition={marker.args[0]}"] if marker is not None else []
    cmd = ["salloc", *ALLOCATIONS[shape], *partition, f"--time={timeout // 60 + 2}",
           "timeout", "-k", "10", str(timeout),
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}",
           "-c", os.path.join(ROOT, "pyproject.toml"),
           *MODULES.get((name, shape), ["test_parity.py", "test_faults.py"]),
           "-k", f"{name} and ({SUBSETS[shape].format(name=name)})", "-m", "not slurm"]
    env = {**os.environ, "HETFLOW_TEST_OPTIONS": json.dumps(options)}
    run = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=env,
                         timeout=timeout + 60)
    out = run.stdout + run.stderr
    assert run.returncode == 0, _failure_text(out)
    summary = [line for line in run.stdout.splitlines() if " passed" in line]
    assert summary and "failed" not in summary[-1] and "skipped" not in summary[-1] \
        and "error" not in summary[-1], _failure_text(out)


def _failure_text(out: str) -> str:
    """What the CI log needs of a failed inner run: the start of its first failure (for a
    test that hit pytest-timeout, the main thread's stack comes first there, before the
    other threads'), then the run's end (its summary)."""
    start = out.find("= FAILURES =")
    if start < 0 or len(out) - start <= 9000:
        return out[-9000:]
    return out[start:start + 6000] + "\n[...]\n" + out[-3000:]


#: Run inside ``salloc -N2 -n4`` (every CPU of the allocation held by the pool's world):
#: rank 1 of a 2-rank task is SIGKILLed on its node; prints how long the pool took to
#: fail the task, and then to run two 2-rank tasks at once (the lost ranks replaced by a
#: world started in the full allocation).
LOST_RANK = '''
import json, os, signal, sys, time
import hetflow

@hetflow.mpi_app(ranks=2)
def hold(comm, marks):
    import socket
    mark = os.path.join(marks, f"rank-{comm.Get_rank()}")
    with open(mark + ".tmp", "w") as fh:
        fh.write(json.dumps([os.getpid(), socket.gethostname()]))
    os.replace(mark + ".tmp", mark)        # whole, or not there: the driver reads it at once
    time.sleep(120)
    comm.Barrier()

@hetflow.mpi_app(ranks=2, returns="all")
def where(comm):
    import socket
    return socket.gethostname()

marks = sys.argv[1]
launcher = ["srun", "--ntasks={ranks}", "--kill-on-bad-exit=0"]
with hetflow.runtime("pool", launcher=launcher, start_timeout=60) as dfk:
    fut = hold(marks)
    while len([n for n in os.listdir(marks) if n.startswith("rank-") and "." not in n]) < 2:
        time.sleep(0.02)
    pid, host = json.load(open(os.path.join(marks, "rank-1")))
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    try:
        fut.result(timeout=60)
        error = None
    except hetflow.TaskLost as exc:
        error = exc
    lost_s = time.time() - killed
    start = time.time()
    pair = [where(), where()]
    hosts = [f.result(timeout=60) for f in pair]
    print(json.dumps({"host": host, "lost_s": lost_s, "rank": getattr(error, "rank", None),
                      "signal": getattr(error, "signal", None), "error": str(error),
                      "recovered_s": time.time() - start, "hosts": hosts}))
'''

#: Bounds that tell the mechanisms apart, with room for a loaded machine (the suite keeps
#: both cores busy): a rank lost on another node is noticed through its launcher, well
#: under the heartbeat path's 10 s (measured alone: under 2 s), and the full allocation
#: recovers without waiting for CPUs, well under the 30 s the replacement waited without
#: --overlap (measured alone: under 5 s). Times are not what this test is for.
LOST_WITHIN_S, RECOVERED_WITHIN_S = 8.0, 20.0


def test_pool_rank_lost_on_another_node_in_a_full_allocation(tmp_path):
    script = tmp_path / "lost.py"
    script.write_text(LOST_RANK)
    marks = tmp_path / "marks"
    marks.mkdir()
    run = subprocess.run(["salloc", "-N2", "-n4", "--time=5", "timeout", "-k", "10", "240",
                          sys.executable, str(script), str(marks)],
                         cwd=HERE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["host"] in ("n1", "n2"), got          # the rank ran on a Slurm node
    assert got["rank"] == 1 and got["signal"] == 9, got
    assert got["lost_s"] < LOST_WITHIN_S, got
    assert got["recovered_s"] < RECOVERED_WITHIN_S, got
    assert all(len(h) == 2 and set(h) <= {"n1", "n2"} for h in got["hosts"]), got


#: Two 2-rank tasks that are running at the same time (each one's rank 0 waits in
#: ``meet`` until both have arrived), so together they hold all four CPUs and the
#: placement cannot reuse the first task's node for the second; then one 4-rank task.
PLACEMENT = '''
import json, os, sys, time
import hetflow

@hetflow.mpi_app(ranks=2, returns="all")
def where(comm, meet=None):
    import socket
    if meet is not None:
        if comm.Get_rank() == 0:
            open(os.path.join(meet, str(os.getpid())), "w").close()
            deadline = time.time() + 60
            while len(os.listdir(meet)) < 2:
                if time.time() > deadline:
                    raise TimeoutError("the other 2-rank task did not start beside this one")
                time.sleep(0.02)
        comm.Barrier()
    return socket.gethostname()

meet = sys.argv[1]
launcher = ["srun", "--ntasks={ranks}", "--kill-on-bad-exit=0"]
with hetflow.runtime("pool", launcher=launcher, start_timeout=60):
    pair = [where(meet), where(meet)]          # two 2-rank tasks at once: one node each
    print(json.dumps({"pair": [f.result(timeout=90) for f in pair],
                      "four": where.options(ranks=4)().result(timeout=60)}))
'''


def test_pool_places_tasks_by_node(tmp_path):
    script = tmp_path / "placement.py"
    script.write_text(PLACEMENT)
    meet = tmp_path / "meet"
    meet.mkdir()
    run = subprocess.run(["salloc", "-N2", "-n4", "--time=5", "timeout", "-k", "10", "180",
                          sys.executable, str(script), str(meet)],
                         cwd=HERE, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(got["pair"]) == [["n1", "n1"], ["n2", "n2"]], got
    assert got["four"] == ["n1", "n1", "n2", "n2"], got


#: A 4-rank DDP task through the mpirun runtime inside ``salloc -N2 -n4``: two ranks a node.
TRAINING = '''
import json, sys
import hetflow
sys.path.insert(0, sys.argv[1])
from torch_apps import ddp_train

with hetflow.runtime("mpirun"):
    print(json.dumps(ddp_train.options(ranks=4)(rows=48, empty_rank=3).result(timeout=400)))
'''


def test_torch_process_group_across_two_nodes(tmp_path):
    """hetflow.torch's group on a task spanning the allocation's two nodes: local ranks from
    the host names, Gloo on the host name's address (not loopback: several hosts), DDP's
    weights those of one process on the same global batches. (torch in 4 ranks: ~15 s.)"""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch extra)")
    from torch_apps import PARITY_ATOL

    script = tmp_path / "training.py"
    script.write_text(TRAINING)
    run = subprocess.run(["salloc", "-N2", "-n4", "--time=8", "timeout", "-k", "10", "420",
                          sys.executable, str(script), HERE],
                         cwd=HERE, capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["hosts"] == ["n1", "n1", "n2", "n2"], got
    assert got["local"] == [[0, 2], [1, 2], [0, 2], [1, 2]], got
    assert got["rows"] == [12, 12, 12, 12] and got["diff"] <= PARITY_ATOL, got
