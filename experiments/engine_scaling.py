"""``bench_engine --scaling``: hetflow's engine at 1 -> R ranks on the paper's data (strong or
weak scaling), with each op's phases (``--phases``) and the bound its local work sets, and
Cylon itself beside it (``--cylon``).
"""
from __future__ import annotations

import json
import os
import statistics

#: A phase a rank did not enter: (wall s, CPU s, page faults).
_NO_PHASE = (0, 0, 0)
PHASES = ("check", "partition", "split", "pack", "exchange", "reassemble", "sample", "local")


def _phase_summary(result: dict) -> dict:
    """Per phase: median over repeats of the slowest rank's wall seconds, of the CPU seconds
    of all ranks together and of their page faults; plus 'other' = op time not in any phase."""
    per_rep = list(zip(*result["phases"]))  # repeats x ranks of {phase: (wall, cpu, faults)}
    out = {}
    names = [p for p in PHASES if any(p in r for rep in per_rep for r in rep)]
    names += sorted({p for rep in per_rep for r in rep for p in r} - set(names))
    for p in names:
        wall = [max(r.get(p, _NO_PHASE)[0] for r in rep) for rep in per_rep]
        cpu = [sum(r.get(p, _NO_PHASE)[1] for r in rep) for rep in per_rep]
        faults = [sum(r.get(p, _NO_PHASE)[2] for r in rep) for rep in per_rep]
        out[p] = (statistics.median(wall), statistics.median(cpu), statistics.median(faults))
    total_wall = [statistics.median([max(ts) for ts in zip(*result["rank_times"])])]
    accounted = sum(w for w, *_ in out.values())
    cpu_total = statistics.median(result["cpu"])
    out["other"] = (max(0.0, total_wall[0] - accounted),
                    max(0.0, cpu_total - sum(c for _, c, _ in out.values())),
                    max(0.0, statistics.median(result["faults"])
                        - sum(f for _, _, f in out.values())))
    return out


#: Cylon's own ways of doing each op, timed beside hetflow with --cylon: its two join
#: algorithms, its sort.
CYLON_ENGINES = {"join": ["cylon-sort", "cylon-hash"], "sort": ["cylon"]}


def _print_cylon(ops, counts, engines, summary, runs, cylon_runs) -> None:
    """hetflow beside Cylon itself: medians, each engine's speed-up over its own first rank
    count, and hetflow's time as a fraction of each Cylon engine's."""
    print(f"\n{'op':<5} {'ranks':>5} {'engine':<11} {'median s':>9} {'cpu s (all)':>12} "
          f"{'speed-up':>9} {'rows out':>11} {'hetflow / it':>13}")
    for op in ops:
        het = {r: statistics.median(summary[(op, r)]["times"]) for r in counts}
        for r in counts:
            for engine in engines[op]:
                results = (None if engine == "hetflow" else cylon_runs[(engine, op, r)])
                times = het[r] if results is None else statistics.median(
                    sum((x["times"] for x in results), []))
                first = het[counts[0]] if results is None else statistics.median(
                    sum((x["times"] for x in cylon_runs[(engine, op, counts[0])]), []))
                cpu = statistics.median(summary[(op, r)]["cpu"] if results is None
                                        else sum((x["cpu"] for x in results), []))
                rows = f"{(runs[(op, r)] if results is None else results)[0]['rows_out']:,}"
                print(f"{op:<5} {r:>5} {engine:<11} {times:>9.3f} {cpu:>12.3f} "
                      f"{first / times:>9.2f} {rows:>11} {het[r] / times:>13.2f}")
    print("speed-up: this engine's median at the first rank count / here; hetflow / it: "
          "hetflow's median / this engine's (below 1: hetflow is faster)")


