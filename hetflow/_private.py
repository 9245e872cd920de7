"""Owner-only files: the umask a runtime's processes run with, and private dirs.

Core and every runtime use these (``hetflow.runtime``, ``executors/taskdir.py``);
imports nothing heavy: ranks read it.
"""
from __future__ import annotations

import os

#: The user's umask, for the ranks (see :func:`user_umask`); infrastructure runs with 077.
UMASK_ENV = "HETFLOW_UMASK"
#: The umask of everything a runtime starts: what it creates is owner-only.
PRIVATE_UMASK = 0o077


def user_umask() -> None:
    """Give a rank process the client user's umask back before it runs user code.

    A runtime's launchers, pilots and workers run with :data:`PRIVATE_UMASK` so the
    files they (and the third-party code in them) create are owner-only; the files a
    user's function writes follow the user's own umask, as if run without hetflow.
    """
    value = os.environ.get(UMASK_ENV)
    if not value:
        return
    current = os.umask(PRIVATE_UMASK)
    try:
        # Only a process that runs with the runtime's umask (not the client itself, as
        # under the debug runtime) changes it.
        current = int(value, 8) if current == PRIVATE_UMASK else current
    except ValueError:
        pass
    os.umask(current)


class private_umask:  # noqa: N801 - used like a function: ``with private_umask():``
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


def private_dir(path: str) -> str:
    """Create ``path`` (and parents) owner-only; an existing dir is tightened to 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path
