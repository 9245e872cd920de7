"""backend="pycylon" under real mpiexec: the same rows as the CPU engine when pycylon runs, a
typed error on every rank (never a hang) when it cannot, and an honest ``backend`` attribute.

pycylon is not on PyPI; the parity test runs where it is importable and is skipped (with the
reason) elsewhere. No stand-in pycylon module is used: the point is the real one.
"""
import importlib.util

import pytest

from mpiutil import run_mpi

HAVE_PYCYLON = importlib.util.find_spec("pycylon") is not None

PRELUDE = r"""
import logging, sys
import pyarrow as pa
from mpi4py import MPI
from hetflow import frame, errors
from frame_cases import random_part, same_rows
import mpiutil

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("hetflow.frame").addHandler(Keep())
logging.getLogger("hetflow.frame").setLevel(logging.INFO)
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
outcomes = {}

def case(name, fn):
    try:
        out = fn()
        outcomes[name] = ("ok", getattr(out, "backend", None))
    except errors.HetflowError as exc:
        outcomes[name] = (type(exc).__name__, str(exc))
    comm.Barrier()  # a rank left inside a collective would hang here (the test times out)

def part(seed, **kw):
    return frame.from_local(comm, random_part(seed, rank, **kw))
"""

UNAVAILABLE = PRELUDE + r"""
clean = part(1, null_rate=0, key_range=8)
clean2 = part(2, null_rate=0, key_range=8)
ints = frame.from_local(comm, pa.table({"k": pa.array([rank, 1, 2], pa.int64()),
                                        "v": pa.array([1, 2, 3], pa.int64())}))
case("join", lambda: frame.join(clean, clean2, on="k", backend="pycylon"))
case("sort", lambda: frame.sort(clean, ["k", "v"], [True, False], backend="pycylon"))
case("groupby", lambda: clean.groupby("k").agg({"v": ["sum", "mean"]}, backend="pycylon"))
case("unique", lambda: ints.unique(backend="pycylon"))
frame.set_backend("pycylon")  # the process-wide default routes the same way
case("set_backend sort", lambda: frame.sort(ints, "k"))
frame.set_backend(None)
case("cpu after reset", lambda: frame.sort(ints, "k"))
mpiutil.report(outcomes)
"""


@pytest.mark.skipif(HAVE_PYCYLON, reason="pycylon is importable here")
@pytest.mark.parametrize("ranks", [2, 3])
def test_pycylon_missing_raises_on_every_rank(ranks):
    reports = run_mpi(UNAVAILABLE, ranks, timeout=120).values(ranks)
    for rank, outcomes in enumerate(reports):
        for name, (kind, detail) in outcomes.items():
            if name == "cpu after reset":
                assert (kind, detail) == ("ok", "cpu"), (rank, name, detail)
                continue
            assert kind == "BackendUnavailable", (rank, name, kind, detail)
            # the import's own reason, not a generic message
            assert "pycylon is not importable" in detail, (rank, name, detail)
            assert "No module named 'pycylon'" in detail, (rank, name, detail)
    assert len(reports[0]) == 6