def scaling(args, launch, ranks_env: dict) -> int:
    """1 -> R ranks on the paper's data, the tables' size fixed (strong scaling) or growing with
    the ranks (``--weak``): launches of each rank count interleaved, so load from other
    work on the machine hits them alike; medians over every repeat of every round.
    ``launch(op, args, ranks=, rows=, engine=)``: one ``mpiexec`` launch's result
    (:func:`hetflow.experiments.bench_engine.hetflow_run`); ``ranks_env``: the ranks'
    environment."""
    counts = [int(c) for c in args.scaling.split(",")]
    ops = args.ops.split(",")
    kind = "weak: rows per rank" if args.weak else f"strong: rows per table at {counts[0]} rank(s)"
    print(f"hetflow scaling ({kind} = {args.per_rank:,}), ranks {counts}, {args.rounds} "
          f"rounds x {args.repeats} repeats, MPI env {args.mpi_env or 'default'}, "
          f"{os.cpu_count()} cores", flush=True)
    print(f"ranks' GLIBC_TUNABLES: {ranks_env.get('GLIBC_TUNABLES') or '(none)'}",
          flush=True)
    engines = {op: ["hetflow"] + (CYLON_ENGINES[op] if args.cylon else []) for op in ops}
    if args.cylon:
        print(f"Cylon itself (pycylon) beside it, under {args.cylon}", flush=True)
    cylon_runs = {(e, op, r): [] for op in ops for e in engines[op][1:] for r in counts}
    runs = {(op, r): [] for op in ops for r in counts}
    for _ in range(args.rounds):
        for op in ops:
            for r in counts:
                rows = args.per_rank * (r if args.weak else counts[0])
                for engine in engines[op]:
                    result = launch(op, args, ranks=r, rows=rows, engine=engine)
                    (runs[(op, r)] if engine == "hetflow"
                     else cylon_runs[(engine, op, r)]).append(result)
    summary = {}
    for (op, r), results in runs.items():
        merged = {"times": sum((x["times"] for x in results), []),
                  "cpu": sum((x["cpu"] for x in results), []),
                  "system": sum((x["system"] for x in results), []),
                  "faults": sum((x["faults"] for x in results), []),
                  "rank_times": [sum((x["rank_times"][k] for x in results), [])
                                 for k in range(r)],
                  "phases": [sum((x["phases"][k] for x in results), []) for k in range(r)]
                  if args.phases else None,
                  "memory": [m for x in results for m in x["memory"]]}
        summary[(op, r)] = merged
    base = counts[0]
    print(f"\n{'op':<5} {'ranks':>5} {'median s':>9} {'min s':>7} {'cpu s (all)':>12} "
          f"{'of it sys':>10} {'page faults':>12} {'speed-up':>9} {'cpu ratio':>10} "
          f"{'(peak-base)/part':>17}")
    for op in ops:
        t0 = statistics.median(summary[(op, base)]["times"])
        c0 = statistics.median(summary[(op, base)]["cpu"])
        for r in counts:
            m = summary[(op, r)]
            t, c = statistics.median(m["times"]), statistics.median(m["cpu"])
            mem = max((x["peak_rss_mib"] - x["base_rss_mib"]) / x["partition_mib"]
                      for x in m["memory"])
            sys_s, flt = statistics.median(m["system"]), statistics.median(m["faults"])
            print(f"{op:<5} {r:>5} {t:>9.4f} {min(m['times']):>7.4f} {c:>12.4f} {sys_s:>10.4f} "
                  f"{flt:>12,.0f} {t0 / t:>9.2f} {c / c0:>10.2f} {mem:>17.2f}")
    print("speed-up: median time at the first rank count / median time here; cpu ratio: CPU "
          "seconds of all ranks here / at the first rank count; of it sys: the kernel's part "
          "(mostly zeroing the fresh pages counted as page faults: every buffer of 4 MiB or "
          "more is new memory, docs/engine.md), counted in the kernel's ticks")
    if args.cylon:
        _print_cylon(ops, counts, engines, summary, runs, cylon_runs)
    if args.phases:
        for op in ops:
            table = {r: _phase_summary(summary[(op, r)]) for r in counts}
            seen = {p for r in counts for p in table[r]}
            names = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES) - {"other"})
            names.append("other")
            print(f"\n{op}: per-phase wall s (slowest rank) / CPU s / page faults (all ranks), "
                  "medians")
            print(f"{'phase':<11}" + "".join(f"{f'{r} rank wall':>14}{'cpu':>8}{'faults':>9}"
                                             for r in counts))
            for p in names:
                cells = (table[r].get(p, _NO_PHASE) for r in counts)
                print(f"{p:<11}" + "".join(f"{w:>14.4f}{c:>8.4f}{f:>9,.0f}" for w, c, f in cells))
            _print_bound(op, counts, summary, table, args.weak)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args),
                       "runs": {f"{op}@{r}": v for (op, r), v in summary.items()}}, fh)
    return 0


def _print_bound(op, counts, summary, table, weak: bool) -> None:
    """What the ranks' local work alone allows: the speed-up (strong) or efficiency (weak) if
    every phase but ``local`` cost nothing, from the same run. The ranks' local phases run at
    once on a shared node, so this bound also holds what the node's cores lose to each other
    (memory bandwidth, caches): no shuffle, however fast, takes the op past it here."""
    t0 = statistics.median(summary[(op, counts[0])]["times"])
    parts = []
    for r in counts[1:]:
        local = table[r].get("local", (0.0, 0.0))[0]
        measured = t0 / statistics.median(summary[(op, r)]["times"])
        bound = t0 / local if local > 0 else float("inf")
        parts.append(f"{r} ranks {bound:.2f} (measured {measured:.2f})")
    what = (f"efficiency against {counts[0]} rank(s)" if weak
            else f"speed-up over {counts[0]} rank(s)")
    print(f"{op}: {what} if every phase but 'local' were free: " + ", ".join(parts))
