"""The engine's shape matrix: group-by, join and sort over every column type hetflow's local
kernels meet, hetflow at 1 and 2 ranks against polars and DuckDB on as many threads, every
hetflow and DuckDB result compared with polars' on the same rows.

``python -m hetflow.experiments.matrix [--rows 500000] [--rounds 3] [--quick] [--json out.json]``

Cells (:func:`cells`):
- group-by, the value axis: ``sum, mean, min, max, count`` of a value column of every integer
  width (signed and unsigned) and float32/64, with and without nulls (20%), by an int64 key of
  10, 100, 100k or about one group per row;
- group-by, the key axis: the sum of an int64 column by a key of each of those types and
  string, large_string and dictionary (string values), with and without nulls, the same group
  counts where the type holds them;
- join: an inner join on a key of each of those types (where it holds the right side's
  keys), with and without nulls (20%, on both sides: a null matches nothing), with a right
  side of 10, 10k or N rows (N the left's), its keys unique or each repeated 4 times;
- sort: by one key of each type, with and without nulls.

Rounds are interleaved: each round runs hetflow on 1 rank, the peers on 1 thread, hetflow on 2
ranks, the peers on 2 threads, each job every cell once; a cell's time is the median over the
rounds (n = rounds), its spread the min-max. A ratio is hetflow's time over the faster peer's
on as many threads as hetflow has ranks (1 core per rank).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Dict, List

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
NUMERIC = INTS + ["float32", "float64"]
KEYS = NUMERIC + ["string", "large_string", "dictionary"]
GROUPS = {"10": 10, "100": 100, "100k": 100_000, "N": None}
#: A join's right-side rows for a left side of ``rows``.
RIGHT = {"10": lambda rows: 10, "10k": lambda rows: 10_000, "N": lambda rows: rows}
#: ``--quick``: the size of a run that checks every cell in minutes.
QUICK = {"rows": 20_000, "rounds": 1}
_SELF = os.path.abspath(__file__)


def cells(rows: int, select: str = "") -> List[dict]:
    """Every cell whose :func:`name` the regular expression ``select`` finds."""
    return [c for c in _cells(rows) if re.search(select, name(c))]


def _cells(rows: int) -> List[dict]:
    out = []
    for groups in GROUPS:
        for value in NUMERIC:
            for nulls in (False, True):
                out.append(dict(op="groupby", axis="value", key="int64", value=value,
                                nulls=nulls, groups=groups))
        for key in KEYS:
            if not _holds(key, GROUPS[groups] or rows):
                continue
            for nulls in (False, True):
                out.append(dict(op="groupby", axis="key", key=key, value="int64", nulls=nulls,
                                groups=groups))
    for key in KEYS:
        for right in ("10", "10k", "N"):
            for repeated in (False, True):
                if not _holds(key, int(1.2 * RIGHT[right](rows))):
                    continue
                for nulls in (False, True):
                    out.append(dict(op="join", key=key, right=right, repeated=repeated,
                                    nulls=nulls))
    for key in KEYS:
        for nulls in (False, True):
            out.append(dict(op="sort", key=key, nulls=nulls))
    return out


def _holds(t: str, distinct: int) -> bool:
    import numpy as np
    return t not in INTS or np.iinfo(t).max >= distinct


def name(cell: dict) -> str:
    if cell["op"] == "groupby":
        return (f"groupby {cell['axis']} key={cell['key']} value={cell['value']} "
                f"groups={cell['groups']}{' nulls' if cell['nulls'] else ''}")
    if cell["op"] == "join":
        return (f"join key={cell['key']} right={cell['right']}"
                f"{' repeated' if cell['repeated'] else ' unique'}"
                f"{' nulls' if cell['nulls'] else ''}")
    return f"sort key={cell['key']}{' nulls' if cell['nulls'] else ''}"


def _column(kind: str, ints, nulls, rng):
    """``ints`` (non-negative int64) as a column of ``kind``, 20% nulls if ``nulls``."""
    import numpy as np
    import pyarrow as pa
    mask = rng.random(len(ints)) < 0.2 if nulls else None
    if kind in ("string", "large_string", "dictionary"):
        arr = pa.array(np.char.add("id", ints.astype(str)).astype(object), pa.string(), mask=mask)
        return (arr.cast(pa.large_string()) if kind == "large_string" else
                arr.dictionary_encode() if kind == "dictionary" else arr)
    if kind.startswith("int") or kind.startswith("uint"):
        ints = ints % min(np.iinfo(kind).max + 1, 1 << 62)
    return pa.array(ints.astype(kind), mask=mask)


def tables(cell: dict, rows: int, rank: int, ranks: int) -> dict:
    """This rank's share (rows split in rank order) of the cell's tables."""
    import numpy as np
    import pyarrow as pa
    lo, hi = rows * rank // ranks, rows * (rank + 1) // ranks
    rng = np.random.default_rng([zlib.crc32(name(cell).encode()), rank])
    n = hi - lo
    if cell["op"] == "groupby":
        g = GROUPS[cell["groups"]] or rows
        keys = rng.integers(0, g, n)
        values = rng.integers(0, 100, n)
        kn = cell["nulls"] and cell["axis"] == "key"
        vn = cell["nulls"] and cell["axis"] == "value"
        return {"t": pa.table({"k": _column(cell["key"], keys, kn, rng),
                               "v": _column(cell["value"], values, vn, rng)})}
    if cell["op"] == "sort":
        return {"t": pa.table({"k": _column(cell["key"], rng.integers(0, rows, n), cell["nulls"],
                                            rng), "v": pa.array(np.arange(lo, hi))})}
    right = RIGHT[cell["right"]](rows)
    distinct = max(1, right // 4) if cell["repeated"] else right
    left = pa.table({"k": _column(cell["key"], rng.integers(0, int(distinct * 1.2), n),
                                  cell["nulls"], rng), "a": pa.array(np.arange(lo, hi))})
    rlo, rhi = right * rank // ranks, right * (rank + 1) // ranks
    rkeys = np.arange(rlo, rhi) % distinct
    return {"t": left, "r": pa.table({"k": _column(cell["key"], rkeys, cell["nulls"], rng),
                                      "b": pa.array(rkeys * 2)})}


AGGS = ["sum", "mean", "min", "max", "count"]


def _canonical(table) -> list:
    import math
    rows = []
    for row in table.to_pylist():
        rows.append(tuple((round(v, 6) if isinstance(v, float) and not math.isnan(v) else v)
                          for v in row.values()))
    return sorted(rows, key=repr)


def polars_query(cell: dict, t, r=None):
    import polars as pl
    if cell["op"] == "groupby":
        by = pl.col("k").cast(pl.String) if cell["key"] == "dictionary" else pl.col("k")
        if cell["axis"] == "value":   # sums at 64 bits, of no value null (hetflow's rules)
            v = pl.col("v").cast(pl.Float64) if "float" in cell["value"] else pl.col("v")
            return t.group_by(by).agg(pl.when(v.count() > 0).then(v.sum()).alias("sum"),
                                      v.mean().alias("mean"),
                                      v.min().alias("min"), v.max().alias("max"),
                                      v.count().alias("count"))
        return t.group_by(by).agg(pl.col("v").sum())
    if cell["op"] == "join":
        return t.join(r, on="k")
    return t.sort("k", nulls_last=True)


def duckdb_query(cell: dict, con):
    if cell["op"] == "groupby":
        if cell["axis"] == "value":
            sql = "SELECT k, sum(v), avg(v), min(v), max(v), count(v) FROM t GROUP BY k"
        else:
            sql = "SELECT k, sum(v) FROM t GROUP BY k"
    elif cell["op"] == "join":
        sql = "SELECT t.k, a, b FROM t JOIN r ON t.k = r.k"
    else:
        sql = "SELECT * FROM t ORDER BY k NULLS LAST"
    res = con.sql(sql)
    return (getattr(res, "to_arrow_table", None) or res.arrow)()


def hetflow_query(cell: dict, comm, parts: dict):
    from hetflow import frame
    t = frame.from_local(comm, parts["t"])
    if cell["op"] == "groupby":
        spec = {"v": AGGS if cell["axis"] == "value" else "sum"}
        return t.groupby("k").agg(spec)
    if cell["op"] == "join":
        return frame.join(t, frame.from_local(comm, parts["r"]), on="k")
    return frame.sort(t, "k")


def _equal(cell: dict, got, t, r) -> bool:
    import polars as pl
    expected = polars_query(cell, pl.from_arrow(t), None if r is None else pl.from_arrow(r))
    return _same(cell, got, expected.to_arrow())


def _same(cell: dict, got, expected) -> bool:
    """Whether an engine's result ``got`` equals polars' ``expected`` (rows in any order,
    floats to 6 decimals; a sort by its keys' order, ties in any order)."""
    import pyarrow as pa
    if pa.types.is_dictionary(got.schema.field("k").type):
        got = got.set_column(0, "k", got.column("k").cast(pa.string()))
    if cell["op"] == "sort":
        return got.column("k").to_pylist() == expected.column("k").to_pylist()
    return _canonical(got) == _canonical(expected.rename_columns(got.column_names))


def hetflow_worker(args) -> None:
    import pyarrow as pa
    from mpi4py import MPI

    from hetflow import frame
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    out = {}
    first = cells(args.rows, args.select)[:1]
    for cell in first + cells(args.rows, args.select):   # the first once untimed (imports)
        parts = tables(cell, args.rows, rank, size)
        if first:
            hetflow_query(cell, comm, parts)
            first = None
            continue
        frame.barrier(comm)
        t0 = time.perf_counter()
        result = hetflow_query(cell, comm, parts)
        frame.barrier(comm)
        seconds = time.perf_counter() - t0
        got = result.gather() if args.check else None
        if rank == 0 and not args.check:
            out[name(cell)] = (seconds, True)
        elif rank == 0:
            whole = [pa.concat_tables([tables(cell, args.rows, q, size)[s] for q in range(size)])
                     for s in ("t", "r") if s in parts]
            out[name(cell)] = (seconds, _equal(cell, got, whole[0],
                                               whole[1] if len(whole) > 1 else None))
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)


