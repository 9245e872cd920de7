"""Distributed join == polars on the concatenated input, under real mpiexec -n 1, 2, 3."""
import pytest

from mpiutil import run_mpi

SCRIPT = r"""
import itertools, sys
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
from frame_cases import random_part, same_rows
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if sys.argv[1:] == ["mixed"]:
    # rank 0's partitions count as large (one column at a time), the others' as small (all in
    # one exchange): ranks on both sides of the bound must still take one path together
    from hetflow.frame import _prepare
    if rank == 0:
        _prepare.BATCH_BYTES = -1
PL_HOW = {"inner": "inner", "left": "left", "right": "right", "outer": "full"}
failures, checked = [], 0

def check(label, left_kw, right_kw, how, on=None, left_on=None, right_on=None, rename=None):
    global checked
    left = frame.from_local(comm, random_part(rank=rank, **left_kw))
    rpart = random_part(rank=rank, **right_kw)
    if rename:
        rpart = rpart.rename_columns([rename.get(c, c) for c in rpart.column_names])
    right = frame.from_local(comm, rpart)
    out = frame.join(left, right, on, how=how, left_on=left_on, right_on=right_on,
                     suffixes=("", "_right"))
    got = out.gather()
    assert out.backend == "cpu"
    if rank == 0:
        L = pa.concat_tables([random_part(rank=r, **left_kw) for r in range(size)])
        R = pa.concat_tables([random_part(rank=r, **right_kw) for r in range(size)])
        if rename:
            R = R.rename_columns([rename.get(c, c) for c in R.column_names])
        exp = pl.from_arrow(L).join(pl.from_arrow(R), on=on, left_on=left_on, right_on=right_on,
                                    how=PL_HOW[how], coalesce=True, suffix="_right").to_arrow()
        problem = same_rows(got, exp)
        if problem:
            failures.append(f"{label} how={how}: {problem}")
        checked += 1

for seed, how in itertools.product(range(4), ["inner", "left", "right", "outer"]):
    kw = dict(seed=seed, key_range=6 + seed * 5, extra=True)
    check(f"int key seed={seed}", dict(kw), dict(kw, seed=seed + 100), how, on="k")
    check(f"string key seed={seed}", dict(kw), dict(kw, seed=seed + 200), how, on="s")
    check(f"multi key seed={seed}", dict(kw), dict(kw, seed=seed + 300), how, on=["k", "s"])
    check(f"large_string+timestamp seed={seed}", dict(kw), dict(kw, seed=seed + 400), how,
          on=["ls", "ts"])
    check(f"bool+float key seed={seed}", dict(kw), dict(kw, seed=seed + 450), how, on=["b", "f"])
    check(f"left_on/right_on seed={seed}", dict(kw), dict(kw, seed=seed + 500), how,
          left_on=["k", "s"], right_on=["rk", "rs"], rename={"k": "rk", "s": "rs"})
    check(f"empty left seed={seed}", dict(kw, empty_ranks=range(size)), dict(kw, seed=seed + 600),
          how, on="k")
    check(f"empty right seed={seed}", dict(kw), dict(kw, seed=seed + 700, empty_ranks=range(size)),
          how, on="k")
    check(f"rank 0 empty, no nulls seed={seed}", dict(kw, empty_ranks=(0,), null_rate=0),
          dict(kw, seed=seed + 800, null_rate=0), how, on="k")
    check(f"int key no nulls (dense kernel) seed={seed}", dict(kw, null_rate=0, rows=50),
          dict(kw, seed=seed + 1000, null_rate=0, rows=40), how, on="k")
    check(f"sparse int key no nulls (sort-merge kernel) seed={seed}",
          dict(kw, null_rate=0, key_range=10**12), dict(kw, null_rate=0, key_range=10**12),
          how, on="k")
    check(f"timestamp key no nulls seed={seed}", dict(kw, null_rate=0),
          dict(kw, seed=seed + 1100, null_rate=0), how, on="ts")
    check(f"heavy duplicates seed={seed}", dict(kw, key_range=2, rows=40),
          dict(kw, seed=seed + 900, key_range=2, rows=30), how, on="k")
    # a right side this small is sent to every rank (inner, left) instead of shuffled
    check(f"small right, string key seed={seed}", dict(kw, rows=40),
          dict(kw, seed=seed + 1200, rows=2), how, on="s")
    check(f"small right, int key no nulls seed={seed}", dict(kw, rows=40, null_rate=0),
          dict(kw, seed=seed + 1300, rows=2, null_rate=0), how, on="k")

if size > 1:
    # the broadcast join leaves every left row on its rank
    lpart = random_part(seed=7, rank=rank, rows=50, key_range=5, null_rate=0)
    dim = pa.table({"k": pa.array(range(5) if rank == 0 else [], pa.int64()),
                    "name": pa.array([f"n{i}" for i in range(5)] if rank == 0 else [], pa.string())})
    out = frame.join(frame.from_local(comm, lpart), frame.from_local(comm, dim), on="k", how="left")
    stayed = sorted(out.local.column("v").to_pylist()) == sorted(lpart.column("v").to_pylist())
    if not comm.allreduce(stayed, op=MPI.LAND):
        failures.append("small right side: the left rows moved (not broadcast)")

mpiutil.report({"failures": failures, "checked": checked})
"""


