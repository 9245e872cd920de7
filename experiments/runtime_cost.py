"""A runtime's own cost on a small node: op times of a 2-rank join and sort under each runtime,
side by side, with the CPU its own processes used and the machine's load.

    python -m hetflow.experiments.runtime_cost --rows 20e6 --repeats 3 \\
        --variants mpirun,radical:yield_cpu=False,radical --out rp-cost.jsonl

Each repeat runs every variant once, in turn (interleaved: a busy spell of the machine hits
every variant alike), each in a fresh runtime: start (timed), the join, then the sort, each
one task of ``--iterations`` iterations under the paper's protocol (``protocol.cylon_task``),
then the close. The protocol reads, around the iterations, the share of a core each rank got,
the CPU of the runtime's own processes and of all others, and the load
(``experiments/machine.py``); a row records them.

The summary gives, per variant and op, the median and the min-max of the op time over the
repeats, and each variant's ratio to the first variant where their ranges do not overlap
(else "within noise").
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import List, Optional


def parse_variant(text: str) -> dict:
    """``radical:yield_cpu=False,...`` -> {"name": text, "runtime": "radical", "options": {...}}."""
    runtime, _, rest = text.partition(":")
    options = {}
    for part in filter(None, rest.split(";")):
        key, _, value = part.partition("=")
        options[key] = {"True": True, "False": False}.get(value, value)
    return {"name": text, "runtime": runtime, "options": options}


def run_variant(variant: dict, rows: int, iterations: int, repeat: int, write) -> None:
    import hetflow
    from hetflow.experiments import protocol

    t0 = time.perf_counter()
    with hetflow.runtime(variant["runtime"], max_ranks=2, output="off",
                         **variant["options"]):
        startup_s = time.perf_counter() - t0
        app = hetflow.mpi_app(protocol.cylon_task, ranks=2)
        for op in ("join", "sort"):
            t1 = time.perf_counter()
            report = app(op, rows, iterations).result()
            write({"kind": "task", "variant": variant["name"], "repeat": repeat,
                   "startup_s": startup_s, "task_s": time.perf_counter() - t1,
                   **{k: report.get(k) for k in (
                       "op", "rows_per_rank", "iterations", "op_mean_s", "op_iter_s", "gen_s",
                       "setup_s", "op_cpu_s", "rank_core_share", "op_runtime_cores",
                       "others_cores", "load1", "busy")}})
        t2 = time.perf_counter()
    write({"kind": "session", "variant": variant["name"], "repeat": repeat,
           "startup_s": startup_s, "close_s": time.perf_counter() - t2})


def spread(values: List[float]) -> dict:
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def compare(base: Optional[dict], other: dict) -> str:
    """``other``'s ratio to ``base``, or "within noise" where their min-max ranges overlap."""
    if base is None or base is other:
        return "(baseline)"
    if other["min"] <= base["max"] and base["min"] <= other["max"]:
        return "within noise"
    return f"{other['median'] / base['median']:.2f}x"


def summary(rows: List[dict]) -> str:
    """Markdown: per op and variant, op time, start-up and CPU, median [min-max] over repeats."""
    tasks = [r for r in rows if r.get("kind") == "task"]
    variants = list(dict.fromkeys(r["variant"] for r in tasks))
    lines = ["| op | variant | n | op time, s | vs first | start-up, s | runtime CPU, cores | "
             "core share per rank | others' CPU, cores | load | busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(s):
        return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    for op in ("join", "sort"):
        base = None
        for name in variants:
            mine = [r for r in tasks if r["variant"] == name and r["op"] == op]
            if not mine:
                continue
            op_s = spread([r["op_mean_s"] for r in mine])
            base = base or op_s
            lines.append("| " + " | ".join([
                op, name, str(op_s["n"]), cell(op_s), compare(base, op_s),
                cell(spread([r["startup_s"] for r in mine])),
                cell(spread([r["op_runtime_cores"] for r in mine])),
                cell(spread([r["rank_core_share"] for r in mine])),
                cell(spread([r["others_cores"] for r in mine])),
                cell(spread([r["load1"] for r in mine])),
                str(sum(bool(r["busy"]) for r in mine))]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetflow.experiments.runtime_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="20e6", help="rows per rank (default 20e6)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--variants", default="mpirun,radical:yield_cpu=False,radical",
                        help="comma-separated RUNTIME[:key=value;...]; the first is the baseline")
    parser.add_argument("--out", default="runtime-cost.jsonl")
    parser.add_argument("--summary", action="store_true", help="only summarise --out")
    args = parser.parse_args(argv)
    if not args.summary:
        rows = int(float(args.rows))
        variants = [parse_variant(v) for v in args.variants.split(",") if v]

        def write(row):
            row = {"time": time.time(), **row}
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), file=sys.stderr, flush=True)

        for repeat in range(args.repeats):
            for variant in variants:
                try:
                    run_variant(variant, rows, args.iterations, repeat, write)
                except Exception as exc:  # noqa: BLE001 - recorded; the others still run
                    write({"kind": "error", "variant": variant["name"], "repeat": repeat,
                           "error": f"{type(exc).__name__}: {exc}"[:400]})
    with open(args.out) as fh:
        print(summary([json.loads(line) for line in fh if line.strip()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
