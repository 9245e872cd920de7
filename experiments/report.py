"""Turn a results file (JSON Lines, see ``runner``) into a Markdown report and PNG plots.

Everything comes from the results file alone, so ``hetflow bench report RESULTS``
regenerates the report of any past run. Numbers are the median over repeats with
the spread written ``[min–max]`` and the count ``n``; an executor that was not
installed or failed is listed, never dropped silently.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from hetflow.experiments import analytics_report, noise, owncpu, report_pipeline
from hetflow.experiments.report_plots import plot_overhead, plot_peers, plot_pilot, plot_scaling
from hetflow.experiments.report_table import (executors_in, fmt, group, latest_runs, load_rows,
                                              median, ranks_label, stat, table, values)

ORDER = ("weak", "strong", "overhead", "pilot", "pilot_slurm", "peers", "analytics", "paper",
         "pipeline", "pipeline_slurm")
#: Paper figures quoted next to ours.
PAPER = {
    "weak": "paper: 35 M rows per rank, up to thousands of ranks on Rivanna/Summit",
    "strong": "paper: 3.5 B rows in total",
    "pilot": "paper: the pilot ran the join+sort pair 4–15% faster than separate batch jobs",
    "pilot_slurm": "paper: the pilot ran the join+sort pair 4–15% faster than separate batch jobs",
}


# --------------------------------------------------------------------------- sections
def _header(run: dict, rows: List[dict]) -> List[str]:
    cfg = run.get("config", {})
    out = [f"## {cfg.get('name', run['experiment'])}: {cfg.get('description', '')}".rstrip(": "), ""]
    rows_txt = ", ".join(f"{r:,}" for r in cfg.get("rows", []))
    unit = "rows per rank" if cfg.get("rows_mode") == "per_rank" else "rows in total"
    pipeline = cfg.get("kind") == "pipeline"    # its rows are events, its iterations epochs
    out.append(f"Run `{run['run_id']}`: ranks {cfg.get('ranks')}, {rows_txt} "
               f"{'events per rank' if pipeline else unit}, {cfg.get('iterations')} "
               f"{'training epoch(s)' if pipeline else 'iteration(s) per task'}, "
               f"{cfg.get('repeats')} repeat(s); executors {cfg.get('executors')}.")
    if (cfg.get("scale_factor") or 0) > 1:
        out.append(f"Scale: {cfg['paper_rows']:,} rows in the paper → {max(cfg['rows']):,} here, "
                   f"**{cfg['scale_factor']:,.0f}× smaller** (this machine: {run.get('cores')} "
                   f"cores, {run.get('host', {}).get('mem_gib')} GiB).")
    if run["experiment"] in PAPER:
        out.append(f"({PAPER[run['experiment']]}.)")
    out.append("")
    for r in rows:
        if r.get("kind") == "skipped":
            out.append(f"- **{r['executor']}: skipped** — {r['reason']}")
    errors = group([r for r in rows if r.get("kind") == "error"], "executor", "stage")
    for (executor, stage), errs in errors.items():
        out.append(f"- **{executor}: {len(errs)} error(s) at {stage}** — {errs[0]['error']}")
    if out[-1] != "":
        out.append("")
    return out


def _sessions(rows) -> List[str]:
    sessions = [r for r in rows if r.get("kind") == "session"]
    if not sessions:
        return []
    # The slots the runtime ran with: an experiment's executor options may set them.
    body = [[r["executor"], (r.get("options") or {}).get("max_ranks", r.get("max_ranks", "")),
             fmt(r["startup_s"]), fmt(r["shutdown_s"])] for r in sessions]
    return ["Runtime sessions (seconds):", ""] + table(
        ["Executor", "Rank slots", "Start-up (s)", "Shut-down (s)"], body)


def _scaling(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    tasks = [r for r in rows if r.get("kind") == "task"]
    strong = run["experiment"] == "strong" or run.get("config", {}).get("kind") == "strong"
    execs = executors_in(tasks, run)
    body = []
    for (executor, op, ranks, rows_n), grp in sorted(
            group(tasks, "executor", "op", "ranks", "rows").items(),
            key=lambda kv: (execs.index(kv[0][0]), kv[0][1], kv[0][3], kv[0][2])):
        base = [r for r in tasks if r["executor"] == executor and r["op"] == op
                and r["ranks"] == 1 and (strong or r["rows_per_rank"] == grp[0]["rows_per_rank"])
                and (not strong or r["rows"] == rows_n)]
        ratio_txt = ("1.00" if ranks == 1 else
                     noise.compare(base, grp, "op_mean_s", lambda m, b: f"{b / m:.2f}"))
        body.append([executor, op, ranks_label(ranks, grp[0].get("oversubscribed")),
                     f"{grp[0]['rows_per_rank']:,}", f"{rows_n:,}", stat(grp, "op_mean_s"),
                     ratio_txt, stat(grp, "gen_s"), stat(grp, "total_s"),
                     fmt(median(grp, "peak_rss_mb")), len(grp)])
    ratio_name = "Speed-up vs 1 rank" if strong else "Efficiency vs 1 rank"
    lines = table(["Executor", "Op", "Ranks", "Rows/rank", "Rows total", "Op time (s)", ratio_name,
                    "Data gen (s)", "Total (s)", "Peak RSS/rank (MiB)", "n"], body)
    lines += ["Op time: one iteration of the op (`barrier; t0; op; barrier; t1`), mean over ranks, "
              "mean over iterations; median [min–max] over repeats. Total: from submitting the task "
              "to its result (runtime launch, engine import, data generation, all iterations). "
              + ("Speed-up: 1-rank op time / this op time (ideal = ranks). " if strong else
                 "Efficiency: 1-rank op time / this op time (ideal = 1.0; weak scaling). ")
              + "† more ranks than cores (oversubscribed): not a scaling point, a stress point.", ""]
    pngs = plot_scaling(tasks, execs, out_dir, stem, strong)
    return lines, pngs


def _overhead(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    tasks = [r for r in rows if r.get("kind") == "task"]
    execs = executors_in(tasks, run)
    baseline = run.get("config", {}).get("baseline", "mpirun")
    body = []
    for (executor, op, ranks, per_rank), grp in sorted(
            group(tasks, "executor", "op", "ranks", "rows_per_rank").items(),
            key=lambda kv: (kv[0][1], kv[0][3], kv[0][2], execs.index(kv[0][0]))):
        base = [r for r in tasks if r["executor"] == baseline and r["op"] == op
                and r["ranks"] == ranks and r["rows_per_rank"] == per_rank]
        ratio = noise.compare(base, grp, "overhead_s", lambda m, b: f"{m / b:.3f}")
        body.append([op, f"{per_rank:,}", ranks_label(ranks, grp[0].get("oversubscribed")),
                     executor, stat(grp, "total_s"), stat(grp, "function_s"),
                     stat(grp, "setup_s"), stat(grp, "overhead_s"), stat(grp, "queue_s"),
                     stat(grp, "launch_s"),
                     stat(grp, "return_s"), ratio, len(grp)])
    lines = table(["Op", "Rows/rank", "Ranks", "Executor", "Total (s)", "Function (s)",
                    "of which set-up (s)", "Overhead (s)", "Queue (s)", "Launch (s)", "Return (s)",
                    f"Overhead / {baseline}", "n"], body)
    lines += ["Total: submit → result on the client. Function: rank 0 inside the task function "
              "(engine import, data generation, all iterations); its set-up part is the engine's "
              "import and first use, paid by every task of a launch-per-task runtime but only by "
              "the first task on a warm pool's ranks. Overhead = Total − Function: "
              "Queue (submitted → launched), Launch (launched → function started: process start, "
              "interpreter, MPI init, unpickling), Return (function end → result on the client). "
              f"`{baseline}` is hetflow's one-`mpiexec`-per-task executor; `mpiexec` is the bare "
              "launcher with no hetflow runtime at all (its Launch includes everything before "
              "the function). median [min–max] over tasks × repeats.", ""]
    return lines, plot_overhead(tasks, execs, out_dir, stem)


def _with_queue(spans, rows) -> List[dict]:
    """Makespan rows with ``queue_mean_s`` (the mean task queue wait of the scenario run),
    from their task rows where the results predate the field."""
    tasks = group([r for r in rows if r.get("kind") == "task" and "scenario" in r],
                   "executor", "scenario", "repeat")
    out = []
    for span in spans:
        if "queue_mean_s" not in span:
            waits = values(tasks.get((span["executor"], span["scenario"], span["repeat"]), []),
                            "queue_s")
            if waits:
                span = dict(span, queue_mean_s=sum(waits) / len(waits))
        out.append(span)
    return out


def _pilot(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    spans = _with_queue([r for r in rows if r.get("kind") == "makespan"], rows)
    execs = executors_in(spans, run)
    baseline = run.get("config", {}).get("baseline", "mpirun")
    body = []
    for (scenario, executor), grp in sorted(
            group(spans, "scenario", "executor").items(),
            key=lambda kv: (kv[0][0] != "pair", execs.index(kv[0][1]))):
        base = [r for r in spans if r["scenario"] == scenario and r["executor"] == baseline]
        gain = noise.compare(base, grp, "makespan_s", lambda m, b: f"{100 * (b - m) / b:+.1f}%")
        with_start = [dict(r, total=r["makespan_s"] + r["startup_s"]) for r in grp]
        body.append([scenario, grp[0]["tasks"], executor, stat(grp, "makespan_s"), gain,
                     stat(grp, "queue_mean_s"), stat(with_start, "total"),
                     stat(grp, "function_sum_s"), stat(grp, "launch_return_sum_s"), len(grp)])
    lines = table(["Scenario", "Tasks", "Executor", "Makespan (s)", f"Faster than {baseline}",
                    "Queue wait per task, mean (s)", "Makespan + start-up (s)", "Σ function (s)",
                    "Σ launch + return (s)", "n"], body)
    spec = {}
    for r in spans:
        spec.setdefault(r["scenario"], r.get("tasks_spec"))
    if baseline == "slurm":
        model = (f"Batch = `{baseline}`: every task is its own Slurm batch job (`sbatch`), so it "
                 "waits in Slurm's queue for its CPUs as a batch user's job does; pilot = a "
                 "runtime that asked Slurm for one allocation of the same nodes itself (its "
                 "`slurm=` option: the pool by `salloc`, Parsl's block by `sbatch`, RADICAL-"
                 "Pilot's pilot job by `sbatch`) and runs every task inside it. Its start-up "
                 "includes that allocation's queue wait and its first (tiny) task. ")
    else:
        model = (f"Batch = `{baseline}`: every task is its own `mpiexec` launch (the batch-job "
                 "model); pilot = the tasks run inside one already-started runtime. ")
    lines += [model + "All tasks of a scenario are submitted at once; makespan: first submit → "
              "last result. Faster: (batch − this) / batch on the makespan median (positive = "
              "faster than batch). Queue wait: submit → launch of each task, its mean over the "
              "scenario's tasks (waiting for CPUs, in the batch queue or the pilot's own), part "
              "of the makespan. Start-up (runtime session) is paid once per allocation, so it "
              "is shown separately.", ""]
    for scenario, tasks in spec.items():
        if tasks:
            lines.append(f"- {scenario}: " + ", ".join(f"{op}×{ranks} ranks×{rows:,} rows/rank"
                                                      for op, ranks, rows in tasks))
    lines.append("")
    return lines, plot_pilot(spans, execs, out_dir, stem)


def _peers(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    tasks = [r for r in rows if r.get("kind") == "task"]
    execs = executors_in(tasks, run)
    hetflow_execs = set(run.get("config", {}).get("executors") or [])
    body = []
    for (rows_n, op), grp_all in sorted(group(tasks, "rows", "op").items()):
        groups = [g for g in group(grp_all, "executor", "ranks").values()
                  if median(g, "op_mean_s") is not None]
        best = min(groups, key=lambda g: median(g, "op_mean_s"), default=[])
        for (executor, ranks), grp in sorted(group(grp_all, "executor", "ranks").items(),
                                             key=lambda kv: (execs.index(kv[0][0]), kv[0][1])):
            name = f"hetflow ({executor})" if executor in hetflow_execs else executor
            ratio = ("1.00" if grp is best else
                     noise.compare(best, grp, "op_mean_s", lambda m, b: f"{m / b:.2f}"))
            outs = sorted({r.get("rows_out") for r in grp})
            body.append([f"{rows_n:,}", op, name, ranks_label(ranks, grp[0].get("oversubscribed")),
                         stat(grp, "op_mean_s"), ratio, fmt(median(grp, "peak_rss_mb")),
                         ", ".join(f"{o:,}" for o in outs if o is not None), len(grp)])
    lines = table(["Rows (each table)", "Op", "Engine", "Ranks / processes", "Op time (s)",
                    "× fastest", "Peak RSS (MiB, per rank)", "Rows out", "n"], body)
    lines += ["Peers run alone in one process on the Parquet partitions the largest hetflow run "
              "generated (same rows, same keys); polars and duckdb use every core they see. Op "
              "time excludes loading. Rows out agree across engines when the data is the same "
              "(hetflow at fewer ranks draws different, equally distributed, data).", ""]
    return lines, plot_peers(tasks, execs, out_dir, stem, hetflow_execs)


#: The paper's bare-metal Cylon figures on Summit (rows per second per rank), by (mode, op).
#: Empty: they were not found in the sources this project could reach (the report says so);
#: figures are added here only as read from the paper.
PAPER_SUMMIT: Dict[Tuple[str, str], float] = {}
#: Radical-Cylon's own times on Summit at 35 M rows per rank (weak scaling), the fastest and
#: slowest over its node counts, in seconds, as a third-party summary of the paper quotes
#: them (RADICAL_CYLON_SOURCE): not bare metal, which the paper puts within a few percent.
RADICAL_CYLON_WEAK_S: Dict[str, Tuple[float, float]] = {"join": (215.64, 253.66),
                                                        "sort": (192.74, 223.88)}
RADICAL_CYLON_SOURCE = "https://linnk.ai (a summary of arXiv 2403.15721)"


def _paper(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    tasks = [r for r in rows if r.get("kind") == "task"]
    execs = executors_in(tasks, run)
    body = []
    baseline = run.get("config", {}).get("baseline", "mpirun")
    for mode in ("weak", "strong"):
        cases = group([r for r in tasks if mode in (r.get("modes") or [])],
                       "executor", "op", "ranks", "rows_per_rank")
        for (executor, op, ranks, per_rank), grp in sorted(
                cases.items(), key=lambda kv: (execs.index(kv[0][0]), kv[0][1], kv[0][2])):
            versus = ("(baseline)" if executor == baseline else noise.compare(
                cases.get((baseline, op, ranks, per_rank), []), grp, "op_mean_s", noise.ratio))
            t = median(grp, "op_mean_s")
            rate = per_rank / t if t else None
            partition_mb = per_rank * 16 * (2 if op == "join" else 1) / 2**20
            peak = median(grp, "peak_rss_mb")
            paper = PAPER_SUMMIT.get((mode, op))
            quoted = RADICAL_CYLON_WEAK_S.get(op) if mode == "weak" else None
            body.append([mode, executor, op, ranks, f"{per_rank:,}", f"{per_rank * ranks:,}",
                         stat(grp, "op_mean_s"), versus, f"{rate / 1e6:.2f}" if rate else "–",
                         f"{paper / 1e6:.2f}" if paper else "not found",
                         (f"{35e6 / quoted[1] / 1e6:.2f}–{35e6 / quoted[0] / 1e6:.2f}"
                          if quoted else "–"), fmt(peak),
                         fmt(partition_mb), f"{peak / partition_mb:.2f}" if peak else "–",
                         stat(grp, "total_s"), len(grp)])
    lines = table(["Mode", "Executor", "Op", "Ranks", "Rows/rank", "Rows total", "Op time (s)",
                    f"vs {baseline}", "M rows/s/rank", "Paper, Summit bare metal (M rows/s/rank)",
                    "Radical-Cylon on Summit, quoted (M rows/s/rank)", "Peak RSS/rank (MiB)",
                    "Partition/rank (MiB)", "Peak / partition", "Task total (s)", "n"], body)
    run_times = [r for r in rows if r.get("kind") == "executor_time"]
    total = next((r["seconds"] for r in rows if r.get("kind") == "run_time"), None)
    if run_times or total:
        lines += ["Run time: " + ", ".join(f"{r['executor']} {fmt(r['seconds'])} s"
                                           for r in run_times)
                  + (f"; the whole experiment {fmt(total)} s." if total else "."), ""]
    lines += ["Rows/s/rank: rows per rank / op time (one iteration, mean over ranks). Peak RSS: "
              "the rank's peak resident set over the task (data generation included), the "
              "largest over ranks; partition: its input tables' bytes (two int64 columns, both "
              "tables for a join); ranks that outlive a task (radical's and the pool's) report "
              "their process's peak so far, so a sort after a join shows the join's. A strong "
              "case with as many rows per rank as a weak one is "
              "the same task, run once and listed under both. "
              + ("Paper: the bare-metal Cylon figures on Summit as read from the paper."
                 if PAPER_SUMMIT else
                 "Paper: the Summit bare-metal figures were not found in the sources this "
                 "project could search (the paper's tables were not among them); none are "
                 "quoted rather than guessed. ")
              + "Radical-Cylon on Summit: 35 M rows per rank over its weak-scaling times, "
              f"slowest–fastest over node counts (join {RADICAL_CYLON_WEAK_S['join'][0]}–"
              f"{RADICAL_CYLON_WEAK_S['join'][1]} s, sort {RADICAL_CYLON_WEAK_S['sort'][0]}–"
              f"{RADICAL_CYLON_WEAK_S['sort'][1]} s) as quoted by {RADICAL_CYLON_SOURCE}, not "
              "read from the paper itself; measured across Summit nodes, so they include "
              "network exchange this single node does not have.", ""]
    return lines, []




SECTIONS = {"weak": _scaling, "strong": _scaling, "overhead": _overhead, "pilot": _pilot,
            "peers": _peers, "analytics": analytics_report.section, "paper": _paper,
            "pipeline": report_pipeline.section}


# --------------------------------------------------------------------------- entry
def write_report(results: str, out_dir: Optional[str] = None, *, plots: bool = True) -> str:
    """Write ``report.md`` (and PNGs) next to ``results`` (or in ``out_dir``); its path."""
    rows = load_rows(results)
    runs = latest_runs(rows)
    if not runs:
        raise ValueError(f"{results}: no experiment runs in this file")
    out_dir = out_dir or os.path.dirname(os.path.abspath(results))
    if plots:
        try:
            import matplotlib  # noqa: F401 - only: is it installed?
        except ImportError:  # tables still come out; say why the plots did not
            plots = False
            note = "Plots: not drawn (matplotlib is not installed: pip install 'hetflow[report]')."
    note = "" if plots else locals().get("note", "Plots: not drawn (--no-plots).")
    os.makedirs(out_dir, exist_ok=True)
    first = next(r for r in rows if r.get("kind") == "run")
    host, versions = first.get("host", {}), first.get("versions", {})
    lines = ["# hetflow benchmark report: the Radical-Cylon experiments at this machine's scale", "",
             f"Generated from `{os.path.basename(results)}` alone "
             f"(regenerate: `hetflow bench report {os.path.basename(results)}`).", "",
             f"Host: {host.get('hostname')}, {host.get('cpus')} CPUs, {host.get('mem_gib')} GiB, "
             f"{host.get('platform')}, Python {host.get('python')}.", "",
             "Libraries: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", "",
             "Protocol of the join and sort experiments (the paper's): per rank two int64 columns "
             "(key, value), keys uniform in [0, 0.9 × total rows), seeded by the rank; each task "
             "runs `iterations` times `barrier; t0; op; barrier; t1` and reports the mean over "
             "ranks per iteration, plus a total covering set-up, data generation and all "
             "iterations. (The pipeline's is in its section.)", ""]
    if all(r.get("config", {}).get("kind") == "pipeline"
           for exp in runs.values() for r in exp if r.get("kind") == "run"):
        lines = lines[:-2]                      # a pipeline report: its own protocol alone
    lines += [noise.LEGEND, ""]
    if note:
        lines += [note, ""]
    commands = sorted({" ".join(r.get("argv") or []) for r in rows if r.get("kind") == "run"} - {""})
    if commands:
        lines += ["Produced by:", ""] + [f"    {c}" for c in commands] + [""]
    for name in sorted(runs, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        exp_rows = runs[name]
        run = next(r for r in exp_rows if r.get("kind") == "run")
        kind = run.get("config", {}).get("kind", name)
        lines += _header(run, exp_rows)
        section = SECTIONS.get(kind)
        if section is not None:
            body, pngs = section(run, exp_rows, out_dir if plots else None, name)
            lines += body
            lines += [f"![{name}]({png})" for png in pngs] + ([""] if pngs else [])
        lines += _sessions(exp_rows)
        lines += owncpu.lines(exp_rows, stat)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines).rstrip() + "\n")
    return path
