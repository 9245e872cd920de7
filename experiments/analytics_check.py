"""The analytics benchmark's checks: group-by results written to Arrow files and compared
across engines after sorting by their keys (floats to a relative 1e-9), joins by an
order-independent digest (:func:`digest`) every engine must match exactly.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from hetflow.experiments.analytics_data import QUERIES, Query


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
        elif pa.types.is_list(t) or pa.types.is_large_list(t):   # top n: lists of values
            col = col.cast(pa.large_list(pa.float64()))
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


def write(table, path: str) -> None:
    import pyarrow as pa

    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def read_result(path: str):
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return pa.ipc.open_file(source).read_all()


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
