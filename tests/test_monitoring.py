"""Runtime-level behaviour: Parsl monitoring of MPI apps, run-dir clean-up."""
import os
import sqlite3
import time

import pytest

import hetflow

pytestmark = pytest.mark.timeout(180)


@hetflow.mpi_app(ranks=2)
def counted(comm, x):
    return comm.allreduce(x)


@hetflow.mpi_app(ranks=1)
def noop(comm):
    return None


def test_parsl_monitoring_records_mpi_apps(tmp_path):
    from parsl.monitoring import MonitoringHub

    db = tmp_path / "monitoring.db"
    hub = MonitoringHub(logging_endpoint=f"sqlite:///{db}", resource_monitoring_enabled=False)
    with hetflow.runtime("mpirun", max_ranks=4, monitoring=hub):
        assert counted.options(ranks=1)(5).result() == 5
        assert noop().result() is None
    with sqlite3.connect(db) as con:
        names = sorted(r[0] for r in con.execute("SELECT task_func_name FROM task"))
        states = {r[0] for r in con.execute("SELECT task_status_name FROM status")}
        workflows = [r[0] for r in con.execute("SELECT workflow_name FROM workflow")]
    assert names == ["counted", "noop"]
    assert workflows == [os.path.basename(__file__)]     # the user's script, not hetflow's
    assert "exec_done" in states


def test_runtime_removes_its_temp_run_dir():
    with hetflow.runtime("mpirun", max_ranks=2) as dfk:
        run_dir = dfk.executors["mpirun"].run_dir
        assert noop().result() is None
        assert os.path.isdir(run_dir)
    assert not os.path.exists(run_dir)
    assert not os.path.exists(os.path.dirname(run_dir))


def _lines(path):
    return len(open(path).readlines()) if os.path.exists(path) else 0


def test_checkpoint_accepts_arguments_parsl_cannot_hash(tmp_path):
    # A checkpointed runtime memoizes every MPI app: a NumPy argument must be keyed, not fail.
    np = pytest.importorskip("numpy")
    log = str(tmp_path / "log")
    for _ in range(2):
        with hetflow.runtime("mpirun", max_ranks=2, checkpoint=str(tmp_path / "ckpt")):
            assert array_sum(log, np.arange(4)).result(timeout=120) == 6
            assert array_sum(log, np.arange(5)).result(timeout=120) == 10
    assert _lines(log) == 2                   # the second runtime ran nothing


@hetflow.mpi_app(ranks=1)
def array_sum(comm, log, values):
    with open(log, "a") as fh:
        fh.write("ran\n")
    return int(values.sum())


# ---------------------------------------------------------------------- per-rank resource samples
@hetflow.mpi_app(ranks=2)
def hold(comm, seconds, extra_mb):
    """Rank 1 holds ``extra_mb`` more memory than rank 0; both spin for ``seconds``."""
    import time

    block = bytearray(comm.Get_rank() * extra_mb * 2**20)
    block[::4096] = b"x" * len(block[::4096])           # touched: resident
    end = time.time() + seconds
    while time.time() < end:
        pass
    return comm.allreduce(len(block))


def _hub(db, interval):
    from parsl.monitoring import MonitoringHub

    return MonitoringHub(logging_endpoint=f"sqlite:///{db}", resource_monitoring_enabled=True,
                         resource_monitoring_interval=interval)


def _series(db):
    """``{(task_id, try_id): {pid: (rows, max rss)}}`` from Parsl's resource table."""
    series = {}
    with sqlite3.connect(db) as con:
        for task, try_, pid, rows, rss in con.execute(
                "SELECT task_id, try_id, psutil_process_pid, count(*), "
                "max(psutil_process_memory_resident) FROM resource GROUP BY 1, 2, 3"):
            series.setdefault((task, try_), {})[pid] = (rows, rss)
    return series


