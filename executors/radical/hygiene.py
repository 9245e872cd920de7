"""RADICAL-Pilot hygiene: what a client must do so RP leaves nothing behind.

RP reads its directories from the environment, daemonises its bridges and agent
(so they are not the client's children), and after ``session.close()`` its
client still holds ~80 descriptors (ZMQ sockets and contexts, log handlers,
profilers, files ``ru.write_json`` never closed). Nothing here is about running
tasks: :mod:`hetflow.executors.radical` uses it around one session's life.
"""
from __future__ import annotations

import gc
import io
import logging
import os
import threading
from typing import Dict, List, Optional

import psutil

from hetflow.executors._forensics import end_processes, processes_under


def import_rp():
    """``radical.pilot``, without its warning that ``logging`` was imported first.

    radical.utils patches ``logging`` for fork safety and warns when it comes too
    late; hetflow never forks with logging locks held, and the warning would fail
    any program (or test suite) that turns warnings into errors.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import radical.pilot as rp
    return rp


def set_environment(env: Dict[str, str]) -> Dict[str, Optional[str]]:
    """Set each non-empty ``env`` value in ``os.environ``; return what each key was before."""
    saved = {}
    for key, value in env.items():
        saved[key] = os.environ.get(key)
        if value:
            os.environ[key] = value
    return saved


def restore_environment(saved: Dict[str, Optional[str]]) -> None:
    """Undo :func:`set_environment` (``saved`` is its return value; emptied here)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    saved.clear()


def session_processes(base: str) -> List[psutil.Process]:
    """Live processes started for the RP session whose files live under ``base``: RP
    daemonises its bridges and agent (their parent is init), so they are found by
    working directory or by the ``RADICAL_PILOT_BASE`` in their environment."""
    return processes_under(base, "RADICAL_PILOT_BASE")


def end_leftovers(base: str, children: List[psutil.Process]) -> None:
    """Kill whatever RP left running after its session closed: the client's ``children``
    that RP started (see :func:`started_during`) and the session's daemons. The client's
    other children (the user's, another runtime's) are not RP's to end."""
    end_processes(list(children) + session_processes(base))


def client_children() -> set:
    """The client's live child processes, all generations (``psutil.Process`` objects: equal
    only for the same pid and start time)."""
    return set(psutil.Process().children(recursive=True))


def started_during(before: set) -> List[psutil.Process]:
    """The client's children that were not there ``before`` (:func:`client_children`): RP's,
    when taken around RP's own calls (its proxy forks the client for each session). A
    process another thread of the client starts meanwhile would be counted too."""
    return [proc for proc in client_children() if proc not in before]


def rp_zmq_objects() -> set:
    """Ids of the live radical.utils.zmq objects (publishers, queues, registry clients)."""
    return {id(obj) for obj in gc.get_objects() if _is_rp_zmq(obj)}


def _is_rp_zmq(obj) -> bool:
    # type(obj), never isinstance(obj, ...): isinstance reads obj.__class__, which some
    # objects answer with a warning (torch.distributed.reduce_op's deprecation wrapper)
    cls = type(obj)
    module = cls.__dict__.get("__module__") if not issubclass(cls, type) else None
    return isinstance(module, str) and module.startswith("radical.utils.zmq")


def _stop_listeners(objs) -> None:
    """End the threads that poll ``objs``' sockets (a ZMQ socket must not be closed under
    another thread's poll): RP's subscribers each run one, its queue getters one per
    address. Each polls 0.5 s between looks at its stop event; all are told first, then
    joined. A getter's listener, socket and callbacks live in a class-wide table keyed by
    address (``Getter._callbacks``), which RP never clears: this session's entries are
    removed, so that a later session whose bridge gets the same port starts afresh."""
    listeners, tables = [], []
    for obj in objs:
        term, thread = getattr(obj, "_term", None), getattr(obj, "_thread", None)
        if isinstance(thread, threading.Thread):
            listeners.append((term, thread))
        url, table = getattr(obj, "_url", None), getattr(type(obj), "_callbacks", None)
        entry = table.get(url) if url and isinstance(table, dict) else None
        if isinstance(entry, dict):
            tables.append((table, url))
            if isinstance(entry.get("thread"), threading.Thread):
                listeners.append((entry.get("term"), entry["thread"]))
    for term, _thread in listeners:
        if isinstance(term, threading.Event):
            term.set()
    for _term, thread in listeners:
        if thread is not threading.current_thread():
            thread.join(timeout=5)
    for table, url in tables:
        table.pop(url, None)


def release_client_handles(base: str, before: set) -> None:
    """Close what RP's client keeps open after ``session.close()`` (~80 descriptors).

    RP 1.103 leaves, per session: its ZMQ publishers, subscribers, queues and
    registry clients with their sockets and private contexts ("rely on GC for
    destruction", but the objects stay referenced); log handlers and profilers
    writing into the session dir; and one descriptor per ``ru.write_json`` call,
    which discards the fd ``tempfile.mkstemp`` returns. Only what this session made
    is closed: zmq objects not in ``before`` (:func:`rp_zmq_objects` taken when the
    session started), files under ``base``.
    """
    import zmq

    shared = zmq.Context._instance            # RP's subscribers share it; it stays
    ours = [obj for obj in gc.get_objects() if id(obj) not in before and _is_rp_zmq(obj)]
    _stop_listeners(ours)
    for obj in ours:
        values = []
        for value in getattr(obj, "__dict__", {}).values():
            values.extend(value if isinstance(value, (list, tuple)) else [value])
        for value in values:
            if isinstance(value, zmq.Socket) and not value.closed:
                value.close(linger=0)
        for value in values:
            if isinstance(value, zmq.Context) and value is not shared and not value.closed:
                value.destroy(linger=0)
    prefix = base + os.sep
    loggers = [logging.getLogger()] + [each for each in
                                       logging.Logger.manager.loggerDict.values()
                                       if isinstance(each, logging.Logger)]
    for each in loggers:
        for handler in list(each.handlers):
            if getattr(handler, "baseFilename", "").startswith(prefix):
                each.removeHandler(handler)
                handler.close()
    try:
        from radical.utils import profile
        for entry in list(profile._profilers):
            profiler, fname = entry
            if str(fname).startswith(prefix):
                profiler.close()
                profile._profilers.remove(entry)
    except (ImportError, AttributeError, ValueError):
        pass
    # Contexts RP dropped without destroying sit in reference cycles: collect them now.
    gc.collect()
    # Descriptors into the session dir that no Python file object owns: write_json's.
    owned = {obj.fileno() for obj in gc.get_objects()
             if issubclass(type(obj), io.FileIO) and not obj.closed}   # type(): see _is_rp_zmq
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix) and fd not in owned:
            try:
                os.close(fd)
            except OSError:
                pass
