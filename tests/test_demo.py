"""The README's main job: ``hetflow demo`` (Cylon join -> sort under bare mpirun)."""
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_demo_runs_the_pipeline_and_checks_itself():
    exe = os.path.join(os.path.dirname(sys.executable), "hetflow")
    proc = subprocess.run([exe, "demo", "--rows", "5000"], capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo: ok" in proc.stdout
    assert "2 rank(s) via mpirun" in proc.stdout and "1 rank(s) via mpirun" in proc.stdout
    assert "MISMATCH" not in proc.stdout
