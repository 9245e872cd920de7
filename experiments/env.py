"""Host facts and library versions recorded with every measurement."""
from __future__ import annotations

import functools
import os
import platform
import socket
from importlib import metadata


@functools.lru_cache(maxsize=None)
def host_info() -> dict:
    """Where the run happened: host, CPUs, memory, OS, Python."""
    try:
        import psutil

        mem_gib = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # noqa: BLE001 - psutil is a dependency; stay useful without it anyway
        mem_gib = None
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "mem_gib": mem_gib,
            "platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version()}


_PACKAGES = ("hetflow", "pyarrow", "numpy", "mpi4py", "mpich", "parsl", "radical.pilot",
             "pyzmq", "polars", "duckdb", "pycylon", "cupy-cuda12x")


@functools.lru_cache(maxsize=None)
def library_versions() -> dict:
    """Installed versions of the libraries that shape the figures (absent ones left out)."""
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