def peer_worker(args) -> None:
    import duckdb
    import polars as pl
    con = duckdb.connect()
    con.execute(f"SET threads={args.threads}")
    out = {}
    first = cells(args.rows, args.select)[:1]
    for cell in first + cells(args.rows, args.select):   # the first once untimed (imports)
        parts = tables(cell, args.rows, 0, 1)
        t, r = parts["t"], parts.get("r")
        pt, pr = pl.from_arrow(t), None if r is None else pl.from_arrow(r)
        t0 = time.perf_counter()
        expected = polars_query(cell, pt, pr)
        p = time.perf_counter() - t0
        con.register("t", t)
        if r is not None:
            con.register("r", r)
        t0 = time.perf_counter()
        got = duckdb_query(cell, con)
        d = time.perf_counter() - t0
        if first:
            first = None
            continue
        out[name(cell)] = (p, d, _same(cell, got, expected.to_arrow()))
    with open(args.out, "w") as fh:
        json.dump(out, fh)


def _job(args, what: str, n: int, check: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="hetflow-matrix-") as tmp:
        out = os.path.join(tmp, "out.json")
        common = [_SELF, "--worker", what, "--rows", str(args.rows), "--out", out,
                  "--select", args.select] + (
            ["--check"] if check else [])
        if what == "hetflow":
            from hetflow.experiments.bench_engine import _mpiexec
            cmd = [_mpiexec(), "-n", str(n), sys.executable] + common
            env = dict(os.environ, OMP_NUM_THREADS="1", POLARS_MAX_THREADS="1")
        else:
            cmd = [sys.executable] + common + ["--threads", str(n)]
            env = dict(os.environ, POLARS_MAX_THREADS=str(n))
        subprocess.run(cmd, check=True, env=env, timeout=args.timeout)
        with open(out) as fh:
            return json.load(fh)


