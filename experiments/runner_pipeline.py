"""The pipeline experiment's runs: features -> train -> evaluate, chained by futures, through
each runtime (``hetflow bench pipeline``; the chain itself is :mod:`hetflow.experiments.pipeline`)."""
from __future__ import annotations

import time
from typing import List

from hetflow.experiments.config import ExperimentConfig
from hetflow.experiments.recording import (TASK_TIMEOUT_S, Progress, Recorder, cores, executors_of,
                                           first_line, runtime_session)


#: Runtimes whose ranks outlive a task (what one task imports, the next finds imported).
PERSISTENT_RANKS = ("pool", "radical")


def pipeline_cases(cfg, executor: str) -> List[dict]:
    """The pipeline's runs on ``executor``: "keep" only on the pool, and on equal rank counts."""
    return [dict(repeat=repeat, rows_per_rank=rows, feature_ranks=ranks, mode=mode)
            for repeat in range(cfg.repeats) for rows in cfg.rows for ranks in cfg.ranks
            for mode in cfg.handoffs
            if mode == "table" or (executor == "pool" and ranks == cfg.train_ranks)]


def run_pipeline(cfg: ExperimentConfig, rec: Recorder, progress: Progress) -> None:
    """features -> train -> evaluate, chained by futures, through each runtime (one row a run)."""
    from hetflow.experiments.pipeline import run_chain

    for executor in executors_of(cfg):
        cases = pipeline_cases(cfg, executor)
        slots = max(max(cfg.ranks), cfg.train_ranks, cores())
        with runtime_session(cfg, executor, rec, slots) as session:
            if session is None:
                progress.step(f"{executor}: not run", n=len(cases), skipped=True)
                continue
            # A pilot's ranks pay torch's import and the first process group once; that
            # belongs to its start-up, not to the first measured run. A batch runtime's
            # tasks pay it every time, inside their stage times: no warm-up helps them.
            warmup_s = None
            if executor in PERSISTENT_RANKS:
                t0 = time.perf_counter()
                try:
                    run_chain(feature_ranks=max(cfg.ranks), train_ranks=cfg.train_ranks,
                              rows_per_rank=200, mode="table", epochs=1,
                              batch_size=cfg.batch_size, hidden=cfg.hidden,
                              timeout=TASK_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - recorded; the runs say the rest
                    rec.write(kind="error", experiment=cfg.name, executor=executor,
                              stage="warm-up", error=first_line(exc))
                warmup_s = time.perf_counter() - t0
            for case in cases:
                note = (f"{executor} {case['mode']} ranks={case['feature_ranks']}->"
                        f"{cfg.train_ranks} rows/rank={case['rows_per_rank']:,}")
                try:
                    result = run_chain(train_ranks=cfg.train_ranks, epochs=cfg.iterations,
                                       batch_size=cfg.batch_size, hidden=cfg.hidden,
                                       seed=case["repeat"], timeout=TASK_TIMEOUT_S,
                                       feature_ranks=case["feature_ranks"],
                                       rows_per_rank=case["rows_per_rank"], mode=case["mode"])
                except Exception as exc:  # noqa: BLE001 - one failed run is a result row
                    rec.write(kind="error", experiment=cfg.name, executor=executor,
                              stage=f"pipeline {case['mode']}", repeat=case["repeat"],
                              error=first_line(exc))
                    progress.step(note, error=True)
                    continue
                rec.write(kind="pipeline", experiment=cfg.name, executor=executor,
                          startup_s=session["startup_s"], warmup_s=warmup_s,
                          train_ranks=cfg.train_ranks,
                          ranks=case["feature_ranks"], rows_per_rank=case["rows_per_rank"],
                          repeat=case["repeat"], **result)
                progress.step(note)
