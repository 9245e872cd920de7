"""The pipeline experiment's report section (``hetflow bench pipeline``): where the command's
wall clock went, the stage times, the table's way to tensors, the loss curve.

Every number says what it covers beside it; a speed-up is quoted only on work large enough to
measure (:data:`MIN_QUOTED_MB`, :data:`MIN_QUOTED_S`), otherwise the sizes are said instead.
"""
from __future__ import annotations

from typing import List, Tuple

from hetflow.experiments.report_plots import plt_module, save
from hetflow.experiments.report_table import executors_in, fmt, group, median, stat, table

#: Below these (the table, and the faster of two timed paths), two paths' times differ by
#: less than this machine's noise between repeats: no speed-up is quoted.
MIN_QUOTED_MB = 1.0
MIN_QUOTED_S = 0.01


def protocol(cfg: dict) -> str:
    """What one run of this experiment does (its own protocol, not the join/sort one)."""
    return ("Protocol: each run submits three tasks chained by futures on a runtime already "
            "started: **features** (N ranks: synthetic events, `rows` per rank, each a user id "
            "and two measures, joined with a users table of events/4 users, grouped by user "
            "into one feature row per user that has events, plus a label), **train** "
            f"(`train_ranks` ranks: an MLP regression trained by DDP for `iterations` = "
            f"{cfg.get('iterations')} epochs over the feature rows, `hetflow.torch.batches` of "
            f"{cfg.get('batch_size', 64)}), **evaluate** (N ranks: the trained weights' mean "
            "squared error on the feature rows). The data are the same for a seed and N on "
            "every runtime (experiments/pipeline.py).")


def _flat(r: dict) -> dict:
    """A pipeline row's nested figures as flat fields (for ``stat``/``median``)."""
    out = dict(r)
    for stage, times in (r.get("stages") or {}).items():
        for key, value in (times or {}).items():
            out[f"{stage}_{key}"] = value
    for key, value in (r.get("train") or {}).items():
        out[f"train_{key}"] = value
    for key, value in (r.get("evaluation") or {}).items():
        out[f"eval_{key}"] = value
    losses = out.get("train_losses") or []
    out["final_loss"] = losses[-1] if losses else None
    if out.get("train_deeprc_s") and out.get("train_hetflow_s"):
        out["tensor_speedup"] = out["train_deeprc_s"] / out["train_hetflow_s"]
    return out


def wall_clock(rows: List[dict], runs: List[dict], execs: List[str]) -> List[str]:
    """The headline: the experiment's wall clock, and what of it each runtime took."""
    total = next((r.get("seconds") for r in rows if r.get("kind") == "run_time"), None)
    sessions = {r["executor"]: r for r in rows if r.get("kind") == "session"}
    body, accounted = [], 0.0
    for executor in execs:
        mine = [r for r in runs if r["executor"] == executor]
        session = sessions.get(executor)
        if not mine and session is None:
            continue
        start = (session or {}).get("startup_s") or 0.0
        stop = (session or {}).get("shutdown_s") or 0.0
        warm = median(mine, "warmup_s") or 0.0
        tasks = sum(r.get("makespan_s") or 0.0 for r in mine)
        accounted += start + warm + tasks + stop
        body.append([executor, fmt(start), fmt(warm) if warm else "–", len(mine), fmt(tasks),
                     fmt(stop), f"**{fmt(start + warm + tasks + stop)}**"])
    head = (f"**Wall clock: {fmt(total)} s** for this experiment" if total is not None
            else "**Wall clock** (not recorded in this results file)")
    rest = f" ({fmt(total - accounted)} s of it between and around the runtimes)" \
        if total is not None else ""
    lines = [head + rest + "; per runtime, every second of it (the command adds Python's "
             "start-up and the report):", ""]
    lines += table(["Executor", "Start-up (s)", "Warm-up (s)", "Runs", "Runs' tasks (s)",
                     "Shut-down (s)", "Total (s)"], body)
    lines += ["Start-up: the runtime's (an MPI world, a pilot; none to speak of for `mpirun`). "
              "Warm-up: on a runtime whose ranks outlive a task, one tiny run first, so torch's "
              "import and the first process group are paid once, as a long-lived runtime pays "
              "them; a batch runtime pays them in every task, inside its tasks' times. Runs' "
              "tasks: the sum of the runs' task times below.", ""]
    return lines


