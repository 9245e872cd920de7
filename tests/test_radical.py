"""The ``radical`` executor beyond parity: its resource config, its files, and a clean exit.

One real pilot start/stop for the whole module (the parity suite holds the other).
"""
import json
import os

import psutil
import pytest

import hetflow

pytestmark = pytest.mark.timeout(300)


@hetflow.mpi_app(ranks=3, returns="all")
def sizes(comm):
    import os as _os
    return (comm.Get_rank(), comm.Get_size(), _os.getcwd())


def _radical_env():
    return {k: v for k, v in os.environ.items() if k.startswith("RADICAL_")}


def test_resource_config_dir_needs_a_label():
    from hetflow.executors.radical import RadicalExecutor

    with pytest.raises(hetflow.ConfigError, match="resource="):
        RadicalExecutor(resource_config_dir="/tmp")


def test_resource_config_dir_must_exist():
    from hetflow.executors.radical import RadicalExecutor

    with pytest.raises(hetflow.ConfigError, match="not a directory"):
        RadicalExecutor(resource="mysite.cluster", resource_config_dir="/nonexistent/cfg")


def test_local_config_template_is_packaged():
    from hetflow.executors._radical_config import local_resource_config

    cfg = local_resource_config(3, "/opt/mpi/bin/mpiexec", "/tmp/x")["localhost"]
    assert cfg["cores_per_node"] == 3
    assert cfg["launch_methods"]["MPIEXEC"]["pre_exec_cached"] == ["export PATH=/opt/mpi/bin:$PATH"]


def test_pilot_lifecycle_config_sandbox_and_clean_exit(tmp_path):
    from parsl.dataflow.dflow import DataFlowKernelLoader

    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    env_before = _radical_env()
    run_dir = tmp_path / "run"
    with hetflow.runtime("radical", run_dir=str(run_dir), max_ranks=3):
        executor = DataFlowKernelLoader.dfk().executors["radical"]
        base = executor.base
        # Everything RP writes lives under the run dir the user chose.
        assert base.startswith(str(run_dir))
        assert executor.session.path.startswith(base)
        sandbox = executor.pilot.description["sandbox"]
        assert sandbox.startswith(base)
        # hetflow's own resource config: the configured slot count, not RP's 8 cores.
        cfg_file = os.path.join(base, "config", ".radical", "pilot", "configs",
                                "resource_hetflow.json")
        with open(cfg_file) as fh:
            assert json.load(fh)["localhost"]["cores_per_node"] == 3
        assert executor.pilot.description["resource"] == "hetflow.localhost"
        assert os.environ["RADICAL_DEFAULT_IFACE"] == "lo"
        # A task as large as the pilot runs, on a communicator of exactly that size,
        # in its own task dir under the run dir.
        got = sizes().result(timeout=120)
        assert [(r, s) for r, s, _ in got] == [(0, 3), (1, 3), (2, 3)]
        assert all(cwd.startswith(base) for _, _, cwd in got)
        with pytest.raises(hetflow.ResourcesUnavailable, match="max_ranks=3"):
            sizes.options(ranks=4)().result(timeout=30)
        times = executor.times
        assert times.session_s > 0 and times.pilot_active_s > 0
        assert os.path.isdir(sandbox)
    # After the block: sandbox and session gone, nothing RP started still runs.
    assert times.close_s > 0
    assert not os.path.exists(base)
    assert (run_dir / "runinfo").is_dir()       # the user's run dir itself is kept
    from hetflow.executors._radical_config import processes_under
    assert processes_under([base]) == []
    leftover = [p for p in me.children(recursive=True) if p.pid not in children_before]
    leftover = [p for p in leftover if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert leftover == [], [p.cmdline() for p in leftover]
    assert _radical_env() == env_before
