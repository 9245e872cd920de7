"""frame._groupcodes, the dense-code group-by kernel, against Arrow's hash aggregation on one
process: the same groups, values, nulls and types for every key type it encodes (nulls, NaN,
-0.0), every way it numbers the groups (every slot used, a few slots used, mostly used, the
combined codes re-encoded, 64-bit codes), by slices of rows and whole, and None where it does
not apply."""
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from hetflow.frame import _groupcodes
from hetflow.frame._groupby import group_by

FUNCS = ("sum", "min", "max", "count", "size")


def arrow_result(keys, columns):
    names = [f"__k{i}" for i in range(len(keys))]
    sizes = {f"{c}__size": col for c, col in columns.items()}   # a size is Arrow's count too
    table = pa.table(list(keys) + list(columns.values()) + list(sizes.values()),
                     names=names + list(columns) + list(sizes))
    requests = [(f"{c}__size", "count", pc.CountOptions(mode="all")) if f == "size" else (c, f)
                for c in columns for f in FUNCS]
    out = group_by(table, names).aggregate(requests)   # one thread (pyarrow < 12: its own)
    return out.select(names + [f"{r[0]}_{r[1]}" for r in requests])


def ours(keys, columns):
    return _groupcodes.aggregate(keys, [(f"{c}_{f}", f, col) for c, col in columns.items()
                                        for f in FUNCS])


def same(got: pa.Table, expected: pa.Table):
    assert got is not None
    assert got.num_rows == expected.num_rows
    keys = [n for n in got.column_names if n.startswith("__k")]
    order = [(k, "ascending") for k in keys]
    a = got.rename_columns(expected.column_names).sort_by(order)
    b = expected.sort_by(order)
    assert a.schema == b.schema
    for name in a.column_names:
        x, y = a.column(name), b.column(name)
        assert x.is_valid().equals(y.is_valid()), name
        if pa.types.is_floating(x.type) and not name.startswith("__k"):
            xs = np.array(x.to_pylist(), dtype=float)   # nulls as NaN, valid bits checked above
            assert np.allclose(xs, np.array(y.to_pylist(), dtype=float), rtol=1e-12,
                               equal_nan=True), name
        else:   # NaN keys: compared by their repr
            assert [repr(v) for v in x.to_pylist()] == [repr(v) for v in y.to_pylist()], name


def values(rng, n):
    null = rng.random(n) < 0.2
    return {"i8": pa.array(rng.integers(-100, 100, n).astype(np.int8), mask=null),
            "u16": pa.array(rng.integers(0, 60000, n).astype(np.uint16)),
            "i64": pa.array(rng.integers(-2**40, 2**40, n), mask=rng.random(n) < 0.5),
            "f32": pa.array(rng.normal(size=n).astype(np.float32), mask=null),
            "f64": pa.array(rng.normal(size=n))}


def string_key(rng, n, card, null_rate=0.1):
    return pa.array([f"s{i}" for i in rng.integers(0, card, n)],
                    mask=rng.random(n) < null_rate)


@pytest.mark.parametrize("slice_rows, sliced_groups", [(_groupcodes.SLICE, _groupcodes.SLICED_GROUPS),
                                                       (7, 1 << 20), (7, 0)])
@pytest.mark.parametrize("n", [1, 7, 2000])
def test_every_key_type_with_nulls(n, slice_rows, sliced_groups, monkeypatch):
    # the reductions by slices of rows (several, with a short last one), and whole
    monkeypatch.setattr(_groupcodes, "SLICE", slice_rows)
    monkeypatch.setattr(_groupcodes, "SLICED_GROUPS", sliced_groups)
    rng = np.random.default_rng(n)
    fk = np.round(rng.normal(size=n))
    fk[rng.random(n) < 0.1] = np.nan
    fk[rng.random(n) < 0.1] = -0.0
    keysets = [
        [string_key(rng, n, 30)],
        [pa.array(rng.integers(-3, 3, n), mask=rng.random(n) < 0.1)],
        [pc.add(pa.array(fk, mask=rng.random(n) < 0.1), 0.0)],   # -0.0 made 0.0, as by_arrow does
        [pa.array(rng.random(n) < 0.5, mask=rng.random(n) < 0.1)],
        [pa.array(rng.integers(0, 40, n).astype("datetime64[s]")),
         pa.array([b"x%d" % i for i in rng.integers(0, 3, n)], pa.binary())],
        [string_key(rng, n, 4), pa.array(rng.integers(0, 5, n).astype(np.int8)),
         pa.array(rng.random(n) < 0.3)],
    ]
    for keys in keysets:
        cols = values(rng, n)
        same(ours(keys, cols), arrow_result(keys, cols))


def test_how_groups_are_numbered():
    rng = np.random.default_rng(5)
    n = 50_000
    a = rng.integers(0, 300, n)
    cols = values(rng, n)
    cases = {
        "every slot": [pa.array(rng.integers(0, 100, n)), pa.array(rng.integers(0, 7, n))],
        "few slots used": [pa.array(a), pa.array(a)],                      # 300 of 90,000
        "half the slots used": [pa.array(a % 200), pa.array(a % 2)],          # 200 of 400
        "re-encoded": [pa.array(rng.integers(0, n, n)), pa.array(rng.integers(0, n, n))],
        "64-bit codes": [pa.array(rng.integers(0, 50_000, n)),
                         pa.array(rng.integers(0, 50_000, n))],
    }
    for label, keys in cases.items():
        g = _groupcodes.codes(keys)
        assert g is not None, label
        if label == "every slot":
            assert g.present is None and g.slots == 700
        if label == "few slots used":
            assert g.present is None and g.slots == 300
        if label == "half the slots used":
            assert g.present is not None and g.slots == 400
        same(ours(keys, cols), arrow_result(keys, cols))


def test_does_not_apply():
    rng = np.random.default_rng(9)
    n = 100
    key = [pa.array(rng.integers(0, 5, n))]
    nan = pa.array(np.where(rng.random(n) < 0.5, np.nan, 1.0))
    # Arrow's min skips NaN: not NumPy's rule; a sum takes NaN as NumPy does
    assert _groupcodes.aggregate(key, [("m", "min", nan)]) is None
    assert _groupcodes.aggregate(key, [("m", "sum", nan)]) is not None
    assert _groupcodes.aggregate(key, [("m", "min", pa.array(["a"] * n))]) is None
    assert _groupcodes.aggregate(key, [("m", "sum", pa.array([True] * n))]) is None
    assert _groupcodes.aggregate([pa.array([[1]] * n)], [("m", "count", key[0])]) is None
    assert _groupcodes.aggregate([key[0].slice(0, 0)], [("m", "sum", key[0].slice(0, 0))]) is None
    # a non-numeric column is counted here
    assert _groupcodes.aggregate(key, [("m", "count", pa.array(["a", None] * 50))]) is not None
