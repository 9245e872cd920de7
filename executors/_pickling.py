"""Task payloads a rank can load without importing cloudpickle.

An ``@mpi_app`` function cannot be pickled by reference (its module's name for it is the
app, not the function), so it travels by value. cloudpickle's by-value form names
cloudpickle's own reconstructors, and importing cloudpickle (with the ``inspect``,
``typing`` and ``dataclasses`` it pulls in) costs a rank about as much as mpi4py itself.

:func:`dumps` is cloudpickle with two reductions of its own, whose reconstructors live in
this module and need only the standard library's built-in parts:

- a function without a closure, which cloudpickle would pickle by value, becomes its code
  object (``marshal``), the globals its code reads, and its attributes;
- an importable module becomes a reference imported on load.

A by-value function is pickled once (:func:`_function_bytes`) and its bytes are reused for
every later task while what they were made from is the same: its code, defaults and
attributes, and the globals it reads, each the same object and of a kind whose pickle cannot
change while it is (a number, a string, an importable module, a class or function pickled by
name, a tuple of those); any other global (a list, a dict, a function pickled by value) is
pickled anew each time, as cloudpickle does. The rank unpickles a fresh function per task
either way.

Everything else (closures, classes from ``__main__``, dynamic modules) is left to
cloudpickle, whose stream then imports cloudpickle on the rank as before. Code objects are
specific to the Python version: a rank on another version gets a clear ``RuntimeError``
(cloudpickle's by-value functions do not cross versions either).
"""
from __future__ import annotations

import builtins
import marshal
import operator
import pickle
import sys
import types
import weakref
from typing import Optional

from hetflow._task import MPITask    # (a rank imports it anyway: it unpickles the app's)

#: The interpreter a marshalled code object was made by.
_VERSION = tuple(sys.version_info[:2])


def _import(name: str) -> types.ModuleType:
    """The module ``name``, imported (the reconstructor of a module reference)."""
    __import__(name)
    return sys.modules[name]


def _make_function(version: tuple, code: bytes, base: dict) -> types.FunctionType:
    """A function from marshalled ``code`` with a fresh globals dict made from ``base``.

    Its globals and attributes are filled in afterwards by :func:`_set_function_state`,
    so a function that reads itself (recursion) or another function that reads it is
    rebuilt once, the pickle memo tying the knot.
    """
    if tuple(version) != _VERSION:
        raise RuntimeError(f"the task's function was pickled by Python "
                           f"{'.'.join(map(str, version))} and cannot be loaded by Python "
                           f"{'.'.join(map(str, _VERSION))}: run the ranks on the client's "
                           f"Python version")
    namespace = dict(base)
    namespace["__builtins__"] = builtins
    return types.FunctionType(marshal.loads(code), namespace)


def _set_function_state(func: types.FunctionType, state: tuple) -> None:
    """Fill in what :func:`_make_function` left out: globals, submodules, attributes."""
    global_values, submodules, attributes, extra = state
    for name in submodules:
        _import(name)
    func.__globals__.update(global_values)
    for name, value in attributes.items():
        setattr(func, name, value)
    func.__dict__.update(extra)


def _function_from(data: bytes) -> types.FunctionType:
    """A function pickled alone (:func:`_function_bytes`), loaded: a fresh one per task."""
    return pickle.loads(data)


#: function -> (what its bytes were made from, the bytes); see :func:`_function_bytes`.
_FUNCTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: code object -> the global names it may read (:func:`_global_names`).
_NAMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: Kinds whose pickle cannot change while a value is the same object.
_IMMUTABLE = frozenset((int, float, complex, str, bytes, bool, type(None), range,
                        types.BuiltinFunctionType))


#: Classes cloudpickle pickles by name (its module lookups done once per class: a payload
#: names the app's MPITask and RankFiles, 10 Python calls a task).
_NAMED: "weakref.WeakSet" = weakref.WeakSet()
#: Kinds pickle handles itself, asked of the pickler's ``reducer_override`` all the same.
_NATIVE = frozenset((tuple, list, dict, set, frozenset, bytearray))


