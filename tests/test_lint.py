"""The code passes ruff with the project's configuration (pyproject.toml [tool.ruff])."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_passes():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is a test dependency (hetflow[testing]); install it")
    proc = subprocess.run([ruff, "check", "--no-cache", ROOT], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_runtimes_use_only_the_kernels_public_methods():
    """No runtime reads a kernel attribute named ``_...``: the hooks it defines are its own,
    everything else it calls is the documented surface in kernel.py's docstring."""
    import re

    executors = os.path.join(ROOT, "executors")
    kernel = open(os.path.join(executors, "kernel.py")).read()
    hooks = {"_start", "_stop", "_start_runtime", "_stop_runtime", "_admit", "_head_blocked",
             "_make_scheduler", "_slots_needed"}
    private = set(re.findall(r"self\.(_\w+)", kernel)) - hooks
    assert {"_lock", "_live", "_scheduler"} <= private
    uses = re.compile(r"self\.(%s)\b" % "|".join(sorted(private)))
    touched = []
    for root, _, files in os.walk(executors):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and name != "kernel.py":
                for number, line in enumerate(open(path), 1):
                    if uses.search(line):
                        touched.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not touched, "runtimes reading the kernel's private names:\n" + "\n".join(touched)
