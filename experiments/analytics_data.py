"""The analytics benchmark's queries and data (:mod:`hetflow.experiments.analytics` runs them):
every process builds exactly the rows it holds, block by seeded block, so the hetflow ranks and
the peers see the same tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

#: Rows generated per seeded block: any process builds any row range of the same table.
BLOCK = 1 << 18
SEED = 36
#: The measures every group-by aggregates, and the aggregations (hetflow's names).
MEASURES = ("v_int", "v_float")
AGGS = ("sum", "mean", "count", "min", "max")
KEYS6 = ("id_lo", "cat", "flag", "dow", "year", "k10")


@dataclass(frozen=True)
class Query:
    """One query: a group-by (``by``) or a join (``key``, ``right_rows``, ``how``). A group-by
    aggregates ``aggs`` (``(column, function)``, hetflow's names; ``nlargest_2`` the two largest
    values), every one of :data:`AGGS` of both :data:`MEASURES` where empty; ``table`` names
    the table it reads (:data:`TABLES`)."""

    name: str
    by: Tuple[str, ...] = ()
    key: str = ""
    right_rows: int = 0      # at the full 10M-row scale; scaled with the big table's rows
    how: str = "inner"
    aggs: Tuple[Tuple[str, str], ...] = ()
    table: str = "facts"

    @property
    def columns(self) -> Tuple[Tuple[str, str], ...]:
        """The ``(column, function)`` pairs the group-by computes."""
        return self.aggs or tuple((m, a) for m in MEASURES for a in AGGS)

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
    return out + HELD_OUT


#: Issue 41's held-out group-bys, the public group-by benchmark's shapes (:func:`groups`: int32
#: values ``v1``/``v2``, a float64 ``v3``; keys of 100 and rows/100 values, strings and int32).
HELD_OUT = [
    Query("mean v1, v2, v3 by id4 (100, int32)", by=("id4",), table="groups",
          aggs=(("v1", "mean"), ("v2", "mean"), ("v3", "mean"))),
    Query("sum v1 by id1 (100, string)", by=("id1",), table="groups", aggs=(("v1", "sum"),)),
    Query("sums v1, v2, v3 by id6 (rows/100, int32)", by=("id6",), table="groups",
          aggs=(("v1", "sum"), ("v2", "sum"), ("v3", "sum"))),
    Query("median, std v3 by id4, id5 (int32)", by=("id4", "id5"), table="groups",
          aggs=(("v3", "median"), ("v3", "std"))),
    Query("top 2 v3 by id6 (rows/100, int32)", by=("id6",), table="groups",
          aggs=(("v3", "nlargest_2"),)),
    Query("sum v3, count v1 by 6 keys", by=("id1", "id2", "id3", "id4", "id5", "id6"),
          table="groups", aggs=(("v3", "sum"), ("v1", "count"))),
]


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


def _groups_block(b: int, rows: int):
    """The held-out group-bys' table (the public group-by benchmark's columns): ids ``id1``,
    ``id2`` (100 strings each), ``id3`` (rows/100 strings), ``id4``, ``id5`` (100 int32s each),
    ``id6`` (rows/100 int32s); int32 values ``v1`` in 1..5 and ``v2`` in 1..15, a float64
    ``v3`` in [0, 100) to six decimals; no nulls."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = min(BLOCK, rows - b * BLOCK)
    rng = np.random.default_rng([SEED, 41, b])
    many = max(1, rows // 100)

    def ids(prefix, card):
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(rng.integers(1, card + 1, n)),
                                                           pa.string()), "")

    def ints(low, high):
        return pa.array(rng.integers(low, high + 1, n).astype(np.int32))

    return pa.table({"id1": ids("id", 100), "id2": ids("id", 100), "id3": ids("id", many),
                     "id4": ints(1, 100), "id5": ints(1, 100), "id6": ints(1, many),
                     "v1": ints(1, 5), "v2": ints(1, 15),
                     "v3": pa.array(np.round(rng.random(n) * 100, 6))})


#: The big tables by name: each builds any row range of itself in any process.
TABLES = {"facts": _block, "groups": _groups_block}


def facts(rows: int, start: int = 0, stop: Optional[int] = None, table: str = "facts"):
    """Rows ``[start, stop)`` of the big table ``table`` of ``rows`` rows (the same in every
    process)."""
    import pyarrow as pa

    block = TABLES[table]
    stop = rows if stop is None else stop
    blocks = range(start // BLOCK, (stop + BLOCK - 1) // BLOCK) if stop > start else range(0)
    parts = [block(b, rows) for b in blocks]
    if not parts:
        return block(0, rows).slice(0, 0)
    out = pa.concat_tables(parts)
    first = blocks[0] * BLOCK
    return out.slice(start - first, stop - start).combine_chunks()


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


def span(n: int, rank: int, size: int) -> Tuple[int, int]:
    return n * rank // size, n * (rank + 1) // size
