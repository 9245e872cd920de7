"""Small edges a new user meets first: the version flag, a runtime whose extra is missing,
what the README promises about the debug runtime."""
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

import hetflow

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=os.path.expanduser("~"))


def test_version_flag_prints_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "hetflow", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hetflow {version('hetflow')}" == f"hetflow {hetflow.__version__}"


def test_radical_without_its_extra_is_not_listed_and_names_the_install_command():
    # ``None`` in sys.modules makes ``import radical`` fail as it does where the package is
    # not installed; the rest of this interpreter is an ordinary client.
    out = _python(
        "import sys; sys.modules['radical'] = None\n"
        "import hetflow\n"
        "names = sorted(hetflow.available_runtimes())\n"
        "assert 'radical' not in names and {'mpirun', 'pool', 'debug'} <= set(names), names\n"
        "try:\n"
        "    with hetflow.runtime('radical'):\n"
        "        pass\n"
        "except hetflow.ConfigError as error:\n"
        "    print(error)\n")
    assert out.returncode == 0, out.stderr
    assert "pip install 'hetflow[radical]'" in out.stdout, out.stdout
    # ...and where it is installed, it is listed.
    pytest.importorskip("radical.pilot")
    assert "radical" in hetflow.available_runtimes()


@hetflow.mpi_app
def one(comm):
    return comm.Get_size()


def test_readme_says_what_the_debug_runtime_refuses():
    readme = open(os.path.join(ROOT, "README.md")).read()
    intro = readme.split("## Example")[0]
    assert re.search(r"debug.*refuses.*ranks.*walltime", " ".join(intro.split())), intro
    with hetflow.runtime("debug"):
        assert one().result() == 1
        with pytest.raises(hetflow.NotSupported, match="walltime"):
            one.options(walltime=5)()
        with pytest.raises(hetflow.ResourcesUnavailable, match="2 rank"):
            one.options(ranks=2)()


def test_private_dir_makes_its_missing_parents_owner_only(tmp_path):
    # A rank runs under the user's umask when it writes a returned table: the parents it
    # creates (runinfo/000/<label>/tables) must be owner-only too, not the umask's 0755.
    import stat

    from hetflow._private import private_dir

    old = os.umask(0o022)
    try:
        leaf = private_dir(str(tmp_path / "runinfo" / "000" / "radical" / "tables" / "task-1"))
    finally:
        os.umask(old)
    path = tmp_path
    for part in ("runinfo", "000", "radical", "tables", "task-1"):
        path = path / part
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    assert leaf == str(path)
