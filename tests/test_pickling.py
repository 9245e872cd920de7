"""Task payloads (``executors/_pickling.py``): by-value functions a rank loads without cloudpickle.

Each case pickles in one fresh interpreter (the function defined in its ``__main__``, as in a
user's script) and loads in another (as a rank does, with plain ``pickle``), which reports the
result and whether it imported cloudpickle.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(150)

SCRIPT = textwrap.dedent('''
    import os, sys, json
    import hetflow
    from hetflow.executors import _pickling
    from hetflow.executors.payload import TaskPayload

    SCALE = 3

    def helper(x):
        return x * SCALE

    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    def even(n):
        return True if n == 0 else odd(n - 1)

    def odd(n):
        return False if n == 0 else even(n - 1)

    @hetflow.mpi_app(ranks=2)
    def app(comm, x: int, *, y=2) -> int:
        """The app's doc."""
        return helper(x) + fact(y) + len(os.path.join("ab", "c")) + even(4) + odd(3)

    app.fn.tag = "kept"

    def outer():
        z = 5
        def inner():
            return z + SCALE
        return inner

    class Point:          # a __main__ class: cloudpickle's own by-value form
        def __init__(self, x):
            self.x = x

    cases = {
        "app": TaskPayload(1, app.fn, (4,), {"y": 3}, {"ranks": 2}),
        "closure": outer(),
        "lambda": lambda a: a + SCALE,
        "main_class": TaskPayload(2, helper, (Point(7),), {}, {"ranks": 1}),
    }
    sys.stdout.buffer.write(_pickling.dumps(cases[sys.argv[1]]))
''')

LOAD = textwrap.dedent('''
    import json, pickle, sys
    obj = pickle.loads(sys.stdin.buffer.read())
    kind = sys.argv[1]
    if kind == "app":
        f = obj.func
        out = [f(None, 4, **obj.kwargs), f.__doc__, f.__name__, f.__qualname__, f.__module__,
               f.__kwdefaults__, str(f.__annotations__), f.tag]
    elif kind == "main_class":
        out = [obj.func(obj.args[0].x)]
    else:
        out = [obj(1) if kind == "lambda" else obj()]
    print(json.dumps([out, "cloudpickle" in sys.modules]))
''')


def round_trip(kind, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    blob = subprocess.run([sys.executable, "script.py", kind], check=True, capture_output=True,
                          cwd=tmp_path, timeout=120).stdout
    out = subprocess.run([sys.executable, "-c", LOAD, kind], input=blob, check=True,
                         capture_output=True, cwd=tmp_path, timeout=120).stdout
    return json.loads(out.decode().strip().splitlines()[-1])


def test_an_apps_function_loads_without_cloudpickle(tmp_path):
    out, imported_cloudpickle = round_trip("app", tmp_path)
    # helper(4) * SCALE + fact(3) + len("ab/c") + even(4) + odd(3)
    assert out == [12 + 6 + 4 + 1 + 1, "The app's doc.", "app", "app", "__main__",
                   {"y": 2}, "{'x': <class 'int'>, 'return': <class 'int'>}", "kept"]
    assert not imported_cloudpickle


def test_a_lambda_without_closure_loads_without_cloudpickle(tmp_path):
    assert round_trip("lambda", tmp_path) == [[4], False]


def test_closures_and_main_classes_are_left_to_cloudpickle(tmp_path):
    assert round_trip("closure", tmp_path) == [[8], True]
    assert round_trip("main_class", tmp_path) == [[21], True]


def test_a_function_pickled_by_another_python_version_is_refused():
    import marshal
    import pickle

    from hetflow.executors import _pickling

    def f():
        return 1

    _, args, *_ = _pickling._reduce_function(f)
    assert _pickling._make_function(*args)() == 1
    stale = pickle.dumps((_pickling._make_function, ((3, 1), marshal.dumps(f.__code__), {})))
    with pytest.raises(RuntimeError, match=r"pickled by Python 3\.1 and cannot be loaded"):
        func, fargs = pickle.loads(stale)
        func(*fargs)


CACHE_SCRIPT = textwrap.dedent('''
    import json, os, pickle
    from hetflow.executors import _pickling

    reduced = []
    real = _pickling._reduce_function
    _pickling._reduce_function = lambda f: reduced.append(f.__name__) or real(f)

    SCALE = 3
    ITEMS = [1]

    def scaled(x):
        return x * SCALE

    def counted():
        return len(ITEMS)

    def joined():
        return os.path.join("a", "b")

    def run(f, *args, times=50):
        before = len(reduced)
        blobs = {_pickling.dumps(f) for _ in range(times)}
        return [pickle.loads(blobs.pop())(*args), len(blobs), len(reduced) - before]

    out = {"scaled": run(scaled, 2), "joined": run(joined), "counted": run(counted)}
    SCALE = 5                 # rebound: pickled anew, once
    ITEMS.append(2)           # changed in place: a list is pickled anew every time
    out["scaled_again"] = run(scaled, 2)
    out["counted_again"] = run(counted)
    print(json.dumps(out))
''')


def test_a_function_is_pickled_once_while_what_it_reads_stays_the_same(tmp_path):
    """A by-value function is reduced once for 50 payloads, and anew when a global it reads
    is rebound; one reading a mutable global (a list) is reduced every time, so a change
    in place reaches the ranks (cloudpickle's semantics)."""
    (tmp_path / "cache.py").write_text(CACHE_SCRIPT)
    out = json.loads(subprocess.run([sys.executable, "cache.py"], check=True,
                                    capture_output=True, cwd=tmp_path, timeout=120).stdout)
    assert out["scaled"] == [6, 0, 1]
    assert out["joined"] == [os.path.join("a", "b"), 0, 1]
    assert out["counted"] == [1, 0, 50]
    assert out["scaled_again"] == [10, 0, 1]
    assert out["counted_again"] == [2, 0, 50]
