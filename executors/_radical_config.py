"""RADICAL-Pilot plumbing for the ``radical`` executor: resource config, environment, leftovers.

Kept apart from ``radical.py`` so the executor reads as the task life cycle only.
"""
from __future__ import annotations

import json
import os
import time
from importlib import resources as importlib_resources
from typing import Dict, Iterable, List, Optional

import psutil

#: The resource label of hetflow's own single-node config (``resource_hetflow.json``).
LOCAL_RESOURCE = "hetflow.localhost"


def local_resource_config(cores: int, mpiexec: str, workdir: str) -> dict:
    """hetflow's ``local.localhost``: the real slot count and the venv's mpiexec.

    RP's stock ``local.localhost`` claims 8 cores per node; on a smaller machine
    its mpiexec then pins ranks to cores that don't exist and MPI tasks fail
    with empty stderr. Here ``cores_per_node`` is the slot count hetflow uses,
    and the MPIEXEC launch method finds *this* environment's mpiexec: RP looks
    the launcher up in the pilot's original environment, so its directory is
    put first on ``PATH`` there (``pre_exec_cached`` is evaluated before the look-up).
    """
    with importlib_resources.files("hetflow.executors").joinpath(
            "resource_configs/resource_hetflow.json").open() as fh:
        config = json.load(fh)
    entry = config["localhost"]
    entry["cores_per_node"] = cores
    entry["default_remote_workdir"] = workdir
    path_fix = f"export PATH={os.path.dirname(mpiexec)}:$PATH"
    entry["launch_methods"]["MPIEXEC"]["pre_exec_cached"] = [path_fix]
    entry["pre_bootstrap_0"] = [path_fix]
    return config


def write_local_config(config_home: str, config: dict) -> str:
    """Write ``config`` where RP looks for user configs under ``RADICAL_CONFIG_USER_DIR``."""
    configs = os.path.join(config_home, ".radical", "pilot", "configs")
    os.makedirs(configs, exist_ok=True)
    path = os.path.join(configs, "resource_hetflow.json")
    with open(path, "w") as fh:
        json.dump(config, fh, indent=1)
    return path


class scoped_environ:
    """Set environment variables for the runtime's life, restore them afterwards.

    RP reads its settings (config dir, interface, reporter) from the client's
    environment and hands it on to every component and the pilot it starts.
    """

    def __init__(self, values: Dict[str, Optional[str]]):
        self.values = values
        self.saved: Dict[str, Optional[str]] = {}

    def apply(self) -> None:
        for key, value in self.values.items():
            self.saved.setdefault(key, os.environ.get(key))
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def restore(self) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved.clear()


def processes_under(paths: Iterable[str]) -> List[psutil.Process]:
    """Live processes whose command line or working dir mentions one of ``paths``.

    The pilot's bootstrap is started detached (re-parented to init), so a
    child-process walk from the client misses it; its sandbox path doesn't.
    """
    paths = [os.path.abspath(p) for p in paths if p]
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        if proc.info["pid"] == me:
            continue
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
            cwd = proc.info["cwd"] or ""
        except (psutil.Error, TypeError):
            continue
        if any(p in cmdline or cwd == p or cwd.startswith(p + os.sep) for p in paths):
            found.append(proc)
    return found


def end_processes(paths: Iterable[str], grace: float = 5.0) -> List[int]:
    """Wait up to ``grace`` s for processes under ``paths`` to exit, then SIGKILL them.

    Returns the pids that had to be killed (RP's own close normally ends them all).
    """
    deadline = time.time() + grace
    while True:
        left = processes_under(paths)
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    killed = []
    for proc in left:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return killed