FALLBACK = PRELUDE + r"""
import pyarrow.compute
from hetflow.frame import Agg
NEW_AGGS = ["size", "first", "last", "var", "std", "median", "nunique",
            Agg("quantile", q=0.9), Agg("nlargest", n=2), Agg("nsmallest", n=2)]
left, right = part(3, key_range=6), part(4, key_range=6)
results = {}
for how in ("semi", "anti"):
    got = frame.join(left, right, on=["k", "s"], how=how, backend="pycylon")
    exp = frame.join(left, right, on=["k", "s"], how=how, backend="cpu")
    results[f"{how} join"] = (got.backend, same_rows(got.local, exp.local))
# what Cylon gets wrong (hetflow.frame._cylon_rules.CYLON_WRONG)
for how in ("left", "right", "outer"):
    got = frame.join(left, right, on="k", how=how, backend="pycylon")
    exp = frame.join(left, right, on="k", how=how, backend="cpu")
    results[f"{how} join"] = (got.backend, same_rows(got.local, exp.local))
got = frame.join(left, right, on=["k", "s"], backend="pycylon")
exp = frame.join(left, right, on=["k", "s"], backend="cpu")
results["join"] = (got.backend, same_rows(got.local, exp.local))
clean = part(5, null_rate=0, key_range=6)
got = clean.groupby("s").agg({"v": "sum"}, backend="pycylon")
exp = clean.groupby("s").agg({"v": "sum"}, backend="cpu")
results["groupby"] = (got.backend, same_rows(got.local, exp.local))
words = frame.from_local(comm, clean.local.select(["s"]))
got, exp = words.unique(backend="pycylon"), words.unique(backend="cpu")
results["unique"] = (got.backend, same_rows(got.local, exp.local))
zeros = frame.from_local(comm, pa.table({"f": pa.array([-0.0, 0.0, float(rank)]),
                                         "i": pa.array([1, 1, 2])}))
got, exp = zeros.unique(backend="pycylon"), zeros.unique(backend="cpu")
results["unique -0.0"] = (got.backend, same_rows(got.local, exp.local))
got = frame.shuffle(left, "k", backend="pycylon")
exp = frame.shuffle(left, "k", backend="cpu")
results["shuffle"] = (got.backend, None if got.local.equals(exp.local) else "partitions differ")
# the aggregations pycylon does not run (hetflow.frame._cylon_rules.NO_CYLON_AGG)
for f in NEW_AGGS:
    name = f if isinstance(f, str) else f.name
    got = clean.groupby("k").agg({"v": ["sum", f]}, backend="pycylon")
    exp = clean.groupby("k").agg({"v": ["sum", f]}, backend="cpu")
    # (a var's, std's or mean's last bits differ from run to run: polars' threads' order)
    results[f"groupby {name}"] = (got.backend, same_rows(got.local, exp.local, rel=1e-12))
# a column Cylon cannot split between ranks, key or not (bool, large_string)
flags = frame.from_local(comm, clean.local.append_column(
    "b", pa.compute.greater(clean.local.column("v"), 0)))
got = frame.join(flags, clean, on="k", backend="pycylon")
exp = frame.join(flags, clean, on="k", backend="cpu")
results["join with a bool column"] = (got.backend, same_rows(got.local, exp.local))
wide = frame.from_local(comm, clean.local.append_column(
    "ls", clean.local.column("s").cast(pa.large_string())))
got = frame.sort(wide, "k", backend="pycylon")
exp = frame.sort(wide, "k", backend="cpu")
results["sort with a large_string column"] = (got.backend, same_rows(got.local, exp.local))
mpiutil.report({"results": results, "log": records})
"""

# each of FALLBACK's cases: the operation its log line names, and words of the reason given
FALLBACK_WORDS = {"semi join": ("semi join", "no semi or anti join"),
                  "anti join": ("anti join", "no semi or anti join"),
                  "left join": ("left join", "instead of null"),
                  "right join": ("right join", "instead of null"),
                  "outer join": ("outer join", "instead of null"),
                  "join": ("join", "address of each value"),
                  "groupby": ("groupby", "address of each value"),
                  "unique": ("unique", "address of each value"),
                  "unique -0.0": ("unique", "holds -0.0"),
                  "shuffle": ("shuffle", "Cylon's own hash"),
                  "join with a bool column": ("join", "'b' (bool): Cylon has no splitter"),
                  "sort with a large_string column": ("sort", "'ls' (large_string): Cylon has "
                                                              "no splitter"),
                  **{f"groupby {name}": (f"groupby {name}", why) for name, why in [
                      ("size", "no size aggregation"), ("first", "no first aggregation"),
                      ("last", "no last aggregation"), ("nlargest", "no nlargest aggregation"),
                      ("nsmallest", "no nsmallest aggregation"), ("var", "no ddof"),
                      ("std", "no ddof"), ("median", "no q and no interpolation"),
                      ("quantile", "no q"), ("nunique", "not been compared")]}}


