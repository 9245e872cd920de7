"""A world that exits through no fault of its task loses no task (issue 40, item 4).

The 100,000-task soak lost one task: its world exited with code 86 (``KILLED_EXIT``): the
ranks' control threads heard no heartbeat acknowledgement for ``HETFLOW_POOL_ORPHAN`` s
(30) while the broker thread waited for the kernel's lock behind 100,000 queued tasks, took
the client for gone and ended their ranks; the pool then failed the running task with
TaskLost, as if it had killed its rank.
"""
import time

import pytest

import hetflow
from test_pool import pool, wait_for

pytestmark = pytest.mark.timeout(120)


@hetflow.mpi_app(ranks=1)
def nap(comm, marker, seconds, value):
    open(marker, "w").close()
    time.sleep(seconds)
    return value


def test_a_broker_that_stalls_past_the_orphan_timeout_loses_no_task(tmp_path):
    with pool(max_ranks=2, heartbeat_s=0.2, env={"HETFLOW_POOL_ORPHAN": "1.5"}) as executor:
        short = nap(str(tmp_path / "short"), 0.3, "short")
        long = nap(str(tmp_path / "long"), 4.0, "long")
        wait_for(str(tmp_path / "short"))
        wait_for(str(tmp_path / "long"))
        executor.remember()
        # The broker waits for the kernel's lock as the first task ends: no acknowledgements
        # for 3.5 s, over twice the ranks' orphan timeout, while the second task runs.
        with executor.placement():
            time.sleep(3.5)
        assert short.result(timeout=60) == "short"
        assert long.result(timeout=60) == "long"
        assert nap(str(tmp_path / "after"), 0, "after").result(timeout=60) == "after"
        executor.remember()
        assert not [e for e in executor.events if "lost" in e or "died" in e], executor.events
