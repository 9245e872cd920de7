"""Run one experiment and append its measurements to a JSON Lines results file.

Row kinds (field ``kind``): ``run`` (the command, config and scale of one
invocation), ``session`` (a runtime's start-up and shut-down), ``task`` (one
MPI task or peer run under the paper's protocol), ``makespan`` (a set of tasks
submitted together), ``skipped`` (a runtime not installed) and ``error`` (a
runtime or task that failed: the message, so the report can say what broke).
Every row carries the experiment, executor, repeat, host and library versions.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from hetflow.experiments import owncpu, protocol
from hetflow.experiments.config import ExperimentConfig
from hetflow.experiments.recording import (BARE, TASK_TIMEOUT_S, Progress, Recorder, cores,
                                           executors_of, runtime_session)
from hetflow.experiments.runner_pipeline import pipeline_cases, run_pipeline
from hetflow.experiments.recording import first_line as _first_line



# --------------------------------------------------------------------------- tasks
def _app(ranks: int):
    import hetflow

    return hetflow.mpi_app(protocol.cylon_task, ranks=ranks)


def _task_row(cfg, executor, future, *, repeat, ranks, rows_per_rank, op, cores, **extra) -> dict:
    """Fields of one finished task: its report plus the runtime's timestamps."""
    import hetflow

    report = future.result(timeout=0)
    times = hetflow.task_times(future)
    row = {**report, **dict(kind="task", experiment=cfg.name, executor=executor, op=op,
                            ranks=ranks, rows_per_rank=rows_per_rank, rows=rows_per_rank * ranks,
                            oversubscribed=ranks > cores, repeat=repeat, **extra)}
    if times is not None:
        row.update(total_s=times.delivered - times.submitted, function_s=times.function_s,
                   overhead_s=times.overhead_s, queue_s=times.launched - times.submitted,
                   launch_s=times.started - times.launched,
                   return_s=times.delivered - times.finished)
    return row


def _run_one(cfg, rec, progress, executor, *, repeat, ranks, rows_per_rank, op, cores,
             iterations=None, dump_dir=None, **extra) -> Optional[dict]:
    """Submit one task, wait for it, record it (or its error). The row, or None on error."""
    note = f"{executor} ranks={ranks} {op} rows/rank={rows_per_rank:,}"
    try:
        with owncpu.task_window() as own_cpu:
            future = own_cpu["future"] = _app(ranks)(op, rows_per_rank,
                                                     iterations or cfg.iterations, cfg.unique,
                                                     dump_dir=dump_dir)
            future.result(timeout=TASK_TIMEOUT_S)
        row = rec.write(**_task_row(cfg, executor, future, repeat=repeat, ranks=ranks,
                                    rows_per_rank=rows_per_rank, op=op, cores=cores, **extra,
                                    **own_cpu))
    except Exception as exc:  # noqa: BLE001 - one failed task must not end the experiment
        rec.write(kind="error", experiment=cfg.name, executor=executor, stage="task", op=op,
                  ranks=ranks, rows_per_rank=rows_per_rank, repeat=repeat, error=_first_line(exc))
        progress.step(note, error=True)
        return None
    progress.step(note)
    return row


# --------------------------------------------------------------------------- experiments
def _run_cases(cfg, rec, progress, executor: str, cases: List[dict]) -> None:
    """Run each case (``_run_one`` keywords) in one session of ``executor``, or mark them not run."""
    with runtime_session(cfg, executor, rec, max(max(cfg.ranks), cores())) as session:
        if session is None:
            progress.step(f"{executor}: not run", n=len(cases), skipped=True)
            return
        for case in cases:
            _run_one(cfg, rec, progress, executor, cores=cores(), **case)


