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
with each right-hand table on the integer and the string key, inner and left.

Each engine runs in a process of its own (so its peak memory is its own): hetflow on R ranks of
an MPI task (:func:`hetflow_task`), polars and DuckDB limited to R threads
(``python -m hetflow.experiments.analytics '{json}'``). A query's time is the median of
``repeats`` runs (hetflow: ``barrier; t0; query; barrier; t1``); its peak is the process's
peak resident set during the query's first run (Linux's ``VmHWM``, reset before it). A
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
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hetflow.experiments.bench_engine import peak_rss_mib, reset_peak, rss_mib

#: Rows generated per seeded block: any process builds any row range of the same table.
BLOCK = 1 << 18
SEED = 36
#: The measures every group-by aggregates, and the aggregations (hetflow's names).
MEASURES = ("v_int", "v_float")
AGGS = ("sum", "mean", "count", "min", "max")
KEYS6 = ("id_lo", "cat", "flag", "dow", "year", "k10")


@dataclass(frozen=True)
class Query:
    """One query: a group-by (``by``) or a join (``key``, ``right_rows``, ``how``)."""

    name: str
    by: Tuple[str, ...] = ()
    key: str = ""
    right_rows: int = 0      # at the full 10M-row scale; scaled with the big table's rows
    how: str = "inner"

    @property
    def is_join(self) -> bool:
        return bool(self.key)


def _queries() -> List[Query]:
    out = [Query("groupby id_lo (100)", by=("id_lo",)),
           Query("groupby id_hi (100k)", by=("id_hi",)),
           Query("groupby cat, id_hi", by=("cat", "id_hi")),
           Query("groupby 6 keys", by=KEYS6)]
    for size, label in ((10, "10"), (10_000, "10k"), (10_000_000, "10m")):
        for kind, prefix in (("int", "k"), ("str", "s")):
            for how in ("inner", "left"):
                out.append(Query(f"{how} join {label} rows, {kind} key", key=prefix + label,
                                 right_rows=size, how=how))
    return out


QUERIES = _queries()
FULL_ROWS = 10_000_000


