"""The analytics benchmark end to end (``hetflow bench analytics --quick`` beside the paper-scale
config), its question picker, its cross-engine checks, and its report table: each engine's time
as median [min–max] with n, the ratio to the faster peer only beyond noise (issue 42 item 4)."""
from __future__ import annotations

import json
import re
import statistics

import pytest
from test_experiments import _bench, _tables

from hetflow.experiments.report import latest_runs, load_rows

def test_analytics_questions_pick_queries_by_name_or_a_part_naming_one():
    # hetflow bench analytics --questions "median;sum v3": the subset the config runs
    from hetflow.errors import ConfigError
    from hetflow.experiments import cli, config

    picked = cli.questions(" median ;sum v3;groupby id_lo (100)")
    assert picked == ["median, std v3 by id4, id5 (int32)", "sum v3, count v1 by 6 keys",
                      "groupby id_lo (100)"]
    args = cli.build_parser("hetflow bench", "analytics").parse_args(
        ["analytics", "--questions", "median"])
    cfg = config.load("analytics").replace(queries=cli.questions(args.questions))
    assert cfg.queries == ("median, std v3 by id4, id5 (int32)",)
    assert config.load("analytics").replace(queries=cli.questions(None)).queries == ()
    for bad in ("6 keys", "no such query", ""):   # two, none, every one
        with pytest.raises(ConfigError, match="--questions"):
            cli.questions(bad)


@pytest.mark.timeout(400)
def test_analytics_and_paper_scale_configs_run_small(tmp_path):
    # The two by-name benchmarks at a small size, into one results file: the analytics queries
    # in hetflow (2 ranks through mpirun) and both peers, every result equal across engines;
    # the paper-scale weak and strong cases with peak memory and the run time.
    for name in ("analytics", "paper"):
        proc = _bench([name, "--quick", "--no-plots", "--out", str(tmp_path)], tmp_path,
                      timeout=360)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows(tmp_path / "results.jsonl")
    assert not [r for r in rows if r["kind"] in ("error", "skipped")]
    runs = latest_runs(rows)
    from hetflow.experiments.analytics import QUERIES

    tasks = [r for r in runs["analytics"] if r["kind"] == "task"]
    assert {(r["executor"], r["op"]) for r in tasks} == {
        (e, q.name) for e in ("mpirun", "polars", "duckdb") for q in QUERIES}
    assert all(r["equal"] for r in tasks), [(r["executor"], r["op"], r["mismatch"])
                                            for r in tasks if not r["equal"]]
    assert {r["ranks"] for r in tasks if r["executor"] == "mpirun"} == {2}
    # the peak memory: measured in a query's first run, on that run's row
    assert all(r["peak_rss_mb"] > 0 and r["partition_mb"] > 0 for r in tasks if r["repeat"] == 0)
    assert not any("peak_rss_mb" in r for r in tasks if r["repeat"] > 0)
    paper = [r for r in runs["paper"] if r["kind"] == "task"]
    assert {(r["op"], r["ranks"], r["rows_per_rank"]) for r in paper} == {
        (op, ranks, per) for op in ("join", "sort") for ranks, per in
        ((1, 5_000), (2, 5_000), (1, 10_000))}
    assert all(r["modes"] == (["weak", "strong"] if r["ranks"] == 2 else
                              ["weak"] if r["rows_per_rank"] == 5_000 else ["strong"])
               for r in paper)
    report = (tmp_path / "report.md").read_text()
    tables = {}
    for section, header, body in _tables(report):
        tables.setdefault(section, (header, body))   # the section's own table, not the sessions
    header, body = tables["analytics"]
    assert [row[0] for row in body] == [q.name for q in QUERIES]
    # the quick run times each query 3 times in each engine: every cell a median [min–max]
    # over 3 runs, each run's load and others' CPU recorded, the ratio a number or "within noise"
    assert {len([r for r in tasks if (r["executor"], r["op"]) == (e, q.name)])
            for e in ("mpirun", "polars", "duckdb") for q in QUERIES} == {3}
    assert all(isinstance(r["load1"], float) and r["others_cores"] >= 0 for r in tasks)
    ratio = header.index("hetflow / faster peer")
    for row in body:
        assert row[1] == "3/3/3"
        assert all(re.fullmatch(r"[0-9.,]+ \[[0-9.,]+–[0-9.,]+\]( ‡)?", row[c]) for c in (2, 3, 4))
        assert row[ratio] == "within noise" or float(row[ratio].strip("*")) > 0, row
    assert all(row[header.index("Equal")] == "yes" for row in body)
    header, body = tables["paper"]
    assert len(body) == 8  # weak: 1 and 2 ranks; strong: 1 and 2 ranks; join and sort each
    assert all(float(row[header.index("Peak / partition")]) > 0 for row in body)
    assert re.search(r"Run time: mpirun [0-9.]+ s; the whole experiment [0-9.]+ s\.", report)