@pytest.mark.parametrize("name", ["pool", "mpirun", "parsl", "radical", "slurm"])
def test_parsl_resource_monitoring_records_every_rank(tmp_path, name):
    # The way a Parsl user turns it on: before, every task failed with RadioRequiredError.
    db = tmp_path / "monitoring.db"
    with hetflow.runtime(name, max_ranks=2, monitoring=_hub(db, 0.2)) as dfk:
        done = hold(1.0, 64)
        assert done.result(timeout=120) == 64 * 2**20
        assert counted.options(ranks=1)(3).result(timeout=120) == 3
        samples = hetflow.task_samples(done)
        files = dfk.executors[name].node_root
        left = [n for _, _, names in os.walk(files) for n in names if n.startswith("samples-")]
    assert left == []              # the sample files went with the task
    assert sorted(samples) == [0, 1]
    pids = {rank: {s["pid"] for s in rows} for rank, rows in samples.items()}
    assert all(len(p) == 1 for p in pids.values()) and pids[0] != pids[1]
    for rows in samples.values():
        assert len(rows) >= 3 and rows[-1]["final"] and not rows[0]["final"]
        assert [s["time"] for s in rows] == sorted(s["time"] for s in rows)
        assert rows[-1]["cpu_user_s"] + rows[-1]["cpu_system_s"] > \
            rows[0]["cpu_user_s"] + rows[0]["cpu_system_s"]
        assert rows[0]["gpus"] is None and rows[0]["gpu_note"] == "no GPU bound to this rank"
    series = _series(db)
    assert sorted(series) == [(0, 0), (1, 0)]
    # One series per rank process, every sample a row: rank 1 holds 64 MiB more.
    assert {pid: rows for pid, (rows, _) in series[(0, 0)].items()} == {
        next(iter(pids[r])): len(samples[r]) for r in samples}
    rss = {pid: top for pid, (_, top) in series[(0, 0)].items()}
    assert rss[next(iter(pids[1]))] - rss[next(iter(pids[0]))] > 48 * 2**20
    with sqlite3.connect(db) as con:
        tries = con.execute("SELECT task_try_time_running, task_try_time_returned, hostname "
                            "FROM try WHERE task_id = 0").fetchall()
        states = [r[0] for r in con.execute("SELECT task_status_name FROM status WHERE "
                                            "task_id = 0 ORDER BY timestamp")]
    # the host rank 0 ran on: this one, or the Slurm node of slurm's batch job
    host = samples[0][0]["host"]
    assert host == os.uname().nodename or name == "slurm"
    assert tries[0][0] is not None and tries[0][2] == host
    assert "running" in states and "running_ended" in states


# Sampling without Parsl's monitoring differs from the test above only on the client, in
# the kernel, which every runtime shares: two runtimes stand for all (the radical one cost
# the suite ~50 s, a pilot's start).
@pytest.mark.parametrize("name", ["pool", "mpirun"])
def test_task_samples_without_parsl_monitoring(name):
    with hetflow.runtime(name, max_ranks=2, sample_s=0.1) as dfk:
        done = hold(0.5, 0)
        assert done.result(timeout=120) == 0
        samples = hetflow.task_samples(done)
        files = dfk.executors[name].node_root
        left = [n for _, _, names in os.walk(files) for n in names if n.startswith("samples-")]
    assert sorted(samples) == [0, 1] and all(len(rows) >= 3 for rows in samples.values())
    for rows in samples.values():  # the ranks spin: their CPU seconds grow, sample by sample
        cpu = [s["cpu_user_s"] + s["cpu_system_s"] for s in rows]
        assert cpu == sorted(cpu) and cpu[-1] > cpu[0]
        assert all(s["cpu_percent"] >= 0 for s in rows) and rows[0]["cpu_percent"] == 0
    assert left == []              # the sample files went with the task


def test_debug_runtime_samples_its_one_rank_the_client_process(tmp_path):
    # The debug runtime's rank is the client's own process: its samples are that process's.
    db = tmp_path / "monitoring.db"
    with hetflow.runtime("debug", monitoring=_hub(db, 0.2)):
        done = hold.options(ranks=1)(1.0, 0)
        assert done.result(timeout=120) == 0
        samples = hetflow.task_samples(done)
    assert sorted(samples) == [0] and len(samples[0]) >= 3
    assert {s["pid"] for s in samples[0]} == {os.getpid()}
    assert samples[0][-1]["final"] and not samples[0][0]["final"]
    cpu = [s["cpu_user_s"] + s["cpu_system_s"] for s in samples[0]]
    assert cpu == sorted(cpu) and cpu[-1] > cpu[0]
    assert _series(db) == {(0, 0): {os.getpid(): (len(samples[0]), max(
        s["rss"] for s in samples[0]))}}


def test_a_rank_that_ends_within_its_interval_writes_no_sample_file(tmp_path):
    from hetflow.executors._ranksample import Sampler, sample_name

    with Sampler(str(tmp_path), 0, 30.0) as quick:
        pass
    assert os.listdir(tmp_path) == []                       # nothing written
    assert [s["final"] for s in quick.carried] == [False, True]
    with Sampler(str(tmp_path), 1, 0.05) as slow:
        time.sleep(0.3)
    assert slow.carried is None                             # its samples are in its file
    with open(tmp_path / sample_name(1)) as fh:
        assert len(fh.readlines()) >= 3


@pytest.mark.parametrize("name", ["pool", "mpirun"])
def test_samples_carried_with_the_outcome_reach_the_record_and_parsl(tmp_path, name):
    db = tmp_path / "monitoring.db"
    with hetflow.runtime(name, max_ranks=2, monitoring=_hub(db, 30)):
        done = counted(1)
        assert done.result(timeout=120) == 2
        samples = hetflow.task_samples(done)
    assert sorted(samples) == [0, 1]
    assert [[s["final"] for s in samples[r]] for r in (0, 1)] == [[False, True]] * 2
    series = _series(db)
    assert {pid: rows for pid, (rows, _) in series[(0, 0)].items()} == {
        samples[r][0]["pid"]: 2 for r in (0, 1)}


