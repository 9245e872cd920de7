"""The analytics benchmark: group-bys and joins on string ids with nulls, hetflow against polars
and DuckDB on the same cores and the same data, every result checked equal across engines.

The data (:func:`facts`): ``rows`` rows with string ids of low (``id_lo``, 100 values) and high
(``id_hi``, 100k values) cardinality, integer and string join keys drawn from 12, 12k and 12M
values (``k10``/``s10``, ``k10k``/``s10k``, ``k10m``/``s10m``), a few small dimensions
(``cat``, ``flag``, ``dow``, ``year``) and an int and a float measure with about 5% nulls. The
right-hand tables (:func:`dimension`) have 10, 10k and 10M unique keys (scaled with ``rows``),
so about 5/6 of the big table's rows find a match. Every process builds exactly the rows it
holds, block by seeded block, so the hetflow ranks and the peers see the same table.

Queries (:data:`QUERIES`): group-bys by 1 (low and high cardinality), 2 and 6 keys with
sum/mean/count/min/max of both measures; joins of the big table (its key and the two measures)
with each right-hand table on the integer and the string key, inner and left; and issue 41's
held-out group-bys (:data:`~hetflow.experiments.analytics_data.HELD_OUT`) on a table of the
public group-by benchmark's shape (int32 values, keys of 100 and rows/100 values).
Data and queries: :mod:`hetflow.experiments.analytics_data`; checks:
:mod:`hetflow.experiments.analytics_check`.

Each engine runs in a process of its own (so its peak memory is its own): hetflow on R ranks of
an MPI task (:func:`hetflow_task`), polars and DuckDB limited to R threads
(``python -m hetflow.experiments.analytics '{json}'``). A query's time is the median of
``repeats`` runs (hetflow: ``barrier; t0; query; barrier; t1``), each run's time kept
(``op_times``) with the machine's load and the CPU of every other process during it
(``machine``; the runner writes one results row per run, :func:`repeat_rows`); its peak is the
process's peak resident set during the query's first run (Linux's ``VmHWM``, reset before it). A
group-by's result is written to an Arrow file and compared across engines after sorting by
its keys (floats to a relative 1e-9); a join's result, too large to keep, is summarised by an
order-independent digest (row count and two sums of row hashes over every column's values),
which every engine must match exactly.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Dict, List, Sequence

from hetflow.experiments.analytics_check import (check, combine_digests, compare, digest,
                                                 read_result, write)
from hetflow.experiments.analytics_data import (AGGS, FULL_ROWS, MEASURES, QUERIES, Query,
                                                dimension, facts, left_columns, right_rows, span)
from hetflow.experiments.engine_memory import (peak_rss_mib, release_free_heap, reset_peak,
                                               rss_mib)

#: What callers use from here (the runner, the tests).
__all__ = ["AGGS", "FULL_ROWS", "MEASURES", "QUERIES", "Query", "check", "combine_digests",
           "compare", "digest", "hetflow_task", "peer_environment", "peer_run", "read_result",
           "repeat_rows"]


def _watch(ranks=(), own=None):
    """Start watching what else the machine does (``experiments/machine.py``); a function that
    stops and returns ``load1``, ``others_cores``, ``op_runtime_cores`` and ``busy``."""
    from hetflow.experiments.machine import Window

    window = Window().start()
    return lambda: window.stop(ranks=ranks, own=own)


def _timed(run, repeats: int, barrier=None, watch=None):
    """(seconds of each run, peak MiB of the first run, resident MiB before it, what else the
    machine did during each run (``watch``'s, or nothing), result of the last)."""
    times, machine, peak, before, out = [], [], 0.0, 0.0, None
    for i in range(repeats):
        out = None
        stop = watch() if watch else None
        if barrier:
            barrier()
        if i == 0:
            reset_peak()
            before = rss_mib()
        t0 = time.perf_counter()
        out = run()
        if barrier:
            barrier()
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = peak_rss_mib()
        if stop:
            machine.append(stop())
    return times, peak, before, machine, out


def _record(times: List[float], machine: List[dict], *, peak: float, before: float,
            partition: float, over: float, rows_out: int, gen_s: float, digest, **more) -> dict:
    """A query's record, hetflow's or a peer's: each run's time (``op_times``, their median
    ``op_s``) and what else the machine did during it (``machine``), the peak resident MiB of
    the first run, the resident MiB before it, the partition's MiB and the peak over it, the
    rows out, the data's generation seconds and a join's digest (None for a group-by)."""
    return {"op_s": statistics.median(times), "op_times": times, "machine": machine,
            "peak_rss_mb": peak, "rss_before_mb": before, "partition_mb": partition,
            "peak_over_partition": over, "rows_out": rows_out, "gen_s": gen_s,
            "digest": digest, **more}


#: Fields of a query's record that its first run alone measures (its peak memory).
FIRST_RUN = ("peak_rss_mb", "peak_over_partition", "partition_mb", "rss_before_mb")


def repeat_rows(record: dict) -> List[dict]:
    """A query's record as one results row per run: its time (``op_s``) and what else the
    machine did meanwhile (``load1``, ``others_cores``, ``busy``); the first run's row also
    carries the peak memory. A record without per-run times stays one row."""
    times, machine = record.get("op_times"), record.get("machine") or []
    if not times:
        return [dict(record)]
    common = {k: v for k, v in record.items()
              if k not in ("op_times", "machine", "op_s") + FIRST_RUN}
    rows = []
    for i, seconds in enumerate(times):
        row = {**common, "repeat": i, "op_s": seconds,
               **(machine[i] if i < len(machine) else {})}
        if i == 0:
            row.update({k: record[k] for k in FIRST_RUN if k in record})
        rows.append(row)
    return rows


def _hetflow_spec(q: Query) -> dict:
    """The query's aggregations as hetflow's ``GroupBy.agg`` spec."""
    from hetflow.frame import Agg

    spec: Dict[str, list] = {}
    for column, func in q.columns:
        spec.setdefault(column, []).append(
            Agg("nlargest", n=int(func.split("_")[1])) if func.startswith("nlargest_") else func)
    return spec


# --------------------------------------------------------------------------- hetflow
def hetflow_task(comm, rows: int, repeats: int, out_dir: str, queries: Sequence[str] = (),
                 tag: str = "hetflow") -> dict:
    """Every query on this MPI task's ranks: rank 0 returns ``{query: record}`` (the other
    ranks ``{}``) and writes the group-by results to ``out_dir/<tag>-<i>.arrow``."""
    from hetflow import frame
    from hetflow.frame import _backend, barrier

    rank, size = comm.Get_rank(), comm.Get_size()
    # the engine's thread and allocator settings before the data is built (its first
    # operation would make them), so the partition lives where the queries' buffers will
    _backend.configure_threads(comm)
    selected = [(i, q) for i, q in enumerate(QUERIES) if not queries or q.name in queries]
    t0 = time.perf_counter()
    bigs = {name: facts(rows, *span(rows, rank, size), table=name)
            for name in dict.fromkeys(q.table for _, q in selected)}
    gen_s = time.perf_counter() - t0
    release_free_heap()
    tables = {name: frame.from_local(comm, big) for name, big in bigs.items()}
    for big in bigs.values():   # warm-up: the engine's code paged in
        frame.groupby(frame.from_local(comm, big.slice(0, 10)), big.column_names[0]).agg(
            {big.column_names[-1]: "sum"})
    # rank 0 watches the machine around each run: the load, and the CPU of every process
    # other than the ranks and their runtime's
    pids = comm.allgather(os.getpid())
    watch = (lambda: _watch(ranks=pids)) if rank == 0 else None
    records = {}
    for i, q in selected:
        big = bigs[q.table]
        right_local = left = right = run = None
        release_free_heap()  # the previous query's leftovers are not this one's baseline
        if q.is_join:
            n = right_rows(q, rows)
            right_local = dimension(q, rows, *span(n, rank, size))
            left = frame.from_local(comm, big.select(left_columns(q)))
            right = frame.from_local(comm, right_local)
            run = lambda left=left, right=right, q=q: frame.join(left, right, on=q.key, how=q.how)  # noqa: E731
        else:
            spec, table = _hetflow_spec(q), tables[q.table]
            run = lambda q=q, spec=spec, table=table: table.groupby(list(q.by)).agg(spec)  # noqa: E731
        times, peak, before, machine, out = _timed(run, repeats, lambda: barrier(comm), watch)
        partition = big.nbytes + (right_local.nbytes if right_local is not None else 0)
        mine = {"peak_mb": peak, "before_mb": before, "partition_mb": partition / 2**20,
                "rows_out": out.local.num_rows, "backend": out.backend}
        if q.is_join:
            mine["digest"] = digest(out.local)
        else:
            gathered = out.gather()
            if rank == 0:
                write(gathered, os.path.join(out_dir, f"{tag}-{i}.arrow"))
        del out
        every = comm.gather(mine, root=0)
        if rank == 0:
            worst = max(every, key=lambda m: m["peak_mb"] / max(m["partition_mb"], 1e-9))
            records[q.name] = _record(
                times, machine, peak=max(m["peak_mb"] for m in every),
                before=max(m["before_mb"] for m in every),
                partition=max(m["partition_mb"] for m in every),
                over=worst["peak_mb"] / max(worst["partition_mb"], 1e-9),
                rows_out=sum(m["rows_out"] for m in every), gen_s=gen_s,
                digest=combine_digests([m["digest"] for m in every]) if q.is_join else None,
                engine_path=every[0]["backend"])
    return records if rank == 0 else {}


# --------------------------------------------------------------------------- peers
def _polars(bigs, threads: int):
    import polars as pl

    frames = {name: pl.from_arrow(big) for name, big in bigs.items()}
    exprs = {"sum": lambda c: c.sum(), "mean": lambda c: c.mean(), "count": lambda c: c.count(),
             "min": lambda c: c.min(), "max": lambda c: c.max(),
             "median": lambda c: c.median(), "std": lambda c: c.std(),
             "nlargest_2": lambda c: c.top_k(2).sort(descending=True)}

    def groupby(q):
        aggs = [exprs[f](pl.col(m)).alias(f"{m}_{f}") for m, f in q.columns]
        # polars' sum of an all-null group is 0; SQL's (and hetflow's) is null
        sums = sorted({m for m, f in q.columns if f == "sum"})
        counts = [pl.col(m).count().alias(f"__n_{m}") for m in sums]
        return lambda: frames[q.table].group_by(list(q.by)).agg(aggs + counts)

    def join(q, right):
        left = frames[q.table].select(left_columns(q))
        rf = pl.from_arrow(right)
        return lambda: left.join(rf, on=q.key, how=q.how)

    def to_arrow(q, out):
        if not q.is_join:
            sums = sorted({m for m, f in q.columns if f == "sum"})
            out = out.with_columns([
                pl.when(pl.col(f"__n_{m}") > 0).then(pl.col(f"{m}_sum")).otherwise(None)
                .alias(f"{m}_sum") for m in sums]).drop([f"__n_{m}" for m in sums])
        return out.to_arrow()

    return groupby, join, to_arrow


def _duckdb(bigs, threads: int):
    import duckdb

    con = duckdb.connect(config={"threads": threads})
    for name, big in bigs.items():
        con.register(name, big)
    integers = {name: {f.name for f in big.schema if str(f.type).startswith(("int", "uint"))}
                for name, big in bigs.items()}
    sql_of = {"sum": "SUM({c})", "mean": "AVG({c})", "count": "COUNT({c})", "min": "MIN({c})",
              "max": "MAX({c})", "median": "MEDIAN({c})", "std": "STDDEV_SAMP({c})",
              "nlargest_2": "MAX({c}, 2)"}

    def groupby(q):
        keys = ", ".join(q.by)
        aggs = [sql_of[f].format(c=m) + ("::BIGINT" if f == "sum" and m in integers[q.table]
                                         else "") + f" AS {m}_{f}" for m, f in q.columns]
        sql = f"SELECT {keys}, {', '.join(aggs)} FROM {q.table} GROUP BY {keys}"
        return lambda: con.sql(sql).to_arrow_table()

    def join(q, right):
        con.register("dim", right)
        cols = ", ".join(left_columns(q)[1:])
        kind = "LEFT JOIN" if q.how == "left" else "JOIN"
        sql = (f"SELECT {q.key}, {cols}, w, label FROM (SELECT {q.key}, {cols} FROM {q.table}) "
               f"f {kind} dim USING ({q.key})")
        return lambda: con.sql(sql).to_arrow_table()

    return groupby, join, lambda q, out: out


PEERS = {"polars": _polars, "duckdb": _duckdb}


def peer_run(engine: str, rows: int, repeats: int, out_dir: str, threads: int = 2,
             queries: Sequence[str] = ()) -> dict:
    """Every query in ``engine`` (polars or duckdb) on ``threads`` threads: ``{query: record}``."""
    if engine not in PEERS:
        raise ValueError(f"unknown peer {engine!r}; expected one of {sorted(PEERS)}")
    selected = [(i, q) for i, q in enumerate(QUERIES) if not queries or q.name in queries]
    t0 = time.perf_counter()
    bigs = {name: facts(rows, table=name) for name in dict.fromkeys(q.table for _, q in selected)}
    gen_s = time.perf_counter() - t0
    groupby, join, to_arrow = PEERS[engine](bigs, threads)
    records = {}
    for i, q in selected:
        right = dimension(q, rows) if q.is_join else None
        run = join(q, right) if q.is_join else groupby(q)
        times, peak, before, machine, out = _timed(
            run, repeats, watch=lambda: _watch(own={os.getpid()}))
        result = to_arrow(q, out)
        del out
        partition = bigs[q.table].nbytes + (right.nbytes if right is not None else 0)
        records[q.name] = _record(times, machine, peak=peak, before=before,
                                  partition=partition / 2**20, over=peak / (partition / 2**20),
                                  rows_out=result.num_rows, gen_s=gen_s,
                                  digest=digest(result) if q.is_join else None)
        if not q.is_join:
            write(result, os.path.join(out_dir, f"{engine}-{i}.arrow"))
    return records


def peer_environment(threads: int) -> Dict[str, str]:
    """The environment a peer process runs in: its thread pools capped at ``threads``."""
    env = dict(os.environ)
    env.update(POLARS_MAX_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               RAYON_NUM_THREADS=str(threads))
    return env


def main(argv=None) -> int:
    """``python -m hetflow.experiments.analytics '{"engine": ..., "rows": N, ...}'``: one peer's
    records as a ``HETFLOW_BENCH {json}`` line."""
    args = json.loads((argv or sys.argv[1:])[0])
    print("HETFLOW_BENCH " + json.dumps(peer_run(**args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
