"""The report's analytics section: per query, hetflow's time and each peer's as median
[min–max] over their runs with n, the ratio to the faster peer only where the two ranges do not
overlap (else "within noise", ``noise.compare``), and the machine's load during the runs.

A results row is one run of one query in one engine (``analytics.repeat_rows``); rows written
before runs were kept one by one hold a median alone and count as n = 1.
"""
from __future__ import annotations

from typing import List, Tuple

from hetflow.experiments import noise
from hetflow.experiments.report_table import executors_in, fmt, group, median, stat, table, values

NOTE = ("Times: each cell is the median [min–max] over the query's runs in that engine, n "
        "runs each (hetflow: `barrier; t0; query; barrier; t1`; peers: the query materialised "
        "as a table), data already in memory. hetflow / faster peer: the ratio of the medians "
        "where the two [min–max] ranges do not overlap and both have n ≥ 3, \"within noise\" "
        "where they overlap. Load: the 1-minute load average after each run, and others' CPU: "
        "the cores that processes other than the engine's own (its ranks and their runtime, or "
        "the peer's process) used during each run, median [min–max] over every engine's runs "
        "of the query; ‡ marks a figure with a run on a busy machine. Peak RSS: the process's "
        "peak resident set during the query's first run (reset before it), the input included; "
        "partition: the rank's part of the big table (all its columns) plus its part of the "
        "query's right-hand table; peak above: the query's own memory, the peak less the "
        "resident set just before the query. Equal: group-by results compared with the first "
        "peer's after sorting by the keys (floats to a relative 1e-9), join results by an "
        "order-independent digest of every row.")


def _ratio(best: List[dict], mine: List[dict]) -> str:
    text = noise.compare(best, mine, "op_s", lambda m, b: f"{m / b:.2f}")
    try:
        return f"**{text}**" if float(text) > 1 else text
    except ValueError:
        return text


def _table(queries, grp, tasks, peers, rows_n, ranks) -> Tuple[List[List[str]], List[str]]:
    body, verdicts = [], []
    for q in queries:
        mine = [r for r in grp if r["op"] == q]
        if not mine:
            continue
        theirs = {p: [r for r in tasks if r["executor"] == p and r["op"] == q
                      and r["rows"] == rows_n and r.get("threads") == ranks] for p in peers}
        timed = [v for v in theirs.values() if median(v, "op_s") is not None]
        best = min(timed, key=lambda v: median(v, "op_s"), default=[])
        ratio = _ratio(best, mine)
        verdicts.append(ratio)
        every = mine + [r for v in theirs.values() for r in v]
        equal = "yes" if all(r.get("equal") for r in every) else "**no**: " + "; ".join(
            f"{r['executor']}: {r.get('mismatch')}" for r in every if not r.get("equal"))
        runs = "/".join(str(len(values(v, "op_s"))) for v in [mine, *theirs.values()])
        above = [{"d": r["peak_rss_mb"] - r["rss_before_mb"]} for r in mine
                 if "rss_before_mb" in r and "peak_rss_mb" in r]
        body.append([q, runs, stat(mine, "op_s")] + [stat(theirs[p], "op_s") for p in peers] + [
            ratio, stat(every, "load1"), stat(every, "others_cores"),
            fmt(median(mine, "peak_rss_mb")), fmt(median(mine, "partition_mb")),
            fmt(median(mine, "peak_over_partition")), fmt(median(above, "d"))]
            + [fmt(median(theirs[p], "peak_rss_mb")) for p in peers]
            + [f"{mine[0].get('rows_out', 0):,}", equal])
    return body, verdicts


def _summary(verdicts: List[str]) -> List[str]:
    ratios = []
    for v in verdicts:
        try:
            ratios.append(float(v.strip("*")))
        except ValueError:
            pass
    if not verdicts:
        return []
    within = sum(v == "within noise" for v in verdicts)
    short = len(verdicts) - within - len(ratios)
    text = (f"hetflow / faster peer over {len(verdicts)} queries: {within} within noise, "
            f"{sum(r <= 1.0 for r in ratios)} faster beyond noise, {sum(r > 1.0 for r in ratios)} "
            "slower beyond noise")
    if ratios:
        text += f" (ratios {min(ratios):.2f}–{max(ratios):.2f})"
    if short:
        text += f", {short} without n ≥ 3 on both sides"
    return [text + ".", ""]


def section(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    """The analytics section of the report: a table per runtime, size and rank count."""
    tasks = [r for r in rows if r.get("kind") == "task"]
    cfg = run.get("config", {})
    peers = [p for p in (cfg.get("peers") or []) if any(r["executor"] == p for r in tasks)]
    hetflow_execs = [e for e in executors_in(tasks, run) if e not in peers]
    queries = list(dict.fromkeys(r["op"] for r in tasks))
    lines = []
    for executor in hetflow_execs:
        for (rows_n, ranks), grp in sorted(group([r for r in tasks if r["executor"] == executor],
                                                  "rows", "ranks").items()):
            body, verdicts = _table(queries, grp, tasks, peers, rows_n, ranks)
            lines += [f"{rows_n:,} rows, hetflow at {ranks} ranks through `{executor}` against "
                      f"{', '.join(peers)} on {ranks} threads each:", ""]
            lines += table(["Query", "n (" + "/".join(["hetflow", *peers]) + ")",
                            f"hetflow {ranks} ranks (s)"] + [f"{p} (s)" for p in peers]
                           + ["hetflow / faster peer", "Load (1 min)", "Others' CPU (cores)",
                              "hetflow peak RSS per rank (MiB)", "partition per rank (MiB)",
                              "peak / partition",
                              "hetflow peak above its resident set before (MiB)"]
                           + [f"{p} peak RSS (MiB)" for p in peers] + ["Rows out", "Equal"], body)
            lines += _summary(verdicts)
    if any("op_times" not in r and "repeat" not in r for r in tasks):
        lines += ["This run's rows each hold a query's median over its runs alone (written before "
                  "each run was kept): n = 1, no spread, not a result.", ""]
    return lines + [NOTE, ""], []