def _stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help=f"every cell checked at {QUICK['rows']:,} rows in {QUICK['rounds']} "
                         "round (its times are not evidence)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json")
    ap.add_argument("--select", default="", help="only the cells whose name this regular expression finds")
    ap.add_argument("--worker", choices=["hetflow", "peers"], help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = QUICK["rows"], QUICK["rounds"]
    if args.worker == "hetflow":
        hetflow_worker(args)
        return 0
    if args.worker == "peers":
        peer_worker(args)
        return 0
    runs: Dict[str, list] = {}
    loads = []
    for i in range(args.rounds):   # results compared in the first round (untimed)
        for n in (1, 2):
            loads.append(os.getloadavg()[0])
            runs.setdefault(f"hetflow{n}", []).append(_job(args, "hetflow", n, i == 0))
            runs.setdefault(f"peers{n}", []).append(_job(args, "peers", n, i == 0))
    rows, bad = [], 0
    print(f"# matrix: {args.rows} rows, n={args.rounds} interleaved rounds, load "
          f"{min(loads):.1f}-{max(loads):.1f}; seconds median [min-max]; ratio = hetflow / "
          "faster peer on as many threads as ranks")
    print(f"{'cell':<62} {'h1':>7} {'h2':>7} {'pl1':>7} {'dd1':>7} {'pl2':>7} {'dd2':>7} "
          f"{'r1':>5} {'r2':>5} eq")
    for cell in cells(args.rows, args.select):
        key = name(cell)
        h = {n: _stats([r[key][0] for r in runs[f"hetflow{n}"]]) for n in (1, 2)}
        pol = {n: _stats([r[key][0] for r in runs[f"peers{n}"]]) for n in (1, 2)}
        duck = {n: _stats([r[key][1] for r in runs[f"peers{n}"]]) for n in (1, 2)}
        equal = all(r[key][1] for n in (1, 2) for r in runs[f"hetflow{n}"]) and \
            all(r[key][2] for n in (1, 2) for r in runs[f"peers{n}"])
        bad += not equal
        ratio = {n: h[n][0] / min(pol[n][0], duck[n][0]) for n in (1, 2)}
        rows.append(dict(cell=cell, name=key, hetflow=h, polars=pol, duckdb=duck, ratio=ratio,
                         equal=equal))
        print(f"{key:<62} {h[1][0]:7.3f} {h[2][0]:7.3f} {pol[1][0]:7.3f} {duck[1][0]:7.3f} "
              f"{pol[2][0]:7.3f} {duck[2][0]:7.3f} {ratio[1]:5.2f} {ratio[2]:5.2f} "
              f"{'yes' if equal else 'NO'}")
    _neighbours(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": args.rows, "rounds": args.rounds, "load": [min(loads), max(loads)],
                       "cells": rows}, fh, indent=1)
    return 1 if bad else 0


def _neighbours(rows: List[dict]) -> None:
    """Cells whose hetflow time (2 ranks) is over 2x a neighbour's with the next wider or
    narrower type of the same axis (int8 < int16 < ... ; float32 < float64)."""
    order = [INTS[:4], INTS[4:], ["float32", "float64"], ["string", "large_string"]]
    by = {r["name"]: r for r in rows}
    worst = []
    for r in rows:
        c = r["cell"]
        field = "value" if c["op"] == "groupby" and c.get("axis") == "value" else "key"
        for seq in order:
            if c[field] in seq and seq.index(c[field]) + 1 < len(seq):
                other = by.get(name(dict(c, **{field: seq[seq.index(c[field]) + 1]})))
                if other:
                    a, b = r["hetflow"][2][0], other["hetflow"][2][0]
                    worst.append((max(a, b) / min(a, b), r["name"], other["name"]))
    worst.sort(reverse=True)
    over = [w for w in worst if w[0] > 2]
    print(f"# neighbours (2 ranks): {len(worst)} pairs, {len(over)} over 2x; largest: " +
          "; ".join(f"{w[0]:.2f}x {w[1]} / {w[2].split()[2]}" for w in worst[:3]))


if __name__ == "__main__":
    sys.exit(main())
