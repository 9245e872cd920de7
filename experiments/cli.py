"""``hetflow bench`` / ``python -m hetflow.experiments``: run named experiments, write results and a report.

    hetflow bench weak [--quick] [--repeats N] [--rows 1e6,2e6] [--executors mpirun,pool] [--out DIR]
    hetflow bench throughput [--queued 1000,1e4] [--slots 2,32]      # tasks/s vs tasks queued
    hetflow bench all --out experiments/results        # every experiment, one report
    hetflow bench report DIR/results.jsonl             # the report again, from the results alone
    hetflow bench list                                 # the experiments and what they measure
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from typing import List, Optional

from hetflow.errors import ConfigError

RESULTS_NAME = "results.jsonl"
#: The order ``all`` runs the experiments in (and the report lists them in).
ORDER = ("weak", "strong", "overhead", "pilot", "peers", "analytics", "paper", "throughput")


def _split(text: Optional[str]) -> Optional[List[str]]:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def questions(text: Optional[str]) -> Optional[List[str]]:
    """``--questions``: analytics queries separated by ``;``, each a query's name or a part of
    one that names exactly one (``"median;sum v3"``); their full names, in the given order."""
    if text is None:
        return None
    from hetflow.experiments.analytics_data import QUERIES

    names = [q.name for q in QUERIES]
    out = []
    for part in (t.strip() for t in text.split(";")):
        found = [part] if part in names else [n for n in names if part and part in n]
        if len(found) != 1:
            raise ConfigError(f"--questions: {part!r} names {len(found)} queries "
                              f"({found or names}); give one query's name or a part of it")
        out.append(found[0])
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


#: What --rows, --ranks and --iterations mean for an experiment kind, where not the default.
MEANINGS = {"pipeline": {
    "rows": "events per rank of the features task",
    "ranks": "ranks of the features and evaluation tasks (training: the config's train_ranks)",
    "iterations": "training epochs of the DDP task"}}


def experiment_help(name: str) -> str:
    """What one experiment runs, and what each option means for it, with its settings."""
    from hetflow.experiments import config as configs

    full, quick = configs.load(name), configs.load(name, quick=True)
    mean = MEANINGS.get(full.kind, {})
    rows = "rows per rank" if configs.KINDS[full.kind] == "per_rank" else "rows in total"
    lines = [f"{name}: {full.description}.", "",
             f"Its config: {os.path.join(configs.CONFIG_DIR, name + '.toml')}.", "",
             "What the options mean for it, and its settings (full run; --quick):"]
    for option, meaning in (("rows", mean.get("rows", rows)),
                            ("ranks", mean.get("ranks", "rank counts per task")),
                            ("iterations", mean.get("iterations", "op iterations per task")),
                            ("repeats", "repeats of each measurement"),
                            ("executors", "runtimes it runs on")):
        values = [getattr(c, option) for c in (full, quick)]
        values = [", ".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in values]
        lines.append(f"  --{option:<11} {meaning}: {values[0]}; {values[1]}")
    return "\n".join(lines)


def build_parser(prog: str = "hetflow bench",
                 experiment: Optional[str] = None) -> argparse.ArgumentParser:
    from hetflow.experiments.config import experiment_names

    if experiment in experiment_names():
        parser = argparse.ArgumentParser(prog=prog, description=experiment_help(experiment),
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        parser = argparse.ArgumentParser(
            prog=prog, description="Run the Radical-Cylon reproduction experiments and write a "
            "report. 'hetflow bench NAME --help' says what the options mean for one of them.")
    parser.add_argument("experiment", help=f"one of {experiment_names()}, 'all', 'list', "
                        "'report RESULTS', or a path to a .toml config")
    parser.add_argument("results", nargs="?", help="(with 'report') the results file to report on")
    parser.add_argument("--quick", action="store_true",
                        help="the ~1-minute smoke version (the config's [quick] table)")
    parser.add_argument("--repeats", type=int, help="repeats per measurement")
    parser.add_argument("--iterations", type=int, help="op iterations per task (paper: 10); "
                        "pipeline: training epochs")
    parser.add_argument("--rows", help="comma-separated row counts (per rank or total, as the "
                        "experiment reads them), e.g. 1e6,2_000_000")
    parser.add_argument("--ranks", help="comma-separated rank counts, e.g. 1,2,4")
    parser.add_argument("--queued", help="(throughput) comma-separated task counts, e.g. 1000,1e4")
    parser.add_argument("--slots", help="(throughput) comma-separated slot counts, e.g. 2,32")
    parser.add_argument("--executors", help="comma-separated runtimes, e.g. mpirun,pool "
                        "(not installed ones are skipped and reported)")
    parser.add_argument("--out", help="output directory (default ./hetflow-bench-<time>); the "
                        f"results append to OUT/{RESULTS_NAME}, the report is OUT/report.md")
    parser.add_argument("--questions", help="(analytics) only these queries, separated by ';': "
                        "each a query's name or a part of it naming one, e.g. 'median;sum v3'")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    return parser


def main(argv: Optional[List[str]] = None, prog: str = "hetflow bench") -> int:
    from hetflow.experiments import config as configs

    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(prog, named).parse_args(argv)
    try:
        if args.experiment == "list":
            for name in configs.experiment_names():
                cfg = configs.load(name)
                print(f"{name:10s} {cfg.description}")
            return 0
        if args.experiment == "report":
            if not args.results:
                raise ConfigError("usage: hetflow bench report RESULTS [--out DIR]")
            from hetflow.experiments import throughput  # registers its report section
            from hetflow.experiments.report import write_report

            print(write_report(args.results, args.out, plots=not args.no_plots))
            return 0
        if args.results:
            raise ConfigError(f"unexpected argument {args.results!r} (only 'report' takes a file)")
        names = configs.experiment_names() if args.experiment == "all" else [args.experiment]
        if args.experiment == "all":
            names = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
        overrides = dict(repeats=args.repeats, iterations=args.iterations,
                         rows=configs.parse_ints(args.rows), ranks=configs.parse_ints(args.ranks),
                         executors=_split(args.executors), queued=configs.parse_ints(args.queued),
                         slots=configs.parse_ints(args.slots), queries=questions(args.questions))
        cfgs = [configs.load(n, quick=args.quick).replace(**overrides) for n in names]
        if args.experiment == "all":  # the paper-scale run is asked for by name
            cfgs = [c for c in cfgs if c.in_all]
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    from hetflow.experiments import throughput  # noqa: F401 - registers its runner, section
    from hetflow.experiments.report import write_report
    from hetflow.experiments.runner import Recorder, run_experiment

    out = args.out or f"hetflow-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(out, exist_ok=True)
    results = os.path.join(out, RESULTS_NAME)
    rec = Recorder(results)
    command = [prog.split()[0]] + prog.split()[1:] + argv
    t0 = time.perf_counter()
    # SIGTERM unwinds like Ctrl-C, so every started runtime shuts down and no launcher,
    # pilot or pool rank outlives the command.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for cfg in cfgs:
            run_experiment(cfg, rec, argv=[shlex.quote(a) for a in command])
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; results so far: {results}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = write_report(results, out, plots=not args.no_plots)
    print(f"{len(cfgs)} experiment(s) in {time.perf_counter() - t0:.0f} s; results: {results}; "
          f"report: {report}")
    return 0