def test_sampling_off_by_default_and_sample_s_checked():
    with hetflow.runtime("mpirun", max_ranks=1) as dfk:
        done = noop()
        done.result(timeout=120)
        assert hetflow.task_samples(done) == {}
        assert dfk.executors["mpirun"].sample_s is None
    with pytest.raises(hetflow.ConfigError, match="sample_s"):
        with hetflow.runtime("mpirun", max_ranks=1, sample_s=0):
            pass


def test_gpu_samples_fall_back_and_say_why(monkeypatch):
    from hetflow.executors import _ranksample

    assert _ranksample.read_gpus(None) == (None, "no GPU bound to this rank")
    assert _ranksample.read_gpus("") == (None, "no GPU bound to this rank")
    monkeypatch.setenv("PATH", "/nonexistent")     # no nvidia-smi; pynvml is not installed
    gpus, note = _ranksample.read_gpus("0,1")
    assert gpus is None and "GPU(s) 0,1 bound" in note and "nvidia-smi" in note


# ---------------------------------------------------------------------- parsl-visualize
PLOT_DATA = """JSON.stringify(Array.from(document.querySelectorAll('.plotly-graph-div')).map(
    d => ({title: d.layout.title.text, traces: d.data.map(t => Array.from(t.y || []))})))"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(400)
def test_parsl_visualize_shows_every_rank_in_a_browser(tmp_path):
    """parsl-visualize over a run's database, its task and resource pages loaded in headless
    Chromium (plotly served from Parsl's own plotly package: no network here)."""
    import json
    import shutil
    import subprocess
    import sys
    import time
    import urllib.request

    import plotly

    from browser import Browser

    db = tmp_path / "monitoring.db"
    with hetflow.runtime("mpirun", max_ranks=2, monitoring=_hub(db, 0.25)):
        assert hold(2.0, 96).result(timeout=120) == 96 * 2**20
    with sqlite3.connect(db) as con:
        run_id = con.execute("SELECT run_id FROM workflow").fetchone()[0]
    by_pid = _series(db)[(0, 0)]
    assert len(by_pid) == 2
    port = _free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "parsl-visualize"),
                               "-p", str(port), f"sqlite:///{db}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/workflow/{run_id}"
    js = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    try:
        deadline = time.monotonic() + 180        # it imports pandas and plotly: slow when loaded
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no parsl-visualize"
                time.sleep(0.5)
        with Browser(str(tmp_path / "profile"),
                     serve={"cdn.plot.ly": (js, "application/javascript")}) as browser:
            browser.load(f"{base}/task/0")
            plots = json.loads(browser.evaluate(PLOT_DATA))
            shot = tmp_path / "task.png"
            browser.screenshot(str(shot))
            browser.load(f"{base}/resource_usage")
            resource_titles = [p["title"] for p in json.loads(browser.evaluate(PLOT_DATA))]
    finally:
        server.terminate()
        server.wait(timeout=30)
    # The task page plots every rank's samples: each series' rows, each rank's peak.
    (memory,) = [p for p in plots if p["title"] == "Memory Usage"]
    points = memory["traces"][0]
    assert len(points) == sum(rows for rows, _ in by_pid.values())
    for _, rss in by_pid.values():
        assert any(y is not None and abs(y * 1e9 - rss) < 1e3 for y in points)
    assert max(rss for _, rss in by_pid.values()) - min(rss for _, rss in by_pid.values()) \
        > 64 * 2**20
    assert {"CPU usage", "Memory usage", "CPU Time Distribution(max)"} <= set(resource_titles)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("HETFLOW_SCREENSHOTS")     # the docs' copy: see docs/api.md
    if keep:
        shutil.copy(shot, os.path.join(keep, "parsl-visualize-task.png"))


# ---------------------------------------------------------------------- the runtime's own CPU
@pytest.mark.parametrize("name", ["pool", "mpirun"])
def test_runtime_cpu_separates_the_runtime_from_its_tasks(name):
    from hetflow.executors.runtime_cpu import RuntimeCPU, task_cpu

    with hetflow.runtime(name, max_ranks=2, sample_s=3600) as dfk:
        assert hold(0.1, 0).result(timeout=120) == 0         # the pool's ranks are up
        meter = RuntimeCPU(dfk.hetflow_token)
        meter.start()
        idle = meter.stop()
        meter.start()
        done = hold(1.0, 0)
        done.result(timeout=120)
        samples = hetflow.task_samples(done)
        busy = meter.stop([samples])
    # Two samples a rank (entering, returning): the task's CPU is theirs, and it is in the window.
    assert all(len(rows) == 2 for rows in samples.values())
    assert busy["task_cpu_s"] == task_cpu(samples) > 0
    assert busy["cpu_s"] >= busy["task_cpu_s"] - 0.02       # /proc counts in 10 ms ticks
    assert busy["runtime_cpu_s"] == max(0.0, busy["cpu_s"] - busy["task_cpu_s"])
    assert idle["task_cpu_s"] == 0 and idle["runtime_cpu_s"] >= 0
    if name == "pool":      # the client, the guardian, the pool's ranks and their launcher
        assert idle["processes"] >= 4
    else:                   # the launch: two Python ranks started and ended in the window
        assert idle["processes"] >= 1 and busy["runtime_cpu_s"] > 0.05