def run_scaling(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """Weak (rows per rank fixed) or strong (total fixed) scaling over ``cfg.ranks``."""
    cases = [dict(repeat=repeat, ranks=ranks, op=op,
                  rows_per_rank=rows if cfg.rows_mode == "per_rank" else rows // ranks)
             for repeat in range(cfg.repeats) for rows in cfg.rows for ranks in cfg.ranks
             for op in cfg.ops]
    for executor in executors_of(cfg):
        _run_cases(cfg, rec, progress, executor, cases)


def _scaling_tasks(cfg) -> int:
    return cfg.repeats * len(cfg.rows) * len(cfg.ranks) * len(cfg.ops)


def run_overhead(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """The same task, one at a time, through bare mpiexec and each runtime; TaskTimes split it."""
    cases = [dict(repeat=repeat, ranks=ranks, rows_per_rank=rows, op=op, task=i)
             for repeat in range(cfg.repeats) for rows in cfg.rows for ranks in cfg.ranks
             for op in cfg.ops for i in range(cfg.tasks)]
    for executor in cfg.executors:
        if executor == BARE:
            _bare_overhead(cfg, rec, progress)
        else:
            _run_cases(cfg, rec, progress, executor, cases)


def _overhead_tasks(cfg) -> int:
    return cfg.repeats * len(cfg.rows) * len(cfg.ranks) * len(cfg.ops) * cfg.tasks


def _bare_overhead(cfg, rec, progress) -> None:
    from hetflow.executors.launch import default_mpiexec, launcher_env, mpiexec_command

    mpiexec = default_mpiexec()
    env = launcher_env(mpiexec)
    for repeat in range(cfg.repeats):
        for rows in cfg.rows:
            for ranks in cfg.ranks:
                for op in cfg.ops:
                    for i in range(cfg.tasks):
                        args = {"op": op, "rows_per_rank": rows, "iterations": cfg.iterations,
                                "unique": cfg.unique}
                        cmd = mpiexec_command(mpiexec, ranks)[:-2] + [
                            "-m", "hetflow.experiments.protocol", json.dumps(args)]
                        note = f"{BARE} ranks={ranks} {op} rows/rank={rows:,}"
                        try:
                            report, wall = _subprocess_report(cmd, env)
                        except Exception as exc:  # noqa: BLE001 - one failed run is a result row, not the end
                            rec.write(kind="error", experiment=cfg.name, executor=BARE,
                                      stage="task", op=op, ranks=ranks, rows_per_rank=rows,
                                      repeat=repeat, error=_first_line(exc))
                            progress.step(note, error=True)
                            continue
                        submitted, delivered = wall
                        function_s = report["finished"] - report["started"]
                        rec.write(**{**report, **dict(
                                  kind="task", experiment=cfg.name, executor=BARE, op=op,
                                  ranks=ranks, rows_per_rank=rows, rows=rows * ranks,
                                  oversubscribed=ranks > cores(), repeat=repeat, task=i)},
                                  total_s=delivered - submitted, function_s=function_s,
                                  overhead_s=(delivered - submitted) - function_s,
                                  launch_s=report["started"] - submitted,
                                  return_s=delivered - report["finished"], queue_s=0.0)
                        progress.step(note)


def _subprocess_report(cmd: List[str], env: dict, timeout: float = TASK_TIMEOUT_S):
    """Run ``cmd``; its ``HETFLOW_BENCH {json}`` line and the (start, end) wall-clock stamps."""
    submitted = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    delivered = time.time()
    for line in proc.stdout.splitlines():
        if line.startswith("HETFLOW_BENCH "):
            if proc.returncode != 0:
                break
            return json.loads(line[len("HETFLOW_BENCH "):]), (submitted, delivered)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{' '.join(cmd[:3])}... exited {proc.returncode}: {' | '.join(tail)}")


def run_pilot(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """Pilot vs batch: the join+sort pair and a K-task campaign, submitted together; makespan."""
    pair = [("join", 2, cfg.rows[-1]), ("sort", 2, cfg.rows[-1])]
    campaign = [(cfg.ops[i % len(cfg.ops)], cfg.ranks[i % len(cfg.ranks)],
                 cfg.rows[(i // len(cfg.ops)) % len(cfg.rows)]) for i in range(cfg.tasks)]
    pair = [(op, min(r, cores()), rows) for op, r, rows in pair]
    for executor in executors_of(cfg):
        with runtime_session(cfg, executor, rec, cores()) as session:
            if session is None:
                progress.step(f"{executor}: not run", n=_pilot_tasks(cfg), skipped=True)
                continue
            startup_s = session["startup_s"]
            if "slurm" in session["options"]:
                try:
                    startup_s += _first_task_s(cfg)
                except Exception as exc:  # noqa: BLE001 - recorded; its makespans say the rest
                    rec.write(kind="error", experiment=cfg.name, executor=executor,
                              stage="first task", error=_first_line(exc))
            for repeat in range(cfg.repeats):
                for scenario, tasks in (("pair", pair), ("campaign", campaign)):
                    _makespan(cfg, rec, progress, executor, scenario, tasks, repeat, startup_s)


def _first_task_s(cfg) -> float:
    """Seconds one tiny task takes on a runtime just started.

    A pilot started by the batch system (``slurm=``) may be up before its job is: Parsl
    submits its block and returns at once. Its queue wait and first launch belong to
    its start-up, paid once, not to the first scenario's makespan.
    """
    t0 = time.perf_counter()
    _app(1)("sort", 1_000, 1, cfg.unique).result(timeout=TASK_TIMEOUT_S)
    return time.perf_counter() - t0


def _pilot_tasks(cfg) -> int:
    return cfg.repeats * (2 + cfg.tasks)


def _makespan(cfg, rec, progress, executor, scenario, tasks, repeat, startup_s) -> None:
    note = f"{executor} {scenario} ({len(tasks)} tasks)"
    t0 = time.perf_counter()
    try:
        futures = [_app(ranks)(op, rows, cfg.iterations, cfg.unique) for op, ranks, rows in tasks]
        for f in futures:
            f.result(timeout=TASK_TIMEOUT_S)
        makespan = time.perf_counter() - t0
        rows = [_task_row(cfg, executor, f, repeat=repeat, ranks=ranks, rows_per_rank=per_rank,
                          op=op, cores=cores(), scenario=scenario)
                for f, (op, ranks, per_rank) in zip(futures, tasks)]
    except Exception as exc:  # noqa: BLE001 - one failed run is a result row, not the end
        rec.write(kind="error", experiment=cfg.name, executor=executor, stage=scenario,
                  repeat=repeat, error=_first_line(exc))
        progress.step(note, n=len(tasks), error=True)
        return
    for row in rows:
        rec.write(**row)
    rec.write(kind="makespan", experiment=cfg.name, executor=executor, scenario=scenario,
              repeat=repeat, tasks=len(tasks), makespan_s=makespan, startup_s=startup_s,
              tasks_spec=[list(t) for t in tasks],
              function_sum_s=sum(r.get("function_s", 0.0) for r in rows),
              # Waiting for CPUs: in Slurm's queue (each batch job) or in the pilot's.
              queue_mean_s=sum(r.get("queue_s", 0.0) for r in rows) / len(rows),
              queue_max_s=max(r.get("queue_s", 0.0) for r in rows),
              launch_return_sum_s=sum(r.get("launch_s", 0.0) + r.get("return_s", 0.0)
                                      for r in rows))
    progress.step(note, n=len(tasks))


def run_peers(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """hetflow at each rank count, then pyarrow/polars/duckdb alone on the same generated data."""
    root = tempfile.mkdtemp(prefix="hetflow-peers-")
    dump_ranks = max(cfg.ranks)
    try:
        dumps = {}
        for executor in executors_of(cfg):
            with runtime_session(cfg, executor, rec, max(dump_ranks, cores())) as session:
                if session is None:
                    progress.step(f"{executor}: not run",
                                  n=cfg.repeats * len(cfg.rows) * len(cfg.ranks) * len(cfg.ops),
                                  skipped=True)
                    continue
                for repeat in range(cfg.repeats):
                    for rows in cfg.rows:
                        for ranks in cfg.ranks:
                            for op in cfg.ops:
                                dump = None
                                if ranks == dump_ranks and (rows, op) not in dumps:
                                    dump = os.path.join(root, f"{rows}-{op}")
                                row = _run_one(cfg, rec, progress, executor, repeat=repeat,
                                               ranks=ranks, rows_per_rank=rows // ranks, op=op,
                                               cores=cores(), dump_dir=dump)
                                if dump and row is not None:
                                    dumps[(rows, op)] = dump
        for repeat in range(cfg.repeats):
            for rows in cfg.rows:
                for op in cfg.ops:
                    for engine in cfg.peers:
                        note = f"{engine} {op} rows={rows:,}"
                        if (rows, op) not in dumps:
                            progress.step(note + ": no data", error=True)
                            continue
                        args = {"engine": engine, "op": op, "data": dumps[(rows, op)],
                                "iterations": cfg.iterations}
                        try:
                            report, _ = _subprocess_report(
                                [sys.executable, "-m", "hetflow.experiments.peers", json.dumps(args)],
                                dict(os.environ))
                        except Exception as exc:  # noqa: BLE001 - one failed peer is a result row, not the end
                            rec.write(kind="error", experiment=cfg.name, executor=engine,
                                      stage="task", op=op, rows=rows, repeat=repeat,
                                      error=_first_line(exc))
                            progress.step(note, error=True)
                            continue
                        report.pop("engine", None)
                        report["rows"] = rows  # the configured total (the data has rows x 1)
                        rec.write(**{**report, **dict(
                            kind="task", experiment=cfg.name, executor=engine, ranks=1,
                            rows_per_rank=rows, oversubscribed=False, repeat=repeat,
                            data_from_ranks=dump_ranks)})
                        progress.step(note)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_analytics(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """The analytics queries in hetflow (one MPI task per size and rank count, through each
    runtime) and in each peer limited to as many threads; every result checked against the
    first peer's (see :mod:`hetflow.experiments.analytics`)."""
    import hetflow
    from hetflow.experiments import analytics

    for rows in cfg.rows:
        for ranks in cfg.ranks:
            root = tempfile.mkdtemp(prefix="hetflow-analytics-")
            try:
                records = {}
                for executor in executors_of(cfg):
                    with runtime_session(cfg, executor, rec, max(ranks, cores())) as session:
                        note = f"{executor} ranks={ranks} rows={rows:,}"
                        if session is None:
                            progress.step(note + ": not run", skipped=True)
                            continue
                        try:
                            app = hetflow.mpi_app(analytics.hetflow_task, ranks=ranks)
                            future = app(rows, cfg.repeats, root, list(cfg.queries), executor)
                            records[executor] = future.result(timeout=TASK_TIMEOUT_S)
                        except Exception as exc:  # noqa: BLE001 - recorded; the peers still run
                            rec.write(kind="error", experiment=cfg.name, executor=executor,
                                      stage="task", ranks=ranks, rows=rows, error=_first_line(exc))
                            progress.step(note, error=True)
                            continue
                        progress.step(note)
                for engine in cfg.peers:
                    args = {"engine": engine, "rows": rows, "repeats": cfg.repeats,
                            "out_dir": root, "threads": ranks, "queries": list(cfg.queries)}
                    note = f"{engine} threads={ranks} rows={rows:,}"
                    try:
                        records[engine], _ = _subprocess_report(
                            [sys.executable, "-m", "hetflow.experiments.analytics",
                             json.dumps(args)], analytics.peer_environment(ranks))
                    except Exception as exc:  # noqa: BLE001 - one failed peer is a result row
                        rec.write(kind="error", experiment=cfg.name, executor=engine,
                                  stage="task", ranks=ranks, rows=rows, error=_first_line(exc))
                        progress.step(note, error=True)
                        continue
                    progress.step(note)
                reference = next((p for p in cfg.peers if p in records), None)
                checks = analytics.check(records, root, reference) if reference else {}
                for engine, recs in records.items():
                    hetflow_run = engine not in cfg.peers
                    for name, record in recs.items():
                        mismatch = checks.get(engine, {}).get(name, "not checked")
                        for row in analytics.repeat_rows(record):   # one row per run
                            rec.write(**{**row, **dict(
                                kind="task", experiment=cfg.name, executor=engine, op=name,
                                ranks=ranks if hetflow_run else 1,
                                threads=None if hetflow_run else ranks, rows=rows,
                                repeats=cfg.repeats, reference=reference,
                                equal=mismatch is None, mismatch=mismatch)})
            finally:
                shutil.rmtree(root, ignore_errors=True)


def _paper_cases(cfg) -> List[dict]:
    """The weak cases (``rows`` per rank) and the strong ones (``strong_rows`` in total) over
    ``cfg.ranks``; a strong case of the same rows per rank as a weak one is run once, for both."""
    cases, seen = [], {}
    for mode, sizes in (("weak", cfg.rows), ("strong", cfg.strong_rows)):
        for size in sizes:
            for ranks in cfg.ranks:
                per_rank = size if mode == "weak" else size // ranks
                for op in cfg.ops:
                    if (ranks, per_rank, op) in seen:
                        seen[(ranks, per_rank, op)]["modes"].append(mode)
                        continue
                    case = dict(ranks=ranks, rows_per_rank=per_rank, op=op, modes=[mode])
                    seen[(ranks, per_rank, op)] = case
                    cases.append(case)
    return cases


def run_paper(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """The paper's weak and strong experiments at its per-rank scale, through each runtime in
    turn (one at a time: one runtime's ranks hold the machine's memory at once), each repeat
    through every runtime before the next (interleaved: a busy spell of the machine does not
    land on one runtime's repeats alone), each in a fresh runtime."""
    spent: Dict[str, float] = {}
    for repeat in range(cfg.repeats):
        cases = [dict(repeat=repeat, ranks=c["ranks"], rows_per_rank=c["rows_per_rank"],
                      op=c["op"], modes=list(c["modes"])) for c in _paper_cases(cfg)]
        for executor in executors_of(cfg):
            t0 = time.perf_counter()
            _run_cases(cfg, rec, progress, executor, cases)
            spent[executor] = spent.get(executor, 0.0) + time.perf_counter() - t0
    for executor, seconds in spent.items():
        rec.write(kind="executor_time", experiment=cfg.name, executor=executor, seconds=seconds)


RUNNERS: dict = {"weak": run_scaling, "strong": run_scaling, "overhead": run_overhead,
                 "pilot": run_pilot, "peers": run_peers, "analytics": run_analytics,
                 "paper": run_paper, "pipeline": run_pipeline}


def planned_steps(cfg: ExperimentConfig) -> int:
    """Progress steps an experiment will take (tasks and peer runs)."""
    n_exec = len(executors_of(cfg))
    if cfg.kind in ("weak", "strong"):
        return n_exec * _scaling_tasks(cfg)
    if cfg.kind == "overhead":
        return len(cfg.executors) * _overhead_tasks(cfg)
    if cfg.kind == "pilot":
        return n_exec * _pilot_tasks(cfg)
    if cfg.kind == "analytics":
        return len(cfg.rows) * len(cfg.ranks) * (n_exec + len(cfg.peers))
    if cfg.kind == "paper":
        return n_exec * cfg.repeats * len(_paper_cases(cfg))
    if cfg.kind == "pipeline":
        return sum(len(pipeline_cases(cfg, e)) for e in executors_of(cfg))
    per = cfg.repeats * len(cfg.rows) * len(cfg.ops)
    return n_exec * per * len(cfg.ranks) + per * len(cfg.peers)


def run_experiment(cfg: ExperimentConfig, rec: Recorder, *, argv: Optional[list] = None,
                   stream=None) -> None:
    """Run ``cfg`` end to end, appending its rows (the ``run`` row first) to ``rec``."""
    rec.write(kind="run", experiment=cfg.name, config=cfg.as_dict(), argv=list(argv or []),
              cores=cores())
    progress = Progress(cfg.name, planned_steps(cfg), stream=stream)
    t0 = time.perf_counter()
    try:
        RUNNERS[cfg.kind](cfg, rec, progress)
    finally:
        progress.close()
        rec.write(kind="run_time", experiment=cfg.name, seconds=time.perf_counter() - t0)
