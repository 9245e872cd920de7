"""The report's plots (matplotlib, the ``report`` extra): one PNG per section, each
point a median with its min-max spread."""
from __future__ import annotations

import os
import statistics
from typing import List, Tuple

from hetflow.experiments.report_table import group, median, values


def plt_module():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spread(rows, field) -> Tuple[float, float, float]:
    vals = values(rows, field)
    med = statistics.median(vals)
    return med, med - min(vals), max(vals) - med


def plot_scaling(tasks, execs, out_dir, stem, strong) -> List[str]:
    if out_dir is None or not tasks:
        return []
    plt = plt_module()
    ops = sorted({r["op"] for r in tasks})
    fig, axes = plt.subplots(2, len(ops), figsize=(5 * len(ops), 7), squeeze=False)
    for col, op in enumerate(ops):
        for row, (field, label) in enumerate((("op_mean_s", "op time per iteration (s)"),
                                              ("total_s", "task total (s)"))):
            ax = axes[row][col]
            for executor in execs:
                pts = group([r for r in tasks if r["executor"] == executor and r["op"] == op
                              and values([r], field)], "ranks")
                if not pts:
                    continue
                xs = sorted(pts)
                stats = [spread(pts[x], field) for x in xs]
                ax.errorbar([x[0] for x in xs], [s[0] for s in stats],
                            yerr=[[s[1] for s in stats], [s[2] for s in stats]], marker="o",
                            capsize=3, label=executor)
            over = sorted({r["ranks"] for r in tasks if r.get("oversubscribed")})
            for x in over:
                ax.axvspan(x - 0.3, x + 0.3, color="0.9", zorder=0)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["ranks"] for r in tasks})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("ranks" + (" (shaded: oversubscribed)" if over else ""))
            ax.set_ylabel(label)
            ax.set_title(f"{'strong' if strong else 'weak'} scaling: {op}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return [save(fig, plt, out_dir, f"{stem}.png")]


def plot_overhead(tasks, execs, out_dir, stem) -> List[str]:
    if out_dir is None or not tasks:
        return []
    sizes = sorted({(r["op"], r["rows_per_rank"], r["ranks"]) for r in tasks})

    def draw(ax, key):
        op, per_rank, ranks = key
        names, setup, work, ov = [], [], [], []
        for executor in execs:
            grp = [r for r in tasks if r["executor"] == executor and r["op"] == op
                   and r["rows_per_rank"] == per_rank and r["ranks"] == ranks]
            if grp and values(grp, "function_s") and values(grp, "overhead_s"):
                names.append(executor)
                fn = median(grp, "function_s")
                setup.append(min(fn, median(grp, "setup_s") or 0.0))
                work.append(fn - setup[-1])
                ov.append(median(grp, "overhead_s"))
        ax.bar(names, work, label="function: data + op")
        ax.bar(names, setup, bottom=work, label="function: engine set-up")
        ax.bar(names, ov, bottom=[a + b for a, b in zip(work, setup)], label="runtime overhead")
        ax.set_title(f"{op}, {ranks} ranks × {per_rank:,} rows")
        ax.set_ylabel("seconds (median)")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    return panels(sizes, 4.5, draw, out_dir, stem)


def plot_pilot(spans, execs, out_dir, stem) -> List[str]:
    if out_dir is None or not spans:
        return []
    scenarios = [s for s in ("pair", "campaign") if any(r["scenario"] == s for r in spans)]

    def draw(ax, scenario):
        names, meds, lo, hi, start, queue = [], [], [], [], [], []
        for executor in execs:
            grp = [r for r in spans if r["scenario"] == scenario and r["executor"] == executor]
            if grp:
                m, a, b = spread(grp, "makespan_s")
                names.append(executor)
                meds.append(m), lo.append(a), hi.append(b)
                start.append(median(grp, "startup_s") or 0.0)
                queue.append(min(m, median(grp, "queue_mean_s") or 0.0))
        ax.bar(names, meds, yerr=[lo, hi], capsize=3, label="makespan")
        if any(queue):      # (results from before the queue wait was recorded have none)
            ax.bar(names, queue, fill=False, hatch="//", edgecolor="0.2",
                   label="of which: queue wait per task (mean)")
        ax.bar(names, start, bottom=meds, alpha=0.35, label="runtime start-up (once)")
        ax.set_title(f"pilot vs batch: {scenario}")
        ax.set_ylabel("seconds (median, min–max)")
        ax.legend(fontsize=8)
    return panels(scenarios, 5, draw, out_dir, stem)


def plot_peers(tasks, execs, out_dir, stem, hetflow_execs) -> List[str]:
    if out_dir is None or not tasks:
        return []
    keys = sorted({(r["op"], r["rows"]) for r in tasks})

    def draw(ax, key):
        op, rows_n = key
        names, meds = [], []
        for (executor, ranks), grp in sorted(
                group([r for r in tasks if r["op"] == op and r["rows"] == rows_n],
                       "executor", "ranks").items(),
                key=lambda kv: (execs.index(kv[0][0]), kv[0][1])):
            if values(grp, "op_mean_s"):
                names.append(f"{executor}\n{ranks} rank(s)" if executor in hetflow_execs else executor)
                meds.append(median(grp, "op_mean_s"))
        ax.bar(names, meds, color=["C0" if "rank" in n else "C1" for n in names])
        ax.set_title(f"{op}, {rows_n:,} rows per table")
        ax.set_ylabel("op time (s, median)")
        ax.tick_params(axis="x", labelsize=8)
    return panels(keys, 4.5, draw, out_dir, stem)


def panels(keys, width: float, draw, out_dir, stem) -> List[str]:
    """One row of ``width``-inch panels, ``draw(ax, key)`` filling each; the PNG's name."""
    plt = plt_module()
    fig, axes = plt.subplots(1, len(keys), figsize=(width * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        draw(ax, key)
    fig.tight_layout()
    return [save(fig, plt, out_dir, f"{stem}.png")]


def save(fig, plt, out_dir, name) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return name
