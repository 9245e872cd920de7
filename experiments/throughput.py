"""Throughput: tasks/s against tasks queued at once, on the pool and beside it.

``hetflow bench throughput`` submits N no-op tasks at once (N from ``queued``: 1k-100k),
waits for all, and records tasks/s, the tasks lost (failed or never delivered) and the
client's RSS before and after, for each runtime, rank count and slot count, the runtimes
interleaved in each repeat (the machine's load drifts; a ratio means something only
between runs side by side):

- ``pool``: hetflow's pool, ``ranks``-rank no-op MPI tasks through ``hetflow.mpi_app``;
- ``mpirun``: the same tasks, one ``mpiexec`` per task (capped by ``task_limits``: ~10/s);
- ``threads``: Parsl's ThreadPoolExecutor, a no-op ``python_app``: Parsl's own cost per task
  (its DataFlowKernel), what is left of hetflow's when it is subtracted;
- ``htex``: Parsl's HighThroughputExecutor (non-MPI), a no-op ``python_app``.

``threads`` and ``htex`` run no MPI: ``threads`` runs beside the pool in every case (its
``ranks`` only says which pool case it ran beside), ``htex`` in the 1-rank cases. ``window`` > 0 keeps
at most that many tasks queued (a steady stream: the client's memory must stay flat);
``hetflow bench soak`` is the 100,000-task run. The module registers its runner and report
section with :mod:`~hetflow.experiments.runner` and :mod:`~hetflow.experiments.report`
(``cli`` imports it).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import List

import hetflow
from hetflow.experiments import report, report_plots, report_table, runner

#: Runtimes that run no MPI (Parsl's own executors): measured at 1 rank only.
NON_MPI = ("threads", "htex")


@hetflow.mpi_app(ranks=1)
def noop(comm):
    return None


def _python_noop():
    return None


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


@contextlib.contextmanager
def _parsl(name: str, slots: int):
    """A Parsl DataFlowKernel around Parsl's own executor ``name``; yields the app."""
    import parsl
    from parsl.config import Config

    run_dir = tempfile.mkdtemp(prefix=f"hetflow-throughput-{name}-")
    if name == "threads":
        from parsl.executors import ThreadPoolExecutor

        executor = ThreadPoolExecutor(label=name, max_threads=slots)
    else:
        from parsl.executors import HighThroughputExecutor
        from parsl.providers import LocalProvider

        from hetflow.executors.parsl_htex import _parsl_commands

        executor = HighThroughputExecutor(label=name, max_workers_per_node=slots,
                                          address="127.0.0.1", loopback_address="127.0.0.1",
                                          provider=LocalProvider(init_blocks=1, max_blocks=1),
                                          **_parsl_commands())
        # Parsl finds interchange.py on PATH, which misses a venv's when it is not activated.
        executor.interchange_launch_cmd = [sys.executable, "-m",
                                           "parsl.executors.high_throughput.interchange"]
    dfk = parsl.load(Config(executors=[executor], run_dir=run_dir, strategy="none",
                            initialize_logging=False))
    try:
        yield parsl.python_app(_python_noop, executors=[name], data_flow_kernel=dfk)
    finally:
        dfk.cleanup()
        parsl.clear()
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def session(name: str, ranks: int, slots: int):
    """Runtime ``name`` started for ``slots``; yields a function submitting one no-op task."""
    if name in NON_MPI:
        with _parsl(name, slots) as app:
            yield app
        return
    run_dir = tempfile.mkdtemp(prefix=f"hetflow-throughput-{name}-")
    try:
        with hetflow.runtime(name, max_ranks=slots, output="off", run_dir=run_dir,
                             progress=False):
            yield noop.options(ranks=ranks)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(submit, n: int, window: int = 0) -> dict:
    """Submit ``n`` tasks (all at once, or keeping at most ``window`` queued) and wait for
    all: tasks/s, tasks lost, the client's RSS (MiB) at start and end. No future is kept
    once delivered (a callback counts it), so what the client keeps is its own."""
    submit().result()                      # warm: imports on the ranks or workers
    done = threading.Semaphore(0)
    lost = [0]
    errors: List[str] = []          # the first few failures, as the report names them

    def delivered(future):
        error = future.exception()
        if error is not None:
            lost[0] += 1
            if len(errors) < 3:
                errors.append(runner._first_line(error))
        done.release()

    rss_start = rss_mib()
    t0 = time.perf_counter()
    queued = 0
    for _ in range(n):
        if window and queued >= window:
            done.acquire()
            queued -= 1
        submit().add_done_callback(delivered)
        queued += 1
    submit_s = time.perf_counter() - t0
    for _ in range(queued):
        if not done.acquire(timeout=runner.TASK_TIMEOUT_S):
            break                          # what never came back is counted as lost below
        queued -= 1
    seconds = time.perf_counter() - t0
    return {"tasks_per_s": n / seconds, "seconds": seconds, "submit_s": submit_s,
            "lost": lost[0] + queued, "errors": errors, "rss_start_mib": rss_start,
            "rss_end_mib": rss_mib()}


