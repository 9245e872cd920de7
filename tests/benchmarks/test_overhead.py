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


def _bare_mpi():
    # The floor of any Python MPI task: the same launch plus importing mpi4py (MPI_Init).
    subprocess.run([default_mpiexec(), "-n", "2", sys.executable, "-c", "from mpi4py import MPI"],
                   check=True)


def _app():
    noop().result()


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@pytest.mark.timeout(600)
def test_mpirun_task_vs_bare_mpiexec(benchmark):
    with hetflow.runtime("mpirun"):
        _app(), _bare(), _bare_mpi()                      # warm caches, imports, launcher
        bare, bare_mpi, app = [], [], []
        for _ in range(ROUNDS):
            bare.append(_timed(_bare))
            bare_mpi.append(_timed(_bare_mpi))
            app.append(_timed(_app))
        benchmark.pedantic(_app, rounds=ROUNDS, iterations=1)
    med_bare, med_mpi, med_app = map(statistics.median, (bare, bare_mpi, app))
    ratio = med_app / med_bare
    benchmark.extra_info.update(bare_mpiexec_median_s=med_bare, bare_mpi4py_median_s=med_mpi,
                                mpirun_task_median_s=med_app, ratio=ratio,
                                ratio_vs_mpi4py=med_app / med_mpi)
    print(f"\nno-op 2-rank task through MpirunExecutor: median {med_app*1e3:.0f} ms;"
          f" bare `mpiexec -n 2 python -c pass`: {med_bare*1e3:.0f} ms (ratio {ratio:.2f}x);"
          f" bare `mpiexec -n 2 python -c 'from mpi4py import MPI'`: {med_mpi*1e3:.0f} ms"
          f" (ratio {med_app / med_mpi:.2f}x)")