@pytest.mark.parametrize("ranks", [2, 3])
def test_ops_without_a_pycylon_path_run_on_cpu_and_say_so(ranks):
    # Decided before pycylon is needed, so this holds whether or not it is installed.
    reports = run_mpi(FALLBACK, ranks, timeout=120).values(ranks)
    for rank, rep in enumerate(reports):
        assert set(rep["results"]) == set(FALLBACK_WORDS)
        for name, (backend, problem) in rep["results"].items():
            assert backend == "cpu", (rank, name, backend)
            assert problem is None, (rank, name, problem)
        assert len(rep["log"]) == len(FALLBACK_WORDS), rep["log"]
        for name, (op, why) in FALLBACK_WORDS.items():
            said = [m for m in rep["log"] if m.startswith(f"hetflow.frame: {op} ran on the "
                                                          "CPU engine, not pycylon: ")
                    and why in m]
            assert said, (rank, name, rep["log"])


UNHELD = PRELUDE + r"""
import datetime, decimal
# columns a pycylon Table cannot hold (making one fails with "unsupported type" on one rank
# too): the CPU engine runs the join or sort, and says why
t = frame.from_local(comm, pa.table({
    "k": pa.array([rank, 1, 2], pa.int64()),
    "d": pa.array(["x", "y", "x"]).dictionary_encode(),
    "m": pa.array([decimal.Decimal("1.5"), None, decimal.Decimal("-2")], pa.decimal128(9, 2)),
    "t": pa.array([datetime.timedelta(seconds=s) for s in (1, 2, 3)], pa.duration("s"))}))
plain = frame.from_local(comm, t.local.select(["k"]))
results = {}
for name, col in (("dictionary", "d"), ("decimal", "m"), ("duration", "t")):
    one = frame.from_local(comm, t.local.select(["k", col]))
    for op, run in (("join", lambda be: frame.join(one, plain, on="k", backend=be)),
                    ("sort", lambda be: frame.sort(one, "k", backend=be))):
        got, exp = run("pycylon"), run("cpu")
        results[f"{op} {name}"] = (got.backend, same_rows(got.local, exp.local))
mpiutil.report({"results": results, "log": records})
"""


@pytest.mark.parametrize("ranks", [1])
def test_columns_pycylon_cannot_hold_run_on_cpu_and_say_so(ranks):
    # Decided before pycylon is needed, on one rank as on many.
    reports = run_mpi(UNHELD, ranks, timeout=120).values(ranks)
    for rank, rep in enumerate(reports):
        assert len(rep["results"]) == 6 and len(rep["log"]) == 6, rep
        for name, (backend, problem) in rep["results"].items():
            assert (backend, problem) == ("cpu", None), (rank, name, backend, problem)
            op, col = name.split()
            said = [m for m in rep["log"] if m.startswith(f"hetflow.frame: {op} ran on the CPU "
                                                          "engine, not pycylon: column ")
                    and col in m and "a pycylon Table cannot hold this type" in m]
            assert said, (rank, name, rep["log"])


