"""The reproduction harness end to end: ``hetflow bench all --quick`` on real runtimes.

The quick run (mpirun and pool executors, the bare launcher, the three peers)
writes results.jsonl and report.md; the report's tables must agree with the
results file: every executor that ran has its rows, every number is there and
finite, and the medians are the results' medians. The report must come back
identical from the results file alone.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from hetflow.experiments import config as configs
from hetflow.experiments.report import load_rows, latest_runs

HETFLOW = [sys.executable, "-m", "hetflow"]
EXPERIMENTS = ("weak", "strong", "overhead", "pilot", "peers")


def _bench(args, tmp, timeout=240):
    return subprocess.run(HETFLOW + ["bench"] + args, capture_output=True, text=True, cwd=tmp,
                          timeout=timeout)


def _tables(markdown: str):
    """Each Markdown table of the report as (section, header, rows of cells)."""
    tables, section, lines = [], "", markdown.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].split(":")[0]
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            body, i = [], i + 2
            while i < len(lines) and lines[i].startswith("| "):
                body.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            tables.append((section, header, body))
            continue
        i += 1
    return tables


def _median_cell(cell: str) -> float:
    """The median of a ``median [min–max] (n=N) ‡`` cell (commas are thousands separators)."""
    return float(cell.split()[0].replace(",", ""))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0.006, abs_tol=1e-12)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # Bounded but generous: ~40 s on a quiet 2-core machine, ~4 min seen at load average 20.
    proc = _bench(["all", "--quick", "--out", str(out)], out, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.timeout(540)
def test_quick_run_writes_results_and_report(quick_run):
    out, proc = quick_run
    rows = load_rows(out / "results.jsonl")
    runs = latest_runs(rows)
    assert sorted(runs) == sorted(EXPERIMENTS)
    errors = [r for r in rows if r["kind"] in ("error", "skipped")]
    assert not errors, errors[:3]
    for r in rows:
        for key in ("run_id", "experiment", "kind", "host", "versions"):
            assert key in r, (key, r)
        if r["kind"] == "task":
            for key in ("executor", "ranks", "rows", "repeat", "op_mean_s", "peak_rss_mb"):
                assert key in r, (key, r)
            assert all(math.isfinite(t) and t >= 0 for t in r["op_iter_s"])
    # Progress: one line per experiment on a non-terminal, not one per rank or task.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert [p.split("]")[0][1:] for p in progress] == list(EXPERIMENTS), proc.stderr[-2000:]
    assert "\r" not in proc.stderr and "waiting for" not in proc.stderr   # no live progress
    # The join's row count is a property of the data: the peers, reading the partitions the
    # 2-rank hetflow run wrote, must find exactly as many matches as the distributed join.
    peers = [r for r in runs["peers"] if r["kind"] == "task" and r["op"] == "join"]
    assert len({r["rows_out"] for r in peers if r["ranks"] == 2 or "data_from_ranks" in r}) == 1
    for png in EXPERIMENTS:
        with open(out / f"{png}.png", "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_tables_match_results(quick_run):
    out, _ = quick_run
    report = (out / "report.md").read_text()
    assert not re.search(r"\bnan\b", report, re.IGNORECASE)
    runs = latest_runs(load_rows(out / "results.jsonl"))
    tables = {}
    for section, header, body in _tables(report):  # each section's first table is its results
        tables.setdefault(section, (header, body))
    assert set(tables) == set(EXPERIMENTS)
    for header, body in tables.values():
        for row in body:
            assert len(row) == len(header)
            assert all(cell and cell.lower() != "nan" for cell in row), row
    # Scaling tables: one row per (executor, op, ranks) that ran, with the results' median.
    for name in ("weak", "strong"):
        header, body = tables[name]
        col = {h: i for i, h in enumerate(header)}
        tasks = [r for r in runs[name] if r["kind"] == "task"]
        expected = {(r["executor"], r["op"], r["ranks"]) for r in tasks}
        seen = set()
        for row in body:
            key = (row[col["Executor"]], row[col["Op"]], int(row[col["Ranks"]].rstrip("†")))
            seen.add(key)
            want = statistics.median(r["op_mean_s"] for r in tasks
                                     if (r["executor"], r["op"], r["ranks"]) == key)
            assert _close(_median_cell(row[col["Op time (s)"]]), float(f"{want:.3g}")), (row, want)
            assert row[col["Ranks"]].endswith("†") == (key[2] > (os.cpu_count() or 1))
        assert seen == expected
        assert {e for e, _, _ in seen} == set(configs.load(name, quick=True).executors)
    # Overhead: every executor (bare launcher included) with its split; total = function + overhead.
    header, body = tables["overhead"]
    col = {h: i for i, h in enumerate(header)}
    assert {row[col["Executor"]] for row in body} == {"mpiexec", "mpirun", "pool"}
    tasks = [r for r in runs["overhead"] if r["kind"] == "task"]
    for row in body:
        mine = [r for r in tasks if r["executor"] == row[col["Executor"]]]
        for field, name in (("total_s", "Total (s)"), ("function_s", "Function (s)"),
                            ("overhead_s", "Overhead (s)")):
            want = statistics.median(r[field] for r in mine)
            assert _close(_median_cell(row[col[name]]), float(f"{want:.3g}")), (name, row)
    # Pilot: both scenarios for every executor, makespans as recorded.
    header, body = tables["pilot"]
    col = {h: i for i, h in enumerate(header)}
    spans = [r for r in runs["pilot"] if r["kind"] == "makespan"]
    assert {(row[col["Scenario"]], row[col["Executor"]]) for row in body} == \
        {(s, e) for s in ("pair", "campaign") for e in ("mpirun", "pool")}
    for row in body:
        want = statistics.median(r["makespan_s"] for r in spans if r["scenario"] ==
                                 row[col["Scenario"]] and r["executor"] == row[col["Executor"]])
        assert _close(_median_cell(row[col["Makespan (s)"]]), float(f"{want:.3g}"))
    # Peers: hetflow and all three single-machine engines.
    header, body = tables["peers"]
    col = {h: i for i, h in enumerate(header)}
    assert {row[col["Engine"]] for row in body} == {"hetflow (pool)", "pyarrow", "polars", "duckdb"}


def test_report_regenerates_from_results_alone(quick_run, tmp_path):
    out, _ = quick_run
    copy = tmp_path / "results.jsonl"
    copy.write_bytes((out / "results.jsonl").read_bytes())
    proc = _bench(["report", str(copy)], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report.md").read_text() == (out / "report.md").read_text()
    assert all((tmp_path / f"{name}.png").is_file() for name in EXPERIMENTS)


def test_runtime_not_installed_is_skipped_and_reported(tmp_path):
    proc = _bench(["strong", "--quick", "--ranks", "1", "--executors", "no-such-runtime,mpirun",
                   "--out", str(tmp_path)], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = load_rows(tmp_path / "results.jsonl")
    assert [r["executor"] for r in rows if r["kind"] == "skipped"] == ["no-such-runtime"]
    assert {r["executor"] for r in rows if r["kind"] == "task"} == {"mpirun"}
    report = (tmp_path / "report.md").read_text()
    assert "**no-such-runtime: skipped** — runtime 'no-such-runtime' is not installed" in report


@pytest.mark.parametrize("args, message", [
    (["no-such-experiment"], "no experiment 'no-such-experiment'"),
    (["weak", "--rows", "12x"], "--rows: '12x' is not a number"),
    (["weak", "--repeats", "0"], "repeats must be a positive int"),
    (["report"], "usage: hetflow bench report RESULTS"),
])
def test_bad_arguments_fail_clearly(args, message, tmp_path):
    proc = _bench(args, tmp_path, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_config_files_are_valid_and_state_their_scale():
    for name in configs.experiment_names():
        full, quick = configs.load(name), configs.load(name, quick=True)
        assert full.kind == quick.kind == name
        assert quick.repeats * len(quick.rows) <= full.repeats * len(full.rows)
    assert configs.load("weak").scale_factor == 35_000_000 / max(configs.load("weak").rows)
    assert configs.load("strong").scale_factor == 3_500_000_000 / max(configs.load("strong").rows)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine_scaling(extra, cwd):
    return subprocess.run([sys.executable, "-m", "hetflow.experiments.bench_engine", "--scaling",
                           "1,2", "--per-rank", "3000", "--rounds", "1", "--repeats", "1",
                           "--phases", *extra], capture_output=True, text=True, cwd=cwd,
                          timeout=240)


def test_engine_scaling_bench_runs_from_a_checkout():
    # Started from the checkout's root, where its own hetflow/ (without experiments/) comes
    # first on the path: the ranks run the benchmark's file, not `-m hetflow.experiments...`.
    run = _engine_scaling(["--cylon", ""] if importlib.util.find_spec("pycylon") else [], REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    # op, ranks, median, min, CPU s, of it sys, page faults, speed-up, ...
    rows = re.findall(r"^(join|sort)\s+([12])\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)\s+([0-9.]+)"
                      r"\s+([0-9,]+)\s+[0-9.]+\s", run.stdout, re.M)
    assert sorted((op, r) for op, r, *_ in rows) == [("join", "1"), ("join", "2"),
                                                      ("sort", "1"), ("sort", "2")], run.stdout
    assert all(float(sys_s) <= float(cpu) + 0.004 for *_, cpu, sys_s, _ in rows), run.stdout
    assert "join: per-phase wall s" in run.stdout and "exchange" in run.stdout
    bounds = re.findall(r"^(join|sort): speed-up over 1 rank\(s\) if every phase but 'local' "
                        r"were free: 2 ranks ([0-9.]+|inf) \(measured ([0-9.]+)\)$", run.stdout, re.M)
    assert [op for op, _, _ in bounds] == ["join", "sort"], run.stdout


@pytest.mark.timeout(300)
def test_shape_matrix_checks_every_engine_against_polars(tmp_path):
    # a few of the matrix's cells at a small size: join keys of a narrow int, a float and a
    # dictionary type with nulls (on both sides), hetflow at 1 and 2 ranks and DuckDB each
    # compared whole with polars
    from hetflow.experiments import matrix

    select = r"^join key=(uint8|float32|dictionary) right=10 unique"
    assert len(matrix.cells(3000, select)) == 6
    run = subprocess.run([sys.executable, "-m", "hetflow.experiments.matrix", "--rows", "3000",
                          "--rounds", "1", "--select", select], capture_output=True, text=True,
                         cwd=tmp_path, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = re.findall(r"^(join key=\S+ right=10 unique(?: nulls)?)\s.* (yes|NO)$", run.stdout, re.M)
    assert len(rows) == 6 and all(eq == "yes" for _, eq in rows), run.stdout


@pytest.mark.timeout(400)
def test_engine_memory_per_rank_is_counted_against_the_partition(tmp_path):
    # bench_engine --memory at a small size: every op and key kind, every rank, in bytes
    run = subprocess.run([sys.executable, "-m", "hetflow.experiments.bench_engine", "--memory",
                          "--rows", "1000000", "--ranks", "2", "--json", str(tmp_path / "m.json")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads((tmp_path / "m.json").read_text())["memory"]
    assert sorted(found) == sorted(f"{op} {kind}" for op in ("join", "sort", "groupby")
                                   for kind in ("int64", "string"))
    for cell, ranks in found.items():
        assert [m["rank"] for m in ranks] == [0, 1], cell
        for m in ranks:
            # the input is resident: the peak is at least the base plus the partition
            assert m["peak_reset"] and m["data_mib"] - m["base_mib"] > 0.5 * m["partition_mib"]
            assert m["peak_mib"] >= m["data_mib"] and m["output_mib"] > 0, (cell, m)


@pytest.mark.timeout(400)
def test_join_sort_and_groupby_peak_within_three_partitions():
    # Issue 41's goal, in bytes: at 2.5M rows per rank and table (int64 key and value), each
    # rank's peak resident set above its base is at most 3x its input partition (the input
    # itself, the output and the scratch): int64 join and sort (2.9x), the group-by of about
    # one group a row on int64 and string keys (2.4-2.7x: its rows move in rounds, each
    # aggregated before the next; 4.9x and 5.5x in one exchange), and the string join
    # (2.9x: its rows move in rounds too, each matched and built before the next; 4.4x).
    from hetflow.experiments import engine_memory

    for op, kind in (("join", "int64"), ("join", "string"), ("sort", "int64"),
                     ("groupby", "int64"), ("groupby", "string")):
        for m in engine_memory.launch(op, kind, 2_500_000, 2, timeout=300):
            whole, _ = engine_memory.ratios(m)
            assert 1.0 < whole <= engine_memory.GOAL, (op, kind, m)


@pytest.mark.skipif(importlib.util.find_spec("pycylon") is None,
                    reason="pycylon is not importable here (not on PyPI; see docs/engine.md)")
def test_engine_scaling_bench_times_cylon_beside_hetflow(tmp_path):
    run = _engine_scaling(["--cylon", sys.executable], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = re.findall(r"^(join|sort)\s+([12])\s+(hetflow|cylon\S*)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+"
                      r"\s+([0-9,]+)", run.stdout, re.M)
    engines = {(op, r, e) for op, r, e, _ in rows}
    assert engines == {(op, r, e) for r in "12" for op, e in [
        ("join", "hetflow"), ("join", "cylon-sort"), ("join", "cylon-hash"), ("sort", "hetflow"),
        ("sort", "cylon")]}, run.stdout
    # the same data: every engine gives the same number of rows at a rank count
    for op in ("join", "sort"):
        for r in "12":
            assert len({n for o, k, _, n in rows if (o, k) == (op, r)}) == 1, run.stdout


def test_contention_experiment_reports_what_each_rank_got(tmp_path):
    run = subprocess.run([sys.executable, "-m", "hetflow.experiments.contention", "--executors",
                          "mpirun,pool", "--rows", "2000", "--repeats", "3"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    # executor, rank, join ms, thread cpu share, preempted/s, others' cores, paused
    rows = re.findall(r"^(mpirun|pool)\s+([01])\s+([0-9.]+)\s+([0-9.]+)\s+([0-9]+)\s+([0-9.]+)"
                      r"\s+([0-9]+)$", run.stdout, re.M)
    assert sorted((e, r) for e, r, *_ in rows) == [("mpirun", "0"), ("mpirun", "1"),
                                                   ("pool", "0"), ("pool", "1")], run.stdout
    for _, _, ms, share, _, others, paused in rows:
        # others: at most every core of the node; the loop lasts >= 1 s, so /proc/stat's 10 ms
        # ticks round by 0.01 core per CPU at most (over 3 bare joins of 2 ms, by 8 cores)
        assert float(ms) > 0 and 0 < float(share) <= 1.05 and float(others) <= os.cpu_count() + 0.1
        assert paused == "0"   # only the radical task pauses anything, and only when asked


# --------------------------------------------------------------------------- the pipeline
PIPELINE_TOML = """
kind = "pipeline"
description = "tiny pipeline"
ranks = [2]
train_ranks = 2
rows = [1_000]
iterations = 3
repeats = 1
batch_size = 32
handoffs = ["table", "keep"]
executors = ["pool"]
"""


@pytest.mark.timeout(420)
def test_pipeline_hands_every_row_over_and_trains(tmp_path):
    """features -> DDP training -> evaluation on the pool (the returned table in the ranks'
    memory, and hetflow.keep): every row produced reaches training and evaluation, the loss
    falls, and the same seed gives the same loss curve with either hand-off. (The Parquet
    hand-off a launch-per-task runtime makes is checked on every runtime by test_parity; here
    each mpirun stage would pay a cold torch import per rank.)"""
    pytest.importorskip("torch")
    cfg = tmp_path / "tiny_pipeline.toml"
    cfg.write_text(PIPELINE_TOML)
    proc = _bench([str(cfg), "--out", str(tmp_path)], tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows(tmp_path / "results.jsonl")
    assert not [r for r in rows if r["kind"] in ("error", "skipped")], rows
    runs = [r for r in rows if r["kind"] == "pipeline"]
    assert sorted((r["executor"], r["mode"]) for r in runs) == [("pool", "keep"), ("pool", "table")]
    for r in runs:
        produced = r["rows_produced"]
        assert produced > 0
        assert r["train"]["rows_received"] == produced == r["evaluation"]["rows"], r
        losses = r["train"]["losses"]
        assert len(losses) == 3 and losses[-1] < losses[0], losses
        assert r["evaluation"]["mse"] < r["evaluation"]["label_variance"], r["evaluation"]
        assert r["train"]["hetflow_copied_bytes"] < r["train"]["deeprc_copied_bytes"]
        for stage in ("features", "train", "evaluate"):
            assert r["stages"][stage]["function_s"] > 0
    curve = runs[0]["train"]["losses"]
    for r in runs[1:]:
        assert r["rows_produced"] == runs[0]["rows_produced"]
        assert r["train"]["losses"] == pytest.approx(curve, rel=1e-5)
    report = (tmp_path / "report.md").read_text()
    assert "## tiny_pipeline" in report and "Deep RC path (s)" in report
    _pipeline_report_says_what_each_number_covers(report, rows)
    with open(tmp_path / "tiny_pipeline.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def _pipeline_report_says_what_each_number_covers(report: str, rows) -> None:
    from hetflow.experiments.report import fmt

    # the headline is the experiment's wall clock; each runtime's share adds up to it
    run_time = next(r["seconds"] for r in rows if r["kind"] == "run_time")
    assert f"**Wall clock: {fmt(run_time)} s** for this experiment" in report
    header, body = next((h, b) for _, h, b in _tables(report) if "Runs' tasks (s)" in h)
    session = next(r for r in rows if r["kind"] == "session")
    runs = [r for r in rows if r["kind"] == "pipeline"]
    share = (session["startup_s"] + session["shutdown_s"] + runs[0]["warmup_s"]
             + sum(r["makespan_s"] for r in runs))
    assert body[0][header.index("Total (s)")] == f"**{fmt(share)}**"
    assert share <= run_time
    # this pipeline's own words: epochs, events, where the rows go, the Deep RC path
    assert "3 training epoch(s)" in report and "1,000 events per rank" in report
    assert "Protocol: each run submits three tasks" in report
    assert "Protocol (the paper's)" not in report and "Protocol of the join" not in report
    assert ("Feature rows: 1,000 events per rank × 2 ranks = 2,000 events over 500 users"
            in report)
    assert "**Deep RC path**: how Deep RC" in report
    # a 0.02 MB table and ms of work: no speed-up quoted, the sizes said instead
    header, body = next((h, b) for _, h, b in _tables(report) if "Speed-up" in h)
    assert {row[header.index("Speed-up")] for row in body} == {"too small"}
    assert "Speed-up: not quoted under 1 MB of table" in report


def test_per_experiment_help_says_what_the_options_mean(tmp_path):
    proc = _bench(["pipeline", "--help"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pipeline: data engineering -> DDP training -> evaluation" in proc.stdout
    assert "--iterations  training epochs of the DDP task: 8; 3" in proc.stdout
    assert "--rows        events per rank of the features task: 20000; 2000" in proc.stdout
    generic = _bench(["--help"], tmp_path, timeout=60).stdout
    assert "pipeline: training" in " ".join(generic.split())


def test_report_has_the_runtime_cpu_column(quick_run):
    out, _ = quick_run
    rows = load_rows(out / "results.jsonl")
    sessions = [r for r in rows if r["kind"] == "session"]
    runtimes = {r["executor"] for r in sessions}
    tasks = [r for r in rows if r["kind"] == "task" and r["executor"] in runtimes
             and "runtime_cores" in r]
    # idle measured twice: right after start, and settled after the runtime's last task
    assert sessions and all(r["idle_runtime_cores"] >= 0 and r["start_runtime_cores"] >= 0
                            for r in sessions)
    assert tasks and all(r["runtime_cores"] >= 0 and r["task_cpu_s"] > 0 for r in tasks)
    found = [(header, body) for _, header, body in _tables((out / "report.md").read_text())
             if "Runtime CPU idle" in header]
    assert found
    executors = {row[0] for _, body in found for row in body}
    assert executors == runtimes


def test_runtime_cost_compares_variants_side_by_side(tmp_path):
    # Two variants of one runtime, interleaved, 3 repeats each: every task row carries the op
    # time, each rank's CPU during the op, the machine's load and others' CPU; the summary
    # gives a ratio only where the ranges are disjoint.
    out = tmp_path / "cost.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetflow.experiments.runtime_cost",
                           "--rows", "2e4", "--repeats", "3", "--variants", "mpirun,mpirun:",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows(out)
    tasks = [r for r in rows if r["kind"] == "task"]
    assert [(r["variant"], r["op"], r["repeat"]) for r in tasks] == [
        (v, op, rep) for rep in range(3) for v in ("mpirun", "mpirun:") for op in ("join", "sort")]
    assert all(r["op_mean_s"] > 0 and len(r["op_cpu_s"]) == 2 and r["load1"] >= 0
               and r["others_cores"] >= 0 and isinstance(r["busy"], bool) for r in tasks)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| join")]
    assert len(lines) == 2 and "(baseline)" in lines[0], proc.stdout
    assert re.search(r"within noise|\d\.\d\dx", lines[1]), lines[1]