def _cases(cfg) -> List[tuple]:
    """``(tasks, slots, ranks, runtimes)``; a runtime capped by ``task_limits`` below the
    smallest count runs once, at its cap (mpirun: one mpiexec per task)."""
    limits = dict(cfg.task_limits)
    cases = []
    for slots in cfg.slots:
        for ranks in cfg.ranks:
            if ranks > slots:
                continue
            for n in sorted(cfg.queued):
                names = [e for e in cfg.executors if n <= limits.get(e, n)
                         and (ranks == 1 or e != "htex")]
                if names:
                    cases.append((n, slots, ranks, names))
            capped = sorted({limits[e] for e in cfg.executors if e in limits
                             and limits[e] < min(cfg.queued)})
            for n in capped:
                names = [e for e in cfg.executors if limits.get(e) == n
                         and (ranks == 1 or e != "htex")]
                cases += [(n, slots, ranks, names)] if names else []
    return cases


def run_throughput(cfg, rec, progress) -> None:
    """Each repeat runs every case, the runtimes of a case in rotated order."""
    for repeat in range(cfg.repeats):
        for n, slots, ranks, names in _cases(cfg):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                row = dict(kind="throughput", experiment=cfg.name, executor=name, queued=n,
                           slots=slots, ranks=ranks, repeat=repeat, window=cfg.window)
                try:
                    with session(name, ranks, slots) as submit:
                        result = measure(submit, n, cfg.window)
                    rec.write(**row, **result, load=os.getloadavg())
                    progress.step(f"{name} {n} x {ranks} rank(s) on {slots}: "
                                  f"{result['tasks_per_s']:.0f}/s")
                except Exception as exc:  # noqa: BLE001 - a runtime that fails is a result too
                    rec.write(kind="error", experiment=cfg.name, executor=name, stage="run",
                              error=runner._first_line(exc), **{k: row[k] for k in
                                                                 ("queued", "slots", "ranks")})
                    progress.step(f"{name} failed", error=True)


# --------------------------------------------------------------------------- report
def section(run, rows, out_dir, stem):
    """The tasks/s table (median [min-max], n), losses and RSS, and the plot."""
    points = [r for r in rows if r.get("kind") == "throughput"]
    if not points:
        return [], []
    execs = report_table.executors_in(points, run)
    groups = report_table.group(points, "queued", "ranks", "slots")
    body = []
    for (n, ranks, slots), group in sorted(groups.items()):
        by = report_table.group(group, "executor")
        cells = [f"{report_table.stat(by[(e,)], 'tasks_per_s')} (n={len(by[(e,)])})"
                 if (e,) in by else "–" for e in execs]
        threads = by.get(("threads",))
        pool = by.get(("pool",))
        left = "–"
        if threads and pool:   # per task: the pool's time minus Parsl's own (threads)
            left = report_table.fmt(1e3 * (1 / report_table.median(pool, "tasks_per_s")
                                     - 1 / report_table.median(threads, "tasks_per_s")))
        body.append([f"{n:,}", str(ranks), str(slots), *cells, left])
    lines = ["Tasks/s, N no-op tasks submitted at once (median [min–max] over repeats, n); "
             "`threads`/`htex` are Parsl's own executors running a no-op `python_app` "
             "(no MPI; `threads` ran beside the pool in each case, `htex` in the 1-rank "
             "ones). Last column: ms per task the pool spends beyond "
             "Parsl's own (1/pool − 1/threads).", ""]
    lines += report_table.table(["tasks", "ranks", "slots", *execs, "pool − Parsl ms/task"], body)
    lost = sum(r.get("lost", 0) for r in points)
    big = max(points, key=lambda r: (r["queued"], r["executor"] == "pool"))
    failed = sorted({e for r in points for e in r.get("errors", [])})
    lines += [f"Tasks lost over every run: {lost}" + (f" (failures: {failed})" if failed else "")
              + f". Largest run: {big['executor']}, "
              f"{big['queued']:,} tasks, {big['lost']} lost, client RSS "
              f"{big['rss_start_mib']:.0f} MiB at start, {big['rss_end_mib']:.0f} MiB at end; "
              f"load average (1 min) {big['load'][0]:.1f}.", ""]
    return lines, _plot(points, execs, out_dir, stem)


def _plot(points, execs, out_dir, stem) -> List[str]:
    if out_dir is None:
        return []
    panels = sorted({(r["ranks"], r["slots"]) for r in points})

    def draw(ax, key):
        ranks, slots = key
        for executor in execs:
            mine = [r for r in points if r["executor"] == executor
                    and (r["slots"], r["ranks"]) == (slots, ranks)]
            by_n = report_table.group(mine, "queued")
            xs = sorted(n for (n,) in by_n)
            if xs:
                ax.plot(xs, [statistics.median(r["tasks_per_s"] for r in by_n[(n,)])
                             for n in xs], marker="o", label=executor)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tasks queued at once")
        ax.set_ylabel("tasks/s")
        ax.set_title(f"{ranks}-rank tasks, {slots} slots")
        ax.legend(fontsize=7)

    return report_plots.panels(panels, 4.5, draw, out_dir, stem)


for _kind in ("throughput", "soak"):
    runner.RUNNERS.setdefault(_kind, run_throughput)
    report.SECTIONS.setdefault(_kind, section)