REFUSED = PRELUDE + r"""
# The offending value sits on the last rank only: the refusal must still reach every rank.
last = rank == size - 1
f = pa.array([float("nan") if last else 1.0, 2.0], pa.float64())
k = pa.array([None if last else 1, 2], pa.int64())
t = frame.from_local(comm, pa.table({"f": f, "k": k, "g": pa.array([1, 1], pa.int64()),
                                     "b": pa.array([True, False])}))
# (a bool column beside them would send joins and sorts on more than one rank to the CPU
# engine: Cylon cannot split it)
no_bool = frame.from_local(comm, t.local.select(["f", "k", "g"]))
case("join NaN key", lambda: frame.join(no_bool, no_bool, on="f", backend="pycylon"))
case("sort null key", lambda: frame.sort(no_bool, "k", backend="pycylon"))
case("sort NaN key", lambda: frame.sort(no_bool, "f", backend="pycylon"))
case("groupby null values", lambda: t.groupby("g").agg({"k": "sum"}, backend="pycylon"))
case("groupby NaN key", lambda: t.groupby("f").agg({"g": "sum"}, backend="pycylon"))
case("unique subset", lambda: t.unique("g", backend="pycylon"))
case("unique NaN", lambda: no_bool.unique(backend="pycylon"))
case("groupby NaN max", lambda: t.groupby("g").agg({"f": ["sum", "max"]}, backend="pycylon"))
case("bool join key", lambda: frame.join(t, t, on="b", backend="pycylon"))
# Cylon's comparator and sort know no large_string: "unknown type large_string" on one rank
ls = frame.from_local(comm, t.local.append_column("ls", pa.array(["a", "b"], pa.large_string())))
case("large_string join key", lambda: frame.join(ls, ls, on="ls", backend="pycylon"))
mpiutil.report(outcomes)
"""

REFUSAL_WORDS = {
    "join NaN key": "NaN",
    "sort null key": "nulls",
    "sort NaN key": "NaN",
    "groupby null values": "all-null group",
    "groupby NaN key": "NaN",
    "unique subset": "first occurrence",
    "unique NaN": "NaN",
    "groupby NaN max": "where its NaN falls",
    "bool join key": "bool",
    "large_string join key": "large_string",
}


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_semantic_differences_are_refused_on_every_rank(ranks):
    reports = run_mpi(REFUSED, ranks, timeout=120).values(ranks)
    for rank, outcomes in enumerate(reports):
        assert set(outcomes) == set(REFUSAL_WORDS)
        for name, (kind, detail) in outcomes.items():
            assert kind == "NotSupported", (rank, name, kind, detail)
            assert "pycylon" in detail and REFUSAL_WORDS[name] in detail, (rank, name, detail)