def _rows_text(grp: List[dict]) -> str:
    produced = sorted({r.get("rows_produced") for r in grp} - {None})
    received = sorted({r.get("train_rows_received") for r in grp} - {None})
    return (", ".join(f"{p:,}" for p in produced) + " / "
            + ", ".join(f"{p:,}" for p in received))


def section(run, rows, out_dir, stem) -> Tuple[List[str], List[str]]:
    """The pipeline section's lines and plots."""
    cfg = run.get("config", {})
    runs = [_flat(r) for r in rows if r.get("kind") == "pipeline"]
    execs = executors_in(runs, run)
    groups = sorted(group(runs, "executor", "mode", "ranks", "train_ranks").items(),
                    key=lambda kv: (execs.index(kv[0][0]), kv[0][1], kv[0][2]))
    lines = [protocol(cfg), ""] + wall_clock(rows, runs, execs)
    present = {r["executor"] for r in runs if r.get("mode") == "table"}
    batch = "slurm" if "slurm" in present else ("mpirun" if "mpirun" in present else None)
    base = median([r for r in runs if r["executor"] == batch and r["mode"] == "table"],
                  "makespan_s") if batch else None
    body = []
    for (executor, mode, ranks, train_ranks), grp in groups:
        mine = median(grp, "makespan_s")
        ratio = f"{mine / base:.2f}" if base and mine is not None else "–"
        body.append([executor, mode, f"{ranks} → {train_ranks} → {ranks}", stat(grp, "makespan_s"),
                     ratio, stat(grp, "features_function_s"), stat(grp, "handoff_s"),
                     stat(grp, "train_function_s"), stat(grp, "evaluate_function_s"),
                     _rows_text(grp), fmt(median(grp, "final_loss")), fmt(median(grp, "eval_r2")),
                     len(grp)])
    lines += ["Each run's tasks (seconds; median [min–max] over repeats):", ""]
    lines += table(["Executor", "Hand-off", "Ranks", "Tasks (s)", f"× {batch or 'batch'}",
                     "Features (s)", "Hand-off (s)", "Train (s)", "Evaluate (s)",
                     "Feature rows produced / received", "Final loss", "R²", "n"], body)
    events = [(r.get("rows_per_rank"), r.get("ranks")) for r in runs if r.get("rows_per_rank")]
    per_rank, ranks = events[0] if events else (None, None)
    lines += ["Tasks: from the first submit to the evaluation's result, the runtime already "
              "started (and warmed up): what a script pays per pipeline once its runtime is up. "
              f"× {batch or 'batch'}: those times against the batch runtime's with the table "
              "hand-off; at this size they compare per-task launch and imports, not compute. "
              "Stage columns: each task's function time; hand-off: from the features function "
              "returning to the training function starting (the table written and read back, "
              "or kept in the pool's memory, plus the launch). \"keep\": `hetflow.keep` on the "
              "pool's ranks; \"table\": the returned `DistributedTable` (Parquet files in the "
              "run's directory, or the pool's memory). R²: the evaluation task's.", ""]
    if per_rank and ranks:
        lines += [f"Feature rows: {per_rank:,} events per rank × {ranks} ranks = "
                  f"{per_rank * ranks:,} events over {per_rank * ranks // 4:,} users; grouping "
                  "by user leaves one row per user with at least one event (the rows produced), "
                  "every one of which the training task receives.", ""]
    lines += _tensors(groups)
    lines += ["Training loss per epoch (first repeat; the same seed and data on every runtime):", ""]
    for (executor, mode, ranks, train_ranks), grp in groups:
        first = min(grp, key=lambda r: r.get("repeat", 0))
        losses = ", ".join(fmt(v) for v in first.get("train_losses") or [])
        lines.append(f"- {executor} ({mode}, {ranks} → {train_ranks} ranks): {losses}")
    lines.append("")
    return lines, _plot(runs, execs, out_dir, stem)