def right_rows(query: Query, rows: int) -> int:
    """The right-hand table's rows for a big table of ``rows``: 10 and 10k stay, 10M scales."""
    return query.right_rows if query.right_rows < FULL_ROWS else max(1, rows * query.right_rows // FULL_ROWS)


# --------------------------------------------------------------------------- data
def _block(b: int, rows: int):
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = min(BLOCK, rows - b * BLOCK)
    rng = np.random.default_rng([SEED, b])

    def ids(prefix, card):
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(rng.integers(0, card, n)),
                                                           pa.string()), "")

    def key(card):
        k = rng.integers(0, card, n)
        return pa.array(k), pc.binary_join_element_wise("s", pc.cast(pa.array(k), pa.string()), "")

    k10, s10 = key(12)
    k10k, s10k = key(12_000)
    k10m, s10m = key(max(12, rows * 12 // 10))
    cats = pa.array(["north", "south", "east", "west", "centre"])
    v_int = rng.integers(-1_000, 1_000_000, n)
    v_float = rng.normal(100.0, 50.0, n)
    return pa.table({
        "id_lo": ids("lo", 100), "id_hi": ids("hi", 100_000),
        "k10": k10, "s10": s10, "k10k": k10k, "s10k": s10k, "k10m": k10m, "s10m": s10m,
        "cat": cats.take(pa.array(rng.integers(0, 5, n))),
        "flag": pa.array(rng.random(n) < 0.3),
        "dow": pa.array(rng.integers(0, 7, n).astype(np.int8)),
        "year": pa.array(rng.integers(2020, 2023, n).astype(np.int16)),
        "v_int": pa.array(v_int, mask=rng.random(n) < 0.05),
        "v_float": pa.array(v_float, mask=rng.random(n) < 0.05),
    })


def facts(rows: int, start: int = 0, stop: Optional[int] = None):
    """Rows ``[start, stop)`` of the big table of ``rows`` rows (the same in every process)."""
    import pyarrow as pa

    stop = rows if stop is None else stop
    blocks = range(start // BLOCK, (stop + BLOCK - 1) // BLOCK) if stop > start else range(0)
    parts = [_block(b, rows) for b in blocks]
    if not parts:
        return _block(0, rows).slice(0, 0)
    table = pa.concat_tables(parts)
    first = blocks[0] * BLOCK
    return table.slice(start - first, stop - start).combine_chunks()


def dimension(query: Query, rows: int, start: int = 0, stop: Optional[int] = None):
    """Rows ``[start, stop)`` of the query's right-hand table: unique keys 0..n-1 in a seeded
    order (the string key ``s<k>``), a float and a string payload."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = right_rows(query, rows)
    stop = n if stop is None else stop
    keys = np.random.default_rng([SEED, 7, n]).permutation(n)[start:stop]
    key = pa.array(keys)
    if query.key.startswith("s"):
        key = pc.binary_join_element_wise("s", pc.cast(key, pa.string()), "")
    return pa.table({query.key: key, "w": pa.array(keys * 0.5 + 1.0),
                     "label": pc.binary_join_element_wise("d", pc.cast(pa.array(keys % 997),
                                                                       pa.string()), "")})


def left_columns(query: Query) -> List[str]:
    return [query.key, *MEASURES]


def _span(n: int, rank: int, size: int) -> Tuple[int, int]:
    return n * rank // size, n * (rank + 1) // size


# --------------------------------------------------------------------------- checks
def digest(table) -> List[int]:
    """Row count and two order-independent sums of per-row hashes over every column (by name,
    in sorted order; integers by value whatever their width, strings by their bytes, nulls
    alike): equal tables give equal digests whatever their row order or partitioning."""
    import numpy as np
    from hetflow.frame import _hash

    names = sorted(table.column_names)
    h = _hash.hash_rows(np, table.select(names), names) if names else np.zeros(0, np.uint64)
    second = _hash.mix(np, h.copy() ^ np.uint64(0x5bd1e995))
    return [int(table.num_rows), int(h.sum(dtype=np.uint64)), int(second.sum(dtype=np.uint64))]


def combine_digests(digests: Sequence[Sequence[int]]) -> List[int]:
    """The digest of the concatenation of tables with these digests."""
    mask = (1 << 64) - 1
    return [sum(d[0] for d in digests), sum(d[1] for d in digests) & mask,
            sum(d[2] for d in digests) & mask]


def canonical(table, query: Query):
    """A group-by result with the engines' type differences taken out (int widths, string
    layouts, decimal sums), sorted by its keys."""
    import pyarrow as pa

    cols, names = [], []
    for name in table.column_names:
        col = table.column(name)
        t = col.type
        if pa.types.is_integer(t) or pa.types.is_decimal(t):
            col = col.cast(pa.int64())
        elif pa.types.is_floating(t):
            col = col.cast(pa.float64())
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view":
            col = col.cast(pa.large_string())
        cols.append(col)
        names.append(name)
    out = pa.table(cols, names=names)
    return out.sort_by([(k, "ascending") for k in query.by])


def compare(reference, other, query: Query) -> Optional[str]:
    """None when two group-by results are equal (floats to a relative 1e-9), else what differs."""
    import numpy as np

    a, b = canonical(reference, query), canonical(other, query)
    if sorted(a.column_names) != sorted(b.column_names):
        return f"columns {sorted(b.column_names)} != {sorted(a.column_names)}"
    if a.num_rows != b.num_rows:
        return f"{b.num_rows} rows != {a.num_rows}"
    for name in a.column_names:
        x, y = a.column(name), b.column(name)
        if x.null_count != y.null_count or not x.is_valid().equals(y.is_valid()):
            return f"column {name}: nulls differ"
        if x.type == y.type and x.type.id == 12:  # float64: tolerance
            xv = x.to_numpy(zero_copy_only=False)
            yv = y.to_numpy(zero_copy_only=False)
            ok = np.isnan(xv) & np.isnan(yv) | np.isclose(xv, yv, rtol=1e-9, atol=1e-9)
            if not ok.all():
                i = int(np.argmin(ok))
                return f"column {name}: row {i}: {yv[i]!r} != {xv[i]!r}"
        elif not x.equals(y):
            return f"column {name}: values differ"
    return None


# --------------------------------------------------------------------------- memory


def _timed(run, repeats: int, barrier=None):
    """(median seconds, peak MiB of the first run, resident MiB before it, result of the last)."""
    times, peak, before, out = [], 0.0, 0.0, None
    for i in range(repeats):
        out = None
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
    return statistics.median(times), peak, before, out


# --------------------------------------------------------------------------- hetflow
def hetflow_task(comm, rows: int, repeats: int, out_dir: str, queries: Sequence[str] = (),
                 tag: str = "hetflow") -> dict:
    """Every query on this MPI task's ranks: rank 0 returns ``{query: record}`` (the other
    ranks ``{}``) and writes the group-by results to ``out_dir/<tag>-<i>.arrow``."""
    from hetflow import frame
    from hetflow.frame import barrier

    from hetflow.frame import _backend

    rank, size = comm.Get_rank(), comm.Get_size()
    # the engine's thread and allocator settings before the data is built (its first
    # operation would make them), so the partition lives where the queries' buffers will
    _backend.configure_threads(comm)
    t0 = time.perf_counter()
    big = facts(rows, *_span(rows, rank, size))
    gen_s = time.perf_counter() - t0
    _release_free_heap()
    table = frame.from_local(comm, big)
    frame.groupby(frame.from_local(comm, big.slice(0, 10)), "id_lo").agg({"v_int": "sum"})
    records = {}
    for i, q in enumerate(QUERIES):
        if queries and q.name not in queries:
            continue
        right_local = left = right = run = None
        _release_free_heap()  # the previous query's leftovers are not this one's baseline
        if q.is_join:
            n = right_rows(q, rows)
            right_local = dimension(q, rows, *_span(n, rank, size))
            left = frame.from_local(comm, big.select(left_columns(q)))
            right = frame.from_local(comm, right_local)
            run = lambda left=left, right=right, q=q: frame.join(left, right, on=q.key, how=q.how)  # noqa: E731
        else:
            spec = {m: list(AGGS) for m in MEASURES}
            run = lambda q=q, spec=spec: table.groupby(list(q.by)).agg(spec)  # noqa: E731
        seconds, peak, before, out = _timed(run, repeats, lambda: barrier(comm))
        partition = big.nbytes + (right_local.nbytes if right_local is not None else 0)
        mine = {"peak_mb": peak, "before_mb": before, "partition_mb": partition / 2**20,
                "rows_out": out.local.num_rows, "backend": out.backend}
        if q.is_join:
            mine["digest"] = digest(out.local)
        else:
            gathered = out.gather()
            if rank == 0:
                _write(gathered, os.path.join(out_dir, f"{tag}-{i}.arrow"))
        del out
        every = comm.gather(mine, root=0)
        if rank == 0:
            worst = max(every, key=lambda m: m["peak_mb"] / max(m["partition_mb"], 1e-9))
            records[q.name] = {
                "op_s": seconds, "peak_rss_mb": max(m["peak_mb"] for m in every),
                "peak_over_partition": worst["peak_mb"] / max(worst["partition_mb"], 1e-9),
                "partition_mb": max(m["partition_mb"] for m in every),
                "rss_before_mb": max(m["before_mb"] for m in every),
                "rows_out": sum(m["rows_out"] for m in every), "engine_path": every[0]["backend"],
                "digest": combine_digests([m["digest"] for m in every]) if q.is_join else None,
                "gen_s": gen_s}
    return records if rank == 0 else {}


def _release_free_heap() -> None:
    """Hand the heap the data's construction freed back to the OS (glibc's ``malloc_trim``),
    so a query's peak counts the data and the query, not the generator's leftovers."""
    import ctypes
    import gc

    from hetflow.frame._backend import libc_function

    gc.collect()
    trim = libc_function("malloc_trim", ctypes.c_int, [ctypes.c_size_t])
    if trim is not None:
        trim(0)


def _write(table, path: str) -> None:
    import pyarrow as pa

    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def read_result(path: str):
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return pa.ipc.open_file(source).read_all()


# --------------------------------------------------------------------------- peers
def _agg_name(col: str, agg: str) -> str:
    return f"{col}_{agg}"


def _polars(big, threads: int):
    import polars as pl

    df = pl.from_arrow(big)

    def groupby(q):
        exprs = []
        for m in MEASURES:
            c = pl.col(m)
            exprs += [c.sum().alias(_agg_name(m, "sum")), c.mean().alias(_agg_name(m, "mean")),
                      c.count().alias(_agg_name(m, "count")), c.min().alias(_agg_name(m, "min")),
                      c.max().alias(_agg_name(m, "max"))]
        # polars' sum of an all-null group is 0; SQL's (and hetflow's) is null
        return lambda: df.group_by(list(q.by)).agg(exprs + [
            c.count().alias(f"__n_{m}") for m, c in ((m, pl.col(m)) for m in MEASURES)])

    def join(q, right):
        left = df.select(left_columns(q))
        rf = pl.from_arrow(right)
        return lambda: left.join(rf, on=q.key, how=q.how)

    def to_arrow(q, out):
        if not q.is_join:
            out = out.with_columns([
                pl.when(pl.col(f"__n_{m}") > 0).then(pl.col(_agg_name(m, "sum"))).otherwise(None)
                .alias(_agg_name(m, "sum")) for m in MEASURES]).drop([f"__n_{m}" for m in MEASURES])
        return out.to_arrow()

    return groupby, join, to_arrow


def _duckdb(big, threads: int):
    import duckdb

    con = duckdb.connect(config={"threads": threads})
    con.register("facts", big)

    def groupby(q):
        keys = ", ".join(q.by)
        aggs = []
        for m in MEASURES:
            aggs += [f"SUM({m})::BIGINT AS {m}_sum" if m == "v_int" else f"SUM({m}) AS {m}_sum",
                     f"AVG({m}) AS {m}_mean", f"COUNT({m}) AS {m}_count",
                     f"MIN({m}) AS {m}_min", f"MAX({m}) AS {m}_max"]
        sql = f"SELECT {keys}, {', '.join(aggs)} FROM facts GROUP BY {keys}"
        return lambda: con.sql(sql).to_arrow_table()

    def join(q, right):
        con.register("dim", right)
        cols = ", ".join(left_columns(q)[1:])
        kind = "LEFT JOIN" if q.how == "left" else "JOIN"
        sql = (f"SELECT {q.key}, {cols}, w, label FROM (SELECT {q.key}, {cols} FROM facts) f "
               f"{kind} dim USING ({q.key})")
        return lambda: con.sql(sql).to_arrow_table()

    return groupby, join, lambda q, out: out


PEERS = {"polars": _polars, "duckdb": _duckdb}


def peer_run(engine: str, rows: int, repeats: int, out_dir: str, threads: int = 2,
             queries: Sequence[str] = ()) -> dict:
    """Every query in ``engine`` (polars or duckdb) on ``threads`` threads: ``{query: record}``."""
    if engine not in PEERS:
        raise ValueError(f"unknown peer {engine!r}; expected one of {sorted(PEERS)}")
    t0 = time.perf_counter()
    big = facts(rows)
    gen_s = time.perf_counter() - t0
    groupby, join, to_arrow = PEERS[engine](big, threads)
    records = {}
    for i, q in enumerate(QUERIES):
        if queries and q.name not in queries:
            continue
        right = dimension(q, rows) if q.is_join else None
        run = join(q, right) if q.is_join else groupby(q)
        seconds, peak, before, out = _timed(run, repeats)
        result = to_arrow(q, out)
        del out
        partition = big.nbytes + (right.nbytes if right is not None else 0)
        records[q.name] = {"op_s": seconds, "peak_rss_mb": peak, "rss_before_mb": before,
                           "partition_mb": partition / 2**20,
                           "peak_over_partition": peak / (partition / 2**20),
                           "rows_out": result.num_rows, "gen_s": gen_s,
                           "digest": digest(result) if q.is_join else None}
        if not q.is_join:
            _write(result, os.path.join(out_dir, f"{engine}-{i}.arrow"))
    return records


def peer_environment(threads: int) -> Dict[str, str]:
    """The environment a peer process runs in: its thread pools capped at ``threads``."""
    env = dict(os.environ)
    env.update(POLARS_MAX_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               RAYON_NUM_THREADS=str(threads))
    return env


def check(records: Dict[str, dict], out_dir: str, reference: str) -> Dict[str, Dict[str, Optional[str]]]:
    """``{engine: {query: None or what differs from the reference engine}}``."""
    out: Dict[str, Dict[str, Optional[str]]] = {}
    index = {q.name: (i, q) for i, q in enumerate(QUERIES)}
    for engine, recs in records.items():
        out[engine] = {}
        for name, rec in recs.items():
            i, q = index[name]
            ref = records.get(reference, {}).get(name)
            if ref is None:
                out[engine][name] = f"no {reference} result to compare with"
            elif q.is_join:
                out[engine][name] = (None if rec["digest"] == ref["digest"] else
                                     f"digest {rec['digest']} != {reference}'s {ref['digest']}")
            else:
                out[engine][name] = compare(read_result(os.path.join(out_dir, f"{reference}-{i}.arrow")),
                                            read_result(os.path.join(out_dir, f"{engine}-{i}.arrow")), q)
    return out


def main(argv=None) -> int:
    """``python -m hetflow.experiments.analytics '{"engine": ..., "rows": N, ...}'``: one peer's
    records as a ``HETFLOW_BENCH {json}`` line."""
    args = json.loads((argv or sys.argv[1:])[0])
    print("HETFLOW_BENCH " + json.dumps(peer_run(**args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