PARITY = PRELUDE + r"""
import pyarrow.compute
from hetflow.frame import Agg
NEW_AGGS = ["size", "first", "last", "var", "std", "median", "nunique",
            Agg("quantile", q=0.9), Agg("nlargest", n=2), Agg("nsmallest", n=2)]
BACKEND = sys.argv[1]  # "pycylon" in the test; "cpu" checks this script itself
problems, checked, routed = [], 0, []

def near(table):
    # float columns to 12 significant digits: Cylon and the CPU engine sum in other orders
    def fix(col):
        if not pa.types.is_floating(col.type):
            return col
        return pa.array([None if x is None else float(f"{x:.12g}") for x in col.to_pylist()],
                        col.type)
    return pa.table({c: fix(table.column(c)) for c in table.column_names})

def compare(label, got, exp, ordered_by=None):
    global checked
    if got.backend != BACKEND:
        if BACKEND == "pycylon" and got.backend == "cpu":
            routed.append(label)   # what Cylon gets wrong: the CPU engine's rows, logged
        else:
            problems.append(f"{label}: backend {got.backend!r}, expected {BACKEND!r}")
    g, e = got.gather(), exp.gather()
    if rank == 0:
        if g.schema != e.schema:
            problems.append(f"{label}: schema {g.schema} != {e.schema}")
        else:
            p = same_rows(near(g), near(e))   # every column, value by value
            if p:
                problems.append(f"{label}: {p}")
            if ordered_by and g.select(ordered_by) != e.select(ordered_by):
                problems.append(f"{label}: key order differs")
        checked += 1

for seed in range(2):
    kw = dict(seed=seed, key_range=5 + seed * 7)
    L, R = part(seed, key_range=kw["key_range"]), part(seed + 50, key_range=kw["key_range"])
    Rn = frame.from_local(comm, R.local.rename_columns(["rk", "rs", "f", "v"]))
    for how in ("inner", "left", "right", "outer"):
        for label, args in [("k", dict(on="k")), ("k+s", dict(on=["k", "s"])),
                            ("left_on/right_on", dict(left_on=["k", "s"], right_on=["rk", "rs"]))]:
            other = Rn if "left_on" in args else R
            compare(f"join {how} {label} seed={seed}",
                    frame.join(L, other, how=how, backend=BACKEND, **args),
                    frame.join(L, other, how=how, backend="cpu", **args))
    clean = part(seed, null_rate=0, key_range=10**9)  # distinct keys: one correct order
    compare(f"sort k seed={seed}", frame.sort(clean, "k", backend=BACKEND),
            frame.sort(clean, "k", backend="cpu"), ordered_by=["k"])
    compare(f"sort k desc, v seed={seed}",
            frame.sort(clean, ["k", "v"], [False, True], backend=BACKEND),
            frame.sort(clean, ["k", "v"], [False, True], backend="cpu"), ordered_by=["k", "v"])
    # every key equal: Cylon's sample sort fails on more than one rank (a rank's share empty)
    same = frame.from_local(comm, clean.local.set_column(
        0, "k", pa.array([7] * clean.local_rows, pa.int64())))
    compare(f"sort equal keys seed={seed}", frame.sort(same, "k", backend=BACKEND),
            frame.sort(same, "k", backend="cpu"), ordered_by=["k"])
    grouped = part(seed, null_rate=0, key_range=6)
    spec = {"v": ["sum", "count", "min", "max", "mean"], "f": "max"}
    compare(f"groupby k seed={seed}", grouped.groupby("k").agg(spec, backend=BACKEND),
            grouped.groupby("k").agg(spec, backend="cpu"))
    compare(f"groupby k+s seed={seed}", grouped.groupby(["k", "s"]).agg({"v": "sum"},
                                                                       backend=BACKEND),
            grouped.groupby(["k", "s"]).agg({"v": "sum"}, backend="cpu"))
    dup = frame.from_local(comm, grouped.local.select(["k", "s"]))
    compare(f"unique seed={seed}", dup.unique(backend=BACKEND), dup.unique(backend="cpu"))
    # sums past their column type's range (Cylon sums in the column's own type), a float32
    # mean, unsigned: every aggregation of every column compared
    n = grouped.local_rows
    wide = frame.from_local(comm, pa.table({
        "k": grouped.local.column("k"),
        "i8": pa.array([100 + i % 20 for i in range(n)], pa.int8()),
        "i32": pa.array([2_000_000_000 - i for i in range(n)], pa.int32()),
        "u16": pa.array([65_000 - i for i in range(n)], pa.uint16()),
        "f32": grouped.local.column("f").cast(pa.float32()),
        "v": grouped.local.column("v")}))
    spec = {c: ["sum", "count", "min", "max", "mean"] for c in ("i8", "i32", "u16", "f32", "v")}
    compare(f"groupby overflowing sums seed={seed}", wide.groupby("k").agg(spec, backend=BACKEND),
            wide.groupby("k").agg(spec, backend="cpu"))
    # a float key with -0.0 beside 0.0: one group (Cylon alone makes two, by the bits)
    zero = frame.from_local(comm, pa.table({
        "z": pa.array([1.5 if i % 3 == 0 else (-0.0 if (i + rank) % 2 else 0.0)
                       for i in range(n)], pa.float64()),
        "v": grouped.local.column("v")}))
    compare(f"groupby -0.0/0.0 key seed={seed}",
            zero.groupby("z").agg({"v": ["sum", "min"]}, backend=BACKEND),
            zero.groupby("z").agg({"v": ["sum", "min"]}, backend="cpu"))
    # the aggregations pycylon does not run: the CPU engine's, logged
    for f in NEW_AGGS:
        name = f if isinstance(f, str) else f.name
        compare(f"groupby {name} seed={seed}",
                grouped.groupby("k").agg({"v": ["sum", f]}, backend=BACKEND),
                grouped.groupby("k").agg({"v": ["sum", f]}, backend="cpu"))
    # bool and large_string columns (not keys): Cylon cannot split them between ranks
    flags = frame.from_local(comm, clean.local.append_column(
        "b", pa.compute.greater(clean.local.column("v"), 0)).append_column(
        "ls", clean.local.column("s").cast(pa.large_string())))
    compare(f"join bool+large_string seed={seed}",
            frame.join(flags, clean, on="k", backend=BACKEND),
            frame.join(flags, clean, on="k", backend="cpu"))
    compare(f"sort bool+large_string seed={seed}", frame.sort(flags, "k", backend=BACKEND),
            frame.sort(flags, "k", backend="cpu"), ordered_by=["k"])
    # a column no pycylon Table can hold (on one rank too)
    held = frame.from_local(comm, clean.local.append_column(
        "d", clean.local.column("s").dictionary_encode()))
    compare(f"join dictionary seed={seed}", frame.join(held, clean, on="k", backend=BACKEND),
            frame.join(held, clean, on="k", backend="cpu"))
mpiutil.report({"problems": problems, "checked": checked, "routed": routed,
                "said": [m for m in records if "ran on the CPU engine, not pycylon" in m]})
"""