def _tensors(groups) -> List[str]:
    """The table's way to tensors: Deep RC's copy path beside hetflow's batches."""
    body, small = [], []
    for (executor, mode, _ranks, _train), grp in groups:
        speed = median(grp, "tensor_speedup")
        mb = (median(grp, "train_partition_bytes") or 0) / 1e6
        fastest = min(median(grp, "train_deeprc_s") or 0, median(grp, "train_hetflow_s") or 0)
        quoted = speed and mb >= MIN_QUOTED_MB and fastest >= MIN_QUOTED_S
        if speed and not quoted:
            small.append((mb, fastest))
        body.append([executor, mode, fmt(mb or None), stat(grp, "train_deeprc_s"),
                     stat(grp, "train_hetflow_s"),
                     f"{speed:.2f}" if quoted else ("too small" if speed else "–"),
                     fmt((median(grp, "train_deeprc_copied_bytes") or 0) / 1e6 or None),
                     fmt(median(grp, "train_hetflow_copied_bytes") / 1e6
                         if median(grp, "train_hetflow_copied_bytes") is not None else None),
                     len(grp)])
    lines = ["The table's way to tensors, side by side in the training task on the same "
             "partitions (rank 0's times, the median of 3 alternations of the two paths, each "
             "between barriers; then the median over repeats). **Deep RC path**: how Deep RC "
             "(arXiv 2502.20724, the same pipeline shape on RADICAL-Pilot) hands an Arrow "
             "partition to PyTorch: `to_pandas` → `to_numpy` → `astype(float32)` → "
             "`torch.from_numpy`, a pandas frame and two arrays on the way; **hetflow batches**: "
             "`hetflow.torch.batches` (one pass over its batches: one copy stacking the feature "
             "columns, the label by DLPack).", ""]
    lines += table(["Executor", "Hand-off", "Table (MB, all ranks)", "Deep RC path (s)",
                     "hetflow batches (s)", "Speed-up", "Deep RC copied (MB)",
                     "hetflow copied (MB)", "n"], body)
    if small:
        mb, s = max(small)
        lines += [f"Speed-up: not quoted under {MIN_QUOTED_MB:g} MB of table or "
                  f"{MIN_QUOTED_S * 1000:g} ms for the faster path (here {fmt(mb)} MB and "
                  f"{fmt(s * 1000)} ms): at that size the difference is within the noise between "
                  "repeats. The copied bytes are exact at any size.", ""]
    lines += ["Copied bytes: Deep RC's are the pandas frame, the stacked array and its cast, for "
              "features and label; hetflow's are what `batches` reports (`copied_bytes`: the one "
              "stacking copy of the feature columns; the label column reaches torch without one).",
              ""]
    return lines


def _plot(runs, execs, out_dir, stem) -> List[str]:
    if out_dir is None or not runs:
        return []
    plt = plt_module()
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(10, 4))
    order = sorted(group(runs, "executor", "mode").items(),
                   key=lambda kv: (execs.index(kv[0][0]), kv[0][1]))
    for (executor, mode), grp in order:
        first = min(grp, key=lambda r: r.get("repeat", 0))
        losses = first.get("train_losses") or []
        curve.plot(range(1, len(losses) + 1), losses, marker="o", label=f"{executor} ({mode})")
    curve.set_xlabel("epoch")
    curve.set_ylabel("training loss (MSE, mean over ranks)")
    curve.set_yscale("log")
    curve.set_title("loss curve (first repeat; equal curves overlap)")
    from matplotlib.ticker import MaxNLocator

    curve.xaxis.set_major_locator(MaxNLocator(integer=True))
    curve.legend(fontsize=8)
    names, parts = [], {"features": [], "hand-off": [], "train": [], "evaluate": []}
    for (executor, mode), grp in order:
        names.append(f"{executor}\n{mode}")
        parts["features"].append(median(grp, "features_function_s") or 0.0)
        parts["hand-off"].append(median(grp, "handoff_s") or 0.0)
        parts["train"].append(median(grp, "train_function_s") or 0.0)
        parts["evaluate"].append(median(grp, "evaluate_function_s") or 0.0)
    bottom = [0.0] * len(names)
    for label, values in parts.items():
        bars.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    bars.set_ylabel("seconds (median)")
    bars.set_title("per-stage times (the tasks of one run)")
    bars.legend(fontsize=8)
    bars.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return [save(fig, plt, out_dir, f"{stem}.png")]