def _settled(value) -> bool:
    """Whether ``value`` pickles the same for as long as it is the same object."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return True
    if kind is tuple:
        return all(_settled(v) for v in value)
    if kind is types.ModuleType:
        return _importable(value)
    if kind is types.FunctionType or isinstance(value, type):
        try:
            return _by_reference(value)
        except Exception:  # noqa: BLE001 - a lookup that fails: pickle it each time
            return False
    return False


def _sources(func: types.FunctionType) -> tuple:
    """What a closure-free by-value function's pickle is made from: objects compared by
    identity, then the number of modules imported (a module among its globals brings its
    imported submodules along, see :func:`_submodules`)."""
    code = func.__code__
    names = _NAMES.get(code)
    if names is None:
        names = _NAMES[code] = tuple(_global_names(code))
    scope = func.__globals__
    values = [scope.get(name, _NAMES) for name in names]   # _NAMES: "not there"
    return ((code, func.__defaults__, *values, *(func.__kwdefaults__ or {}).values(),
             *func.__dict__.values(), *func.__annotations__.values(), func.__name__,
             func.__qualname__, func.__module__, func.__doc__),
            len(sys.modules) if any(type(v) is types.ModuleType for v in values) else 0)


def _cached(func: types.FunctionType) -> Optional[bytes]:
    """``func``'s bytes from :func:`_function_bytes` if made from the same sources."""
    cached = _FUNCTIONS.get(func)
    if cached is None:
        return None
    (objects, modules), data = cached
    now, modules_now = _sources(func)
    if modules == modules_now and len(objects) == len(now) \
            and all(map(operator.is_, objects, now)):
        return data
    return None


#: An app's MPITask -> (its function's bytes it was made with, its own bytes).
_TASKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def alone(func) -> Optional[bytes]:
    """``func`` (a closure-free by-value function, or an app's ``MPITask`` of one) pickled
    alone, from :func:`_cached` bytes still valid; None when there are none (the first task
    of a function, or one pickled otherwise): a payload then carries these bytes through
    plain pickle, with no cloudpickle pickler set up per task (its ``reducer_override``
    asked of every object: ~13 Python calls and a fifth of the client's busy time)."""
    fn = func.fn if type(func) is MPITask else func
    if type(fn) is not types.FunctionType or fn.__closure__ is not None:
        return None
    data = _cached(fn)
    if data is None or fn is func:
        return data
    made = _TASKS.get(func)
    if made is None or made[0] is not data:
        made = _TASKS[func] = (data, dumps(func))
    return made[1]


def _function_bytes(func: types.FunctionType) -> Optional[bytes]:
    """``func`` pickled alone in its light by-value form, kept for :func:`_cached`; None when
    one of its sources may pickle otherwise while it is the same object (a mutable global):
    the caller pickles it inline, each time."""
    sources = _sources(func)
    if not all(_settled(v) for v in sources[0][1:] if v is not _NAMES):
        return None
    import io

    buffer = io.BytesIO()
    pickler = _pickler_class()(buffer, protocol=5)
    pickler.inline = func
    pickler.dump(func)
    data = buffer.getvalue()
    _FUNCTIONS[func] = (sources, data)
    return data