AGG_NAMES = ["size", "first", "last", "var", "std", "median", "nunique", "quantile", "nlargest",
             "nsmallest"]
#: PARITY's cases per seed
CASES = 12 + 2 + 1 + 2 + 1 + 1 + 1 + len(AGG_NAMES) + 2 + 1


def routed_to_cpu(ranks):
    """PARITY's cases pycylon gets wrong (hetflow.frame._cylon_rules.CYLON_WRONG) or does not
    run: left, right and outer joins; the aggregations pycylon's group-by has not (or not with
    their parameters); a join of a table with a dictionary column (no pycylon Table holds it);
    on more than one rank, string keys (joins on k+s, group-by on k+s, unique), a join or
    sort of a table with a bool or large_string column (no splitter), and a sort of equal
    keys (Cylon's sample sort fails there)."""
    cases = []
    for seed in range(2):
        for how in ("inner", "left", "right", "outer"):
            for label in ("k", "k+s", "left_on/right_on"):
                if how != "inner" or (ranks > 1 and label != "k"):
                    cases.append(f"join {how} {label} seed={seed}")
        cases += [f"groupby {name} seed={seed}" for name in AGG_NAMES]
        cases.append(f"join dictionary seed={seed}")
        if ranks > 1:
            cases += [f"sort equal keys seed={seed}",
                      f"groupby k+s seed={seed}", f"unique seed={seed}",
                      f"join bool+large_string seed={seed}",
                      f"sort bool+large_string seed={seed}"]
    return sorted(cases)


@pytest.mark.skipif(not HAVE_PYCYLON, reason="pycylon is not importable here (not on PyPI; "
                                              "see docs/engine.md)")
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_pycylon_gives_the_cpu_engines_rows(ranks):
    run = run_mpi(PARITY, ranks, timeout=240, args=("pycylon",))
    reports = run.values(ranks)
    assert reports[0]["checked"] == 2 * CASES
    assert reports[0]["problems"] == [], "\n".join(reports[0]["problems"][:10])
    # every case gives the CPU engine's rows; pycylon ran all but these, each one logged
    for rep in reports:
        assert sorted(rep["routed"]) == routed_to_cpu(ranks), rep["routed"]
        assert len(rep["said"]) == len(rep["routed"]), rep["said"]


def test_parity_script_is_sound_on_the_cpu_engine():
    """The parity script above, run CPU against CPU: guards the script itself where pycylon
    is absent (it must count every case and find no difference)."""
    reports = run_mpi(PARITY, 2, timeout=240, args=("cpu",)).values(2)
    assert reports[0]["checked"] == 2 * CASES
    assert reports[0]["problems"] == [], "\n".join(reports[0]["problems"][:10])
    assert reports[0]["routed"] == [] and reports[0]["said"] == []
