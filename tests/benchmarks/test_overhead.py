"""Per-task overhead of the bare-metal executor against a bare ``mpiexec`` (pytest-benchmark).

Run with ``pytest tests/benchmarks --benchmark-only -s``. Both are measured in the
same run, interleaved, so machine noise hits them alike; the ratio is printed
and stored in the benchmark's ``extra_info``. Nothing here fails on a time.
"""
import statistics
import subprocess
import sys
import time

import pytest

import hetflow
from hetflow.executors.launch import default_mpiexec

ROUNDS = 10


@hetflow.mpi_app(ranks=2)
def noop(comm):
    return None


def _bare():
    subprocess.run([default_mpiexec(), "-n", "2", sys.executable, "-c", "pass"], check=True)


def _app():
    noop().result()


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@pytest.mark.timeout(600)
def test_mpirun_task_vs_bare_mpiexec(benchmark):
    with hetflow.runtime("mpirun"):
        _app(), _bare()                                   # warm caches, imports, launcher
        bare, app = [], []
        for _ in range(ROUNDS):
            bare.append(_timed(_bare))
            app.append(_timed(_app))
        benchmark.pedantic(_app, rounds=ROUNDS, iterations=1)
    ratio = statistics.median(app) / statistics.median(bare)
    benchmark.extra_info.update(bare_mpiexec_median_s=statistics.median(bare),
                                mpirun_task_median_s=statistics.median(app), ratio=ratio)
    print(f"\nno-op 2-rank task through MpirunExecutor: median {statistics.median(app)*1e3:.0f} ms;"
          f" bare `mpiexec -n 2 python -c pass`: {statistics.median(bare)*1e3:.0f} ms;"
          f" ratio {ratio:.2f}x")
