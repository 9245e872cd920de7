"""Owner-only files: the umask a runtime's processes run with, private dirs, and what lies
under one.

Core and every runtime use these (``hetflow.runtime``, ``executors/taskdir.py``);
imports nothing heavy: ranks read it.
"""
from __future__ import annotations

import os

#: The user's umask, for the ranks (see :func:`user_umask`); infrastructure runs with 077.
UMASK_ENV = "HETFLOW_UMASK"
#: The umask of everything a runtime starts: what it creates is owner-only.
PRIVATE_UMASK = 0o077


def user_umask() -> int:
    """Give a rank process the client user's umask back before it runs user code; returns
    the umask it had, to set again after (a pool or RAPTOR worker outlives the task).

    A runtime's launchers, pilots and workers run with :data:`PRIVATE_UMASK` so the
    files they (and the third-party code in them) create are owner-only; the files a
    user's function writes follow the user's own umask, as if run without hetflow.
    """
    current = os.umask(PRIVATE_UMASK)
    wanted = current
    value = os.environ.get(UMASK_ENV)
    # Only a process that runs with the runtime's umask (not the client itself, as
    # under the debug runtime) changes it.
    if value and current == PRIVATE_UMASK:
        try:
            wanted = int(value, 8)
        except ValueError:
            pass
    os.umask(wanted)
    return current


class private_umask:   # lower case: used like a function, ``with private_umask():``
    """Within: umask 077 for this process, so third-party code (Parsl, RADICAL-Pilot)
    creates owner-only files, and the processes it starts keep that umask for life.

    The user's umask is restored on leaving, and exported in :data:`UMASK_ENV` for
    the ranks (:func:`user_umask`). The umask is per process: a file another thread
    of the client creates meanwhile is owner-only too (stricter, never looser).
    (A class, not ``contextlib``: ranks import this module.)
    """

    def __enter__(self):
        self._user = os.umask(PRIVATE_UMASK)
        if self._user != PRIVATE_UMASK:
            os.environ[UMASK_ENV] = f"{self._user:o}"
        return self

    def __exit__(self, *exc):
        os.umask(self._user)
        return False


def tighten(root: str) -> None:
    """Take group and other permissions off everything under ``root`` (links untouched):
    for files a third party chmods open on purpose (RP's bootstrap makes its scripts 0755)."""
    for parent, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = os.path.join(parent, name)
            try:
                mode = os.lstat(path).st_mode
                if mode & 0o077 and not os.path.islink(path):
                    os.chmod(path, mode & 0o7700)
            except OSError:       # gone meanwhile
                continue


def private_dir(path: str) -> str:
    """Create ``path`` and its missing parents owner-only; an existing ``path`` is tightened
    to 0700 (existing parents are left as they are).

    Not ``os.makedirs(mode=0o700)`` alone: it gives the parents it creates the umask's mode,
    and a rank runs under the user's umask (022: a world-readable ``tables/``).
    """
    missing = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:   # another rank made it meanwhile: tightened below
            pass
        os.chmod(directory, 0o700)
    if not missing:                       # made above: already chmodded (one syscall per task)
        os.chmod(path, 0o700)
    return path


def within(path: str, root: str) -> bool:
    """Whether the absolute ``path`` is ``root`` or lies under it (by name: ``root + "x"``,
    a sibling, does not)."""
    return path == root or path.startswith(root + os.sep)