@pytest.mark.parametrize("ranks,mode", [(1, "batched"), (2, "batched"), (3, "batched"),
                                        (2, "mixed")])
def test_join_matches_polars(ranks, mode):
    run = run_mpi(SCRIPT, ranks, timeout=240, args=[mode])
    reports = run.values(ranks)
    assert "Warning" not in run.stderr, run.stderr
    assert reports[0]["checked"] == 4 * 4 * 15
    assert reports[0]["failures"] == [], "\n".join(reports[0]["failures"][:10])


KEY_TYPES_SCRIPT = r"""
import numpy as np
import pyarrow as pa
from mpi4py import MPI
from frame_cases import PL_HOW, join_against_polars
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures, checked = [], 0

def part(seed, r, typ, low, high, rows):
    # int keys of ``typ`` in [low, high], the extremes included, plus payload columns
    rng = np.random.default_rng([seed, r])
    keys = rng.integers(low, high, rows, endpoint=True, dtype=np.int64 if low < 0 else np.uint64)
    keys[:2] = [low, high][:rows]
    return pa.Table.from_arrays([pa.array(keys, typ), pa.array(rng.normal(size=rows)),
                                 pa.array(rng.integers(0, 9, rows), pa.int16())],
                                names=["k", "x", "w"])

CASES = [  # (type, low, high): dense and wide ranges, signed extremes, unsigned beyond int64
    (pa.int8(), -128, 127), (pa.int32(), -5, 40), (pa.int32(), -2**31, 2**31 - 1),
    (pa.int64(), -2**63, 2**63 - 1), (pa.int64(), 10**12, 10**12 + 50),
    (pa.uint64(), 2**64 - 60, 2**64 - 1), (pa.uint64(), 0, 2**64 - 1), (pa.uint16(), 0, 30)]
for i, (typ, low, high) in enumerate(CASES):
    for how in PL_HOW:
        rows = lambda r: 0 if r == 1 else 25 + 7 * r  # rank 1 holds nothing
        L = [part(i, r, typ, low, high, rows(r)) for r in range(size)]
        R = [part(i + 100, r, typ, low, high, rows(r) + 3) for r in range(size)]
        # share some keys between the sides so that matches exist in the wide ranges
        R = [t.set_column(0, "k", pa.concat_arrays([L[r].column(0).chunk(0)[:10],
                                                      t.column(0).chunk(0)[10:]]))
             if L[r].num_rows >= 10 else t for r, t in enumerate(R)]
        problem = join_against_polars(comm, L, R, "k", how)
        if rank == 0:
            if problem:
                failures.append(f"{typ} [{low}, {high}] how={how}: {problem}")
            checked += 1
mpiutil.report({"failures": failures, "checked": checked})
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_join_integer_key_types(ranks):
    """Every integer key width, dense and wide key ranges, extreme values: the direct-address
    and sort-merge kernels agree with polars for all four join types."""
    run = run_mpi(KEY_TYPES_SCRIPT, ranks, timeout=180)
    reports = run.values(ranks)
    assert reports[0]["checked"] == 8 * 4
    assert reports[0]["failures"] == [], "\n".join(reports[0]["failures"][:10])


MODULAR_SCRIPT = r"""
import numpy as np
import pyarrow as pa
import polars as pl
from mpi4py import MPI
from hetflow import frame
from hetflow.frame import _hash, _intmatch
from frame_cases import same_rows
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures = []

# The local match with a stride == without one, for keys that share a remainder (one rank's
# keys under the modular partition): every integer width, negative keys, both extremes.
rng = np.random.default_rng(rank)
for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64):
    info = np.iinfo(dtype)
    for stride in (2, 3, 4, 5):
        for low, high in ((info.min, min(info.max, info.min + 300)),
                          (max(info.min, info.max - 300), info.max),
                          (max(info.min, -150), min(info.max, 150))):
            keys = rng.integers(low, high, 400, endpoint=True, dtype=dtype)
            keys[:2] = low, high
            r = int(rng.integers(0, stride))
            keep = np.remainder(keys.astype(np.int64) if dtype != np.uint64 else
                                keys.view(np.int64), stride) == r
            a, b = keys[keep], rng.permutation(keys[keep])[: max(1, keep.sum() // 2)]
            for how in ("inner", "left", "right", "outer"):
                got = _intmatch.match(pa.array(a), pa.array(b), how, stride)
                exp = _intmatch.match(pa.array(a), pa.array(b), how)
                if sorted(zip(*map(list, got))) != sorted(zip(*map(list, exp))):
                    failures.append(f"match {np.dtype(dtype)} stride={stride} [{low}, {high}] {how}")

def _part_of(seed, stride, r, rows=4000, high=6000):
    g = np.random.default_rng([seed, r])
    return pa.table({"key": g.integers(0, high, rows) * stride, "v": g.integers(-9, 9, rows)})

CASES = [(f"even remainders, counts {how}", 1, 1, limit) for how, limit in
         (("in the check", 64), ("in an allreduce", 1))]
CASES += [(f"keys on a stride of {size}, counts {how}", 2, size, limit) for how, limit in
          (("in the check", 64), ("in an allreduce", 1))]
for label, seed, stride, limit in CASES:
    _hash.MODULAR_MAX_PARTS = limit  # 1: the counts' own allreduce, as beyond 64 ranks
    left, right = _part_of(seed, stride, rank), _part_of(seed + 50, stride, rank)
    out = frame.join(frame.from_local(comm, left), frame.from_local(comm, right), on="key",
                     how="outer", suffixes=("", "_right"))
    keys = out.local.column("key").to_numpy()
    residues = sorted(set(np.remainder(keys, size).tolist()))
    shares = comm.allgather(len(keys))
    got = out.gather()
    if stride == 1 and residues != [rank]:
        failures.append(f"{label}: rank {rank} holds keys with remainders {residues}")
    if stride > 1 and min(shares) < 0.6 * sum(shares) / size:
        failures.append(f"{label}: output rows per rank {shares}, not spread by the hash")
    if rank == 0:
        L = pa.concat_tables([_part_of(seed, stride, r) for r in range(size)])
        R = pa.concat_tables([_part_of(seed + 50, stride, r) for r in range(size)])
        exp = pl.from_arrow(L).join(pl.from_arrow(R), on="key", how="full", coalesce=True,
                                    suffix="_right").to_arrow()
        problem = same_rows(got, exp)
        if problem:
            failures.append(f"{label}: {problem}")
mpiutil.report({"failures": comm.allgather(failures)})
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_integer_keys_go_to_their_remainder_unless_that_is_uneven(ranks):
    """The modular partition (key mod P, Cylon's for integer keys): rank r gets the keys with
    remainder r when those are even over the ranks, and its local match addresses them by
    their quotient (checked against the plain match for every integer width and both
    extremes); keys on a stride of P (all remainder 0) are hashed instead and spread. Both
    ways of agreeing on it: the counts in the collective check, and (beyond 64 ranks) in an
    allreduce of their own."""
    run = run_mpi(MODULAR_SCRIPT, ranks, timeout=180)
    failures = [f for per_rank in run.values(ranks)[0]["failures"] for f in per_rank]
    assert failures == [], "\n".join(failures[:10])


def test_split_by_groups_rows_stably_by_destination():
    """The routing of a shuffle: rows grouped by destination, each group in row order, the same
    as a stable sort of the destinations, across the scans' slices and for the radix path."""
    import numpy as np

    from hetflow.frame import _exchange

    rng = np.random.default_rng(3)
    n = 2 * _exchange._SCAN_SLICE + 17
    for parts in (1, 2, 3, 8, 9):
        dest = rng.integers(0, parts, n).astype(np.uint8)
        if parts == 3:
            dest[dest == 1] = 2   # a rank no row goes to
        dest[-5:] = 0             # the last slice's rows land at the end of rank 0's group
        order, offsets = _exchange.split_by(dest, parts)
        counts = np.bincount(dest, minlength=parts)
        assert list(offsets) == [0] + list(np.cumsum(counts))
        assert np.array_equal(order, np.argsort(dest, kind="stable"))
        assert order.dtype == np.int32
        assert np.array_equal(_exchange.destination_counts(dest, parts), counts)
    order, offsets = _exchange.split_by(np.zeros(0, np.uint8), 2)
    assert len(order) == 0 and list(offsets) == [0, 0, 0]


def test_wide_integer_keys_match_by_bucket_as_the_sort_merge_does(monkeypatch):
    """Integer keys over a wide range are matched through a direct-address table of their hash
    buckets, pairs of different keys in one bucket dropped: the same pairs as the sort-merge
    match for every join type and integer width, with buckets shared by many keys (a table
    forced small), and a heavy key handed to the sort-merge instead."""
    import numpy as np
    import pyarrow as pa

    from hetflow.frame import _intmatch, _localsort

    def sort_merge(a, b, how):
        return _intmatch._match_sorted(_localsort.numeric_key(a), _localsort.numeric_key(b),
                                        how)

    def pairs(found):
        return sorted(zip(found[0].tolist(), found[1].tolist()))

    hows = ("inner", "left", "right", "outer")
    rng = np.random.default_rng(7)
    for dtype in (np.int64, np.uint64, np.int32, np.uint32, np.int16):
        info = np.iinfo(dtype)
        for rows in (1, 300, 20_000):
            keys = rng.integers(info.min, info.max, max(1, rows // 2), dtype=dtype,
                                endpoint=True)
            keys[:2] = [info.min, info.max][:len(keys)]
            a, b = rng.choice(keys, rows), rng.choice(keys, rows + 3)
            for how in hows:
                assert pairs(_intmatch.match(pa.array(a), pa.array(b), how)) == \
                    pairs(sort_merge(a, b, how)), (np.dtype(dtype), rows, how)
    # 512 buckets for 2,000 right rows: about 6 other keys' rows beside each match
    buckets = _intmatch._buckets
    monkeypatch.setattr(_intmatch, "_buckets", lambda x, bits: buckets(x, 9))
    keys = rng.integers(-2**62, 2**62, 1500)
    a, b = rng.choice(keys, 3000), rng.choice(keys, 2000)
    for how in hows:
        found = _intmatch._match_hashed(a, b, how)
        assert found is not None and pairs(found) == pairs(sort_merge(a, b, how)), how
    monkeypatch.undo()
    # one key on 1,000 rows of each side: a million pairs, beyond the bucket match's limit
    a = np.concatenate([np.full(1000, 7), rng.integers(-2**62, 2**62, 1000)])
    b = np.concatenate([np.full(1000, 7), rng.integers(-2**62, 2**62, 1000)])
    assert _intmatch._match_hashed(a, b, "inner") is None
    assert pairs(_intmatch.match(pa.array(a), pa.array(b), "inner")) == \
        pairs(sort_merge(a, b, "inner"))


COLLISION_SCRIPT = r"""
import sys
import numpy as np
import pyarrow as pa
from mpi4py import MPI
from hetflow.frame import _hash
from frame_cases import PL_HOW, join_against_polars
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if sys.argv[1:] == ["rounds"]:
    # partitions counted as large: the rows move in _join.JOIN_ROUNDS rounds, each matched and
    # built before the next, the receiver hashing its round's keys again
    from hetflow.frame import _prepare
    _prepare.BATCH_BYTES = -1
# every key's hash cut to 2 bits: most matched hash pairs are of different keys (the join must
# drop them and keep a row whose candidates were all dropped once, null-extended)
full_hash = _hash.hash_rows
_hash.hash_rows = lambda xp, table, keys: full_hash(xp, table, keys) & np.uint64(3)
# prefixes longer than one 8-byte word, lengths around word boundaries, empty and non-ASCII
WORDS = ["", "a", "abcdefgh", "abcdefgi", "abcdefghX", "abcdefghY", "p" * 16 + "1",
         "p" * 16 + "2", "p" * 17, "Ünïcode", "a\x00", "a\x00\x00"]
failures, checked = [], 0

def part(seed, r, typ, empty):
    rng = np.random.default_rng([seed, r])
    n = 0 if r in empty else int(rng.integers(5, 40))
    keys = [WORDS[i] for i in rng.integers(0, len(WORDS), n)]
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        keys = [k.encode() for k in keys]
    return pa.table({"s": pa.array(keys, typ, mask=rng.random(n) < 0.15),
                     "v": pa.array(rng.integers(-99, 99, n))})

for i, typ in enumerate([pa.string(), pa.large_string(), pa.binary(), pa.large_binary()]):
    for how in PL_HOW:
        empty = (1,) if i == 1 else ()  # rank 1 (where there is one) holds nothing
        L = [part(i, r, typ, empty) for r in range(size)]
        R = [part(i + 50, r, typ, ()) for r in range(size)]
        problem = join_against_polars(comm, L, R, "s", how)
        if rank == 0:
            if problem:
                failures.append(f"{typ} how={how}: {problem}")
            checked += 1
mpiutil.report({"failures": failures, "checked": checked})
"""


@pytest.mark.parametrize("ranks,mode", [(1, ""), (2, ""), (3, ""), (2, "rounds"),
                                        (3, "rounds")])
def test_string_join_drops_hash_collisions(ranks, mode):
    """A string or binary key is matched by its 64-bit hash and the pairs' keys compared: with
    the hash cut to 2 bits (almost every candidate pair a collision) the result is still
    polars' for all four join types, null keys matching nothing, an empty rank included;
    ``rounds``: the rows moved in rounds (large partitions), most of them empty here."""
    run = run_mpi(COLLISION_SCRIPT, ranks, timeout=180, args=[mode] if mode else [])
    reports = run.values(ranks)
    assert reports[0]["checked"] == 4 * 4
    assert reports[0]["failures"] == [], "\n".join(reports[0]["failures"][:10])


def test_binary_keys_compare_equal_pair_by_pair():
    """The collision check of the hashed string join: ``a[i] == b[j]`` for each pair, by words,
    for values around 8-byte boundaries, shared long prefixes, nulls (never equal) and
    sliced arrays, against Python's comparison."""
    import numpy as np
    import pyarrow as pa

    from hetflow.frame import _strmatch

    rng = np.random.default_rng(5)
    words = ["", "a", "abcdefgh", "abcdefgi", "abcdefghX", "abcdefghY", "q" * 23 + "1",
             "q" * 23 + "2", "q" * 24, "é", "a\x00"]
    for typ in (pa.string(), pa.large_binary()):
        values = [words[i] for i in rng.integers(0, len(words), 400)]
        if typ == pa.large_binary():
            values = [v.encode() for v in values]
        mask = rng.random(400) < 0.1
        a = pa.array(values, typ, mask=mask).slice(7)
        b = pa.array(values[::-1], typ, mask=mask[::-1]).slice(3, 300)
        ai = rng.integers(0, len(a), 5000).astype(np.int32)
        bi = rng.integers(0, len(b), 5000).astype(np.int32)
        la, lb = a.to_pylist(), b.to_pylist()
        want = [la[i] is not None and la[i] == lb[j] for i, j in zip(ai, bi)]
        got = _strmatch.binary_equal_at(a, ai, b, bi)
        assert got.tolist() == want, typ
        assert got.any() and not got.all()


def test_unique_right_keys_match_by_one_lookup(monkeypatch):
    """Right keys that are all different (a dimension table): the dense match reads each left
    key's right row from one table, no runs expanded (the expansion made to fail here), and
    a left join (an inner join where every left row matches) hands back the left rows as they
    are (None) with each one's right row or -1, in left order. Checked row by row against a
    dict, for dense and gapped right keys, left keys outside the right's range at every
    integer width's extremes, with a stride (keys sharing a remainder), and the other join
    types' pairs against the sort-merge match; duplicated right keys take the expansion."""
    import numpy as np
    import pyarrow as pa

    from hetflow.frame import _intmatch, _localsort

    def pairs(found):
        return sorted(zip(found[0].tolist(), found[1].tolist()))

    def sort_merge(a, b, how):
        return _intmatch._match_sorted(_localsort.numeric_key(a), _localsort.numeric_key(b),
                                        how)

    def check(a, b, stride=1):
        where = {int(k): i for i, k in enumerate(b.tolist())}
        want = [where.get(int(k), -1) for k in a.tolist()]
        hits = [i for i, r in enumerate(want) if r >= 0]
        A, B = pa.array(a), pa.array(b)
        li, ri = _intmatch.match(A, B, "left", stride, identity=True)
        assert li is None and ri.tolist() == want
        li, ri = _intmatch.match(A, B, "left", stride)
        assert li.tolist() == list(range(len(a))) and ri.tolist() == want
        li, ri = _intmatch.match(A, B, "inner", stride, identity=True)
        assert li.tolist() == hits and ri.tolist() == [want[i] for i in hits]
        li, ri = _intmatch.match(pa.array(a[hits]), B, "inner", stride, identity=True)
        assert li is None and ri.tolist() == [want[i] for i in hits]
        for how in ("right", "outer"):
            assert pairs(_intmatch.match(A, B, how, stride)) == pairs(sort_merge(a, b, how))

    def expansion(*args):
        raise AssertionError("runs expanded for unique right keys")

    monkeypatch.setattr(_intmatch, "_expand", expansion)
    rng = np.random.default_rng(11)
    for dtype in (np.int8, np.uint8, np.int16, np.int64, np.uint64):
        info = np.iinfo(dtype)
        for low in (int(info.min), int(info.max) - 90):
            for gap in (1, 3):
                keys = np.array([low + gap * i for i in range(30)], dtype)
                b = rng.permutation(keys)[:20]   # a third of the range's keys absent
                outside = np.array([info.min, info.max, low - 1 if low > info.min else info.max,
                                    low + gap * 30], dtype)
                a = rng.permutation(np.concatenate([rng.choice(keys, 60), outside,
                                                    rng.integers(info.min, info.max, 10,
                                                                 dtype=dtype, endpoint=True)]))
                check(a, b)
    for stride in (2, 3):  # one rank's keys under the modular partition: remainder r
        for r in range(stride):
            keys = np.arange(-40, 40) * stride + r
            a = np.concatenate([rng.choice(keys, 50), [(-2**63 // stride + 1) * stride + r,
                                                       (2**63 // stride - 1) * stride + r]])
            check(rng.permutation(a), rng.permutation(keys)[:50], stride)
    monkeypatch.undo()
    a, b = np.array([1, 2, 3, 2]), np.array([2, 5, 2, 1])
    li, ri = _intmatch.match(pa.array(a), pa.array(b), "left", identity=True)
    assert li is not None and pairs((li, ri)) == [(0, 3), (1, 0), (1, 2), (2, -1), (3, 0),
                                                  (3, 2)]


def test_unique_string_keys_are_looked_up_in_the_right_values():
    """A string or binary key with all right values different: each left row's right row by
    Arrow's set lookup, a null key on either side matching nothing, in left order (a left
    join's left rows as they are); a repeated right value hands the join back (None)."""
    import numpy as np
    import pyarrow as pa

    from hetflow.frame import _strmatch

    rng = np.random.default_rng(4)
    words = ["", "a", "ab", "abcdefghi", "Ünïcode", "a\x00", "b"]
    for typ in (pa.string(), pa.large_binary()):
        enc = (lambda v: v) if typ == pa.string() else (lambda v: [x.encode() for x in v])
        right = pa.array(enc(["ab", "", "Ünïcode", "b", "b", "zz"]), typ,
                         mask=np.array([0, 0, 0, 1, 0, 1], bool)).slice(1)  # 2 nulls, no repeat
        left = pa.array(enc(list(rng.choice(words, 200))), typ, mask=rng.random(200) < 0.1)
        rv = right.to_pylist()
        want = [rv.index(x) if x is not None and x in rv else -1 for x in left.to_pylist()]
        hits = [i for i, r in enumerate(want) if r >= 0]
        li, ri = _strmatch.match_unique_binary(left, right, "left")
        assert li is None and ri.tolist() == want
        li, ri = _strmatch.match_unique_binary(left, right, "inner")
        assert li.tolist() == hits and ri.tolist() == [want[i] for i in hits]
        li, ri = _strmatch.match_unique_binary(left.take(hits), right, "inner")
        assert li is None and ri.tolist() == [want[i] for i in hits]
        assert _strmatch.match_unique_binary(left, right.slice(1).take([0, 1, 0]), "left") \
            is None


def test_take_passes_identity_through_and_nulls_misses():
    """``take`` of the identity (None) is the column itself, chunks and all; with misses (-1)
    every type gets nulls there, strings without nulls by their bitmap alone."""
    import numpy as np
    import pyarrow as pa

    from hetflow.frame import _localjoin

    col = pa.chunked_array([[1, None], [3]])
    assert _localjoin.take(col, None, False) is col
    idx = np.array([2, -1, 0, 1, -1], np.int32)
    for arr in (pa.array(["a", "bb", "ccc", "dddd"]).slice(1), pa.array(["x", None, "zz"]),
                pa.array([b"a", b"b", b"c"], pa.large_binary()), pa.array([True, False, True]),
                pa.array([1.5, None, 2.5]), pa.array([7, 8, 9], pa.int16()),
                pa.array([[1], [2, 3], []])):
        values = arr.to_pylist()
        want = [values[i] if i >= 0 else None for i in idx.tolist()]
        got = _localjoin.take(arr, idx, True)
        got.validate(full=True)
        assert got.type == arr.type and got.to_pylist() == want, arr.type
    assert _localjoin.take(pa.array([], pa.string()), np.array([-1, -1]), True).to_pylist() == \
        [None, None]


UNIQUE_RIGHT_SCRIPT = r"""
import numpy as np
import pyarrow as pa
from mpi4py import MPI
from hetflow import frame
from frame_cases import join_against_polars
import mpiutil

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures, checked = [], 0

def dim(seed, keys, r):
    # rank r's share of a dimension table (every key once over the ranks), payloads with nulls
    mine = keys[r::size]
    rng = np.random.default_rng([seed, r])
    n = len(mine)
    return pa.table({"k": pa.array(mine, pa.int64()), "ks": pa.array([f"key{x}" for x in mine]),
                     "w": pa.array(rng.normal(size=n), mask=rng.random(n) < 0.2),
                     "name": pa.array([f"d{x}" for x in mine], pa.string(),
                                      mask=rng.random(n) < 0.2)})

def facts(seed, r, keys, rows, empty):
    # left keys from the right's and others (below, between, beyond), payloads with nulls
    rng = np.random.default_rng([seed, r])
    n = 0 if r in empty else rows
    pool = np.concatenate([keys, keys + 1, [-5, -1, 10**13]])
    k = rng.choice(pool, n)
    ks = pa.array([f"key{x}" for x in k], pa.string(), mask=rng.random(n) < 0.1)
    return pa.table({"k": pa.array(k, pa.int64()), "ks": ks,
                     "v": pa.array(rng.integers(-9, 9, n), mask=rng.random(n) < 0.2),
                     "s": pa.array([f"s{i}" for i in range(n)], pa.string(),
                                   mask=rng.random(n) < 0.2)})

rng = np.random.default_rng(5)
KEYS = {"dense": rng.permutation(40), "gapped": 5 * rng.permutation(60) + 3,
        "wide": rng.choice(10**12, 50, replace=False)}
# (right keys, left rows per rank, ranks holding no left rows): right sides far smaller than
# the left are sent to every rank at 2 ranks, larger ones are shuffled
# (the string key "ks": nulls on the left, looked up in the broadcast right side's values)
CASES = [("dense", 300, (), "k"), ("gapped", 300, (size - 1,), "k"), ("wide", 300, (), "k"),
         ("dense", 8, (), "k"), ("gapped", 8, (0,), "k"), ("dense", 300, (), "ks"),
         ("gapped", 300, (0,), "ks")]
for i, (kind, rows, empty, on) in enumerate(CASES):
    keys = KEYS[kind]
    for how in ("inner", "left", "right", "outer"):
        other = "ks" if on == "k" else "k"   # the other key column, dropped (any pyarrow)
        L = [facts(i, r, keys, rows, empty) for r in range(size)]
        R = [dim(i, keys, r) for r in range(size)]
        L, R = ([t.select([c for c in t.column_names if c != other]) for t in side]
                for side in (L, R))
        problem = join_against_polars(comm, L, R, on, how)
        if rank == 0:
            if problem:
                failures.append(f"{kind} keys {on}, {rows} left rows, empty {empty}, {how}: "
                                f"{problem}")
            checked += 1
# a left join on unique right keys keeps this rank's left columns as they are: no copy (for
# the string key where the right side is broadcast)
for on in ("k", "ks") if size > 1 else ("k",):
    L, R = facts(9, rank, KEYS["dense"], 300, ()), dim(9, KEYS["dense"], rank)
    out = frame.join(frame.from_local(comm, L), frame.from_local(comm, R), on=on,
                     how="left", suffixes=("", "_right")).local
    kept = [out.column(c).chunk(0).buffers()[1].address ==
            L.column(c).chunk(0).buffers()[1].address for c in ("k", "ks", "v", "s")]
    if not all(kept):
        failures.append(f"rank {rank}, on {on}: the left columns were copied ({kept})")
mpiutil.report({"failures": comm.gather(failures), "checked": checked})
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_join_on_unique_right_keys_matches_polars(ranks):
    """Joins with a dimension table (every right key once: the one-lookup match, and a left
    join that keeps the left columns uncopied): dense, gapped and wide-range integer right
    keys and a string key, left keys absent from the right, nulls in the payloads and the
    left's string key, a rank without left rows, broadcast and shuffled right sides; polars'
    result for all four join types."""
    run = run_mpi(UNIQUE_RIGHT_SCRIPT, ranks, timeout=180)
    reports = run.values(ranks)
    assert reports[0]["checked"] == 7 * 4
    failures = [f for per_rank in reports[0]["failures"] for f in per_rank]
    assert failures == [], "\n".join(failures[:10])
