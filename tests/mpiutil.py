"""Run a small Python script under a real ``mpiexec -n N`` and read back each rank's report.

Inside the script, call ``mpiutil.report(obj)`` (at most once per rank) to send a
picklable object back to the test. The launch always has a timeout and the
whole process group is killed on expiry, so a test can never leave a hung mpiexec.
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_ENV = "HETFLOW_TEST_OUT"


def mpiexec() -> str:
    """The MPI launcher of this environment: ``$HETFLOW_MPIEXEC``, else the mpich wheel's
    (next to the interpreter), else the one on PATH."""
    if os.environ.get("HETFLOW_MPIEXEC"):
        return shutil.which(os.environ["HETFLOW_MPIEXEC"])
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else (shutil.which("mpiexec") or "mpiexec")


def report(obj: Any) -> None:
    """Send ``obj`` back to the test that launched this rank."""
    from mpi4py import MPI

    out = os.environ[OUT_ENV]
    rank = MPI.COMM_WORLD.Get_rank()
    tmp = os.path.join(out, f".rank-{rank}.tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(obj, fh)
    os.replace(tmp, os.path.join(out, f"rank-{rank}.pkl"))


@dataclass
class MPIRun:
    returncode: int
    stdout: str
    stderr: str
    reports: Dict[int, Any] = field(default_factory=dict)

    def check(self) -> "MPIRun":
        """Raise with the ranks' output if the launch failed or a rank did not report."""
        if self.returncode != 0:
            raise AssertionError(f"mpiexec exited {self.returncode}\nstdout:\n{self.stdout}\n"
                                 f"stderr:\n{self.stderr}")
        return self

    def values(self, n: int) -> list:
        self.check()
        missing = [r for r in range(n) if r not in self.reports]
        assert not missing, f"ranks {missing} did not report\nstderr:\n{self.stderr}"
        return [self.reports[r] for r in range(n)]


def run_mpi(source: str, n: int, *, timeout: float = 120, args=(),
            env: Optional[Dict[str, str]] = None) -> MPIRun:
    """Run ``source`` (Python code) on ``n`` ranks; returns every rank's report."""
    work = tempfile.mkdtemp(prefix="hetflow-mpitest-")
    try:
        script = os.path.join(work, "script.py")
        with open(script, "w") as fh:
            fh.write(textwrap.dedent(source))
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env[OUT_ENV] = work
        full_env["PYTHONPATH"] = os.pathsep.join(
            [HERE] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        from hetflow.executors.launch import launcher_env, mpiexec_command

        full_env = launcher_env(mpiexec(), full_env)    # Open MPI as root needs its opt-in
        # mpiexec -n N [--oversubscribe for Open MPI], then our script instead of the rank runner
        cmd = mpiexec_command(mpiexec(), n)[:-2] + [script, *map(str, args)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, cwd=work, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise AssertionError(f"mpiexec -n {n} timed out after {timeout}s\nstdout:\n{stdout}\n"
                                 f"stderr:\n{stderr}") from None
        reports = {}
        for name in os.listdir(work):
            if name.startswith("rank-") and name.endswith(".pkl"):
                with open(os.path.join(work, name), "rb") as fh:
                    reports[int(name[5:-4])] = pickle.load(fh)
        return MPIRun(proc.returncode, stdout, stderr, reports)
    finally:
        shutil.rmtree(work, ignore_errors=True)