def _plain(obj, depth: int = 0) -> bool:
    """Whether ``obj`` is small plain data (numbers, strings, bytes, None in a few tuples,
    lists and str-keyed dicts), which pickle writes as cloudpickle does."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    if depth > 2 or kind not in _CONTAINERS or len(obj) > 16:
        return False
    if kind is dict:
        for key, value in obj.items():
            if type(key) is not str or (type(value) not in _ATOMS
                                        and not _plain(value, depth + 1)):
                return False
        return True
    for value in obj:
        if type(value) not in _ATOMS and not _plain(value, depth + 1):
            return False
    return True


_ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes))
_CONTAINERS = frozenset((tuple, list, dict))


def dumps(obj) -> bytes:
    """``obj`` pickled by cloudpickle, with functions and modules in the light forms above
    (small plain data by pickle itself: no cloudpickle pickler to set up, 8 us a call)."""
    if _plain(obj):
        return pickle.dumps(obj, protocol=5)
    import io

    buffer = io.BytesIO()
    _pickler_class()(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


_PICKLER = None


def _pickler_class():
    global _PICKLER
    if _PICKLER is None:
        import cloudpickle

        from hetflow.executors.payload import _with_arguments

        # The reconstructors every payload names: by reference, without cloudpickle's
        # module lookups (twice each: 6 of its 8 per no-op task, ~50 Python calls).
        own = frozenset((_make_function, _set_function_state, _import, _with_arguments,
                         _function_from))

        class PayloadPickler(cloudpickle.Pickler):
            """cloudpickle, with closure-free by-value functions and modules in light forms."""

            inline = None      # the function being pickled alone (not from the cache)

            def reducer_override(self, obj):
                if type(obj) in _NATIVE:       # pickle's own (cloudpickle's says the same)
                    return NotImplemented
                if type(obj) is types.FunctionType:
                    if obj in own:
                        return NotImplemented
                    if obj.__closure__ is None and obj is not self.inline:
                        data = _cached(obj)
                        if data is None and not _by_reference(obj):
                            data = _function_bytes(obj)
                            if data is None:
                                return _reduce_function(obj)
                        if data is not None:
                            return _function_from, (data,)
                    elif obj.__closure__ is None and not _by_reference(obj):
                        return _reduce_function(obj)
                if type(obj) is types.ModuleType and _importable(obj):
                    return _import, (obj.__name__,)
                if isinstance(obj, type):
                    try:
                        if obj in _NAMED:
                            return NotImplemented
                    except TypeError:               # a metaclass that makes it unhashable
                        return super().reducer_override(obj)
                    reduced = super().reducer_override(obj)
                    if reduced is NotImplemented:       # cloudpickle: by name
                        _NAMED.add(obj)
                    return reduced
                return super().reducer_override(obj)

        _PICKLER = PayloadPickler
    return _PICKLER


def _by_reference(func: types.FunctionType) -> bool:
    from cloudpickle.cloudpickle import _should_pickle_by_reference

    return _should_pickle_by_reference(func)


def _importable(module: types.ModuleType) -> bool:
    from cloudpickle.cloudpickle import _should_pickle_by_reference

    return module.__name__ != "__main__" and _should_pickle_by_reference(module)


def _reduce_function(func: types.FunctionType):
    code = func.__code__
    names = _global_names(code)
    global_values = {name: func.__globals__[name] for name in names if name in func.__globals__}
    base = {key: func.__globals__[key] for key in ("__package__", "__name__", "__path__",
                                                   "__file__") if key in func.__globals__}
    attributes = {"__name__": func.__name__, "__qualname__": func.__qualname__,
                  "__module__": func.__module__, "__doc__": func.__doc__,
                  "__defaults__": func.__defaults__, "__kwdefaults__": func.__kwdefaults__,
                  "__annotations__": func.__annotations__}
    state = (global_values, _submodules(names, global_values), attributes, dict(func.__dict__))
    return (_make_function, (_VERSION, marshal.dumps(code), base), state, None, None,
            _set_function_state)


def _global_names(code: types.CodeType) -> list[str]:
    """Names ``code`` (and the code nested in it) may read as globals, in a stable order."""
    names = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_global_names(const)))
    return list(names)


def _submodules(names: list[str], global_values: dict) -> list[str]:
    """Imported submodules the code reaches through a global module (``os.path`` via ``os``).

    An attribute access does not import a submodule, so the rank imports each one the
    client had imported and the code names (as cloudpickle does).
    """
    wanted = set(names)
    found = []
    for value in global_values.values():
        if type(value) is not types.ModuleType:
            continue
        prefix = value.__name__ + "."
        for name in list(sys.modules):
            if name.startswith(prefix) and set(name[len(prefix):].split(".")) <= wanted:
                found.append(name)
    return sorted(found)
