"""Single-machine peers: the same join and sort in pyarrow, polars and duckdb, one process.

Run as ``python -m hetflow.experiments.peers '{"engine": ..., "op": ..., "data": DIR, "iterations": N}'``
in a fresh process (so its peak memory is its own); it reads the Parquet partitions
a hetflow run wrote, concatenates them, times ``iterations`` ops and prints one
JSON line. polars and duckdb use every core they see; pyarrow's join and sort use
its thread pool. That is how a user would run them on this machine.
"""
from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time


def _load(data: str, side: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(data, f"{side}-*.parquet")))
    if not files:
        raise FileNotFoundError(f"no {side}-*.parquet partitions in {data}")
    return pa.concat_tables(pq.read_table(f) for f in files).combine_chunks()


def _ops(engine: str, left, right):
    """(join, sort) callables for ``engine``, each returning its result's row count."""
    if engine == "pyarrow":
        return (lambda: left.join(right, "key", join_type="inner").num_rows,
                lambda: left.sort_by("key").num_rows)
    if engine == "polars":
        import polars as pl

        lf, rf = pl.from_arrow(left), (pl.from_arrow(right) if right is not None else None)
        return (lambda: lf.join(rf, on="key", how="inner").height,
                lambda: lf.sort("key").height)
    if engine == "duckdb":
        import duckdb

        con = duckdb.connect()
        con.register("l", left)
        if right is not None:
            con.register("r", right)
        # Materialise as Arrow, as the distributed engine does: the result is a table in memory.
        return (lambda: con.sql("SELECT * FROM l JOIN r USING (key)").to_arrow_table().num_rows,
                lambda: con.sql("SELECT * FROM l ORDER BY key").to_arrow_table().num_rows)
    raise ValueError(f"unknown peer engine {engine!r}; expected pyarrow, polars or duckdb")


def run(engine: str, op: str, data: str, iterations: int) -> dict:
    t_begin = time.perf_counter()
    left = _load(data, "left")
    right = _load(data, "right") if op == "join" else None
    join, sort = _ops(engine, left, right)
    load_s = time.perf_counter() - t_begin
    fn = join if op == "join" else sort
    times, rows_out = [], 0
    for _ in range(iterations):
        t0 = time.perf_counter()
        rows_out = fn()
        times.append(time.perf_counter() - t0)
    return {"op": op, "engine": engine, "rows": left.num_rows, "iterations": iterations,
            "op_iter_s": times, "op_mean_s": sum(times) / iterations, "gen_s": load_s,
            "fn_total_s": time.perf_counter() - t_begin, "rows_out": rows_out,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def main(argv=None) -> int:
    args = json.loads((argv or sys.argv[1:])[0])
    print("HETFLOW_BENCH " + json.dumps(run(**args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