def test_analytics_table_gives_each_time_its_spread_and_calls_overlaps_within_noise(tmp_path):
    # Issue 42 item 4 for the analytics table: each engine's runs of a query are results rows
    # of their own (analytics.repeat_rows), each with the machine's load; a cell is the median
    # [min–max] with n; the ratio to the faster peer is a ratio only where the ranges do not
    # overlap, and a run on a busy machine marks its figure.
    from hetflow.experiments import analytics
    from hetflow.experiments.report import write_report

    def record(times, busy=False):
        return {"op_s": statistics.median(times), "op_times": times, "rows_out": 5,
                "machine": [{"load1": 0.5 + i, "others_cores": 0.4 if busy else 0.01,
                             "busy": busy} for i in range(len(times))],
                "peak_rss_mb": 90.0, "partition_mb": 30.0, "peak_over_partition": 3.0,
                "rss_before_mb": 60.0}

    times = {"q overlaps": {"mpirun": [1.0, 1.1, 1.3], "polars": [1.2, 1.25, 1.4],
                            "duckdb": [2.0, 2.1, 2.2]},
             "q slower": {"mpirun": [3.0, 3.1, 3.2], "polars": [2.0, 2.1, 2.2],
                          "duckdb": [5.0, 5.1, 5.2]}}
    rows = [{"kind": "run", "experiment": "analytics", "run_id": "r1", "config": {
        "kind": "analytics", "peers": ["polars", "duckdb"], "executors": ["mpirun"],
        "rows": [100], "ranks": [2]}}]
    for q, engines in times.items():
        for engine, ts in engines.items():
            peer = engine != "mpirun"
            for row in analytics.repeat_rows(record(ts, busy=(q, engine) == ("q slower",
                                                                             "duckdb"))):
                rows.append({**row, "kind": "task", "experiment": "analytics", "run_id": "r1",
                             "executor": engine, "op": q, "rows": 100, "ranks": 1 if peer else 2,
                             "threads": 2 if peer else None, "equal": True})
    assert [r["repeat"] for r in rows[1:4]] == [0, 1, 2]
    assert "peak_rss_mb" in rows[1] and "peak_rss_mb" not in rows[2]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = open(write_report(str(results), plots=False)).read()
    (_, header, body), = [t for t in _tables(report) if t[0] == "analytics"]
    cells = {row[0]: dict(zip(header, row)) for row in body}
    overlap, slower = cells["q overlaps"], cells["q slower"]
    assert overlap["n (hetflow/polars/duckdb)"] == "3/3/3"
    assert overlap["hetflow 2 ranks (s)"] == "1.10 [1.00–1.30]"
    assert overlap["polars (s)"] == "1.25 [1.20–1.40]"
    assert overlap["hetflow / faster peer"] == "within noise"
    assert slower["hetflow / faster peer"] == "**1.48**"        # 3.1 / 2.1, ranges apart
    assert slower["duckdb (s)"] == "5.10 [5.00–5.20] ‡"
    assert overlap["Load (1 min)"] == "1.50 [0.500–2.50]"
    assert slower["Others' CPU (cores)"].endswith("‡")
    assert overlap["hetflow peak RSS per rank (MiB)"] == "90.0"
    assert ("over 2 queries: 1 within noise, 0 faster beyond noise, 1 slower beyond noise "
            "(ratios 1.48–1.48)") in report


def test_analytics_checks_catch_a_wrong_result():
    # The cross-engine checks themselves: a changed value, a lost row and reordered rows.
    import pyarrow as pa
    from hetflow.experiments import analytics

    q = analytics.QUERIES[0]
    ref = pa.table({"id_lo": ["a", "b", None], "v_int_sum": [1, 2, 3], "v_float_mean": [0.5, 1.0, None]})
    assert analytics.compare(ref, ref.take([2, 0, 1]), q) is None
    assert analytics.compare(ref, ref.set_column(1, "v_int_sum", pa.array([1, 2, 4])), q)
    assert analytics.compare(ref, ref.set_column(2, "v_float_mean", pa.array([0.5, 1.01, None])), q)
    assert analytics.compare(ref, ref.slice(0, 2), q)
    assert analytics.digest(ref) == analytics.digest(ref.take([1, 2, 0]))
    parts = analytics.combine_digests([analytics.digest(ref.slice(0, 1)),
                                       analytics.digest(ref.slice(1))])
    assert parts == analytics.digest(ref)
    assert analytics.digest(ref) != analytics.digest(ref.set_column(1, "v_int_sum",
                                                                    pa.array([1, 3, 2])))
    # a held-out query's top 2 per group: lists, compared whole after the keys' sort
    top = next(q for q in analytics.QUERIES if q.aggs == (("v3", "nlargest_2"),))
    ref = pa.table({"id6": pa.array([2, 1], pa.int32()),
                    "v3_nlargest_2": pa.array([[9.5, 1.0], [3.0]], pa.large_list(pa.float64()))})
    same = pa.table({"id6": [1, 2], "v3_nlargest_2": [[3.0], [9.5, 1.0]]})
    assert analytics.compare(ref, same, top) is None
    assert analytics.compare(ref, same.set_column(1, "v3_nlargest_2", pa.array([[3.0], [9.5, 2.0]])),
                             top) == "column v3_nlargest_2: values differ"
