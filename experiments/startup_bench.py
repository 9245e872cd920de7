"""Start-up cost of launch-per-task ranks, as ratios measured side by side in one run.

``python -m experiments.startup_bench [--reps N]`` prints three ratios (median over
``N`` interleaved repetitions, default 9) and the absolute medians behind them:

(a) **task**: a 2-rank no-op MPI app through ``hetflow.runtime("mpirun")``, wall time
    from submit to result (after a warm-up task), over a bare
    ``mpiexec -n 2 python -c "from mpi4py import MPI"`` (this venv's mpiexec and python).
    An ``@mpi_app`` function travels by value (its module's name for it is the app, not
    the function), in the form ``executors/_pickling.py`` writes: the ranks load it
    without importing cloudpickle.
(b) **rank imports**: importing the rank runner (``hetflow.executors._rank``) and mpi4py
    in a fresh interpreter, over importing mpi4py alone (times taken inside the
    process, so interpreter start-up is not in either); and the modules outside the
    standard library the runner pulls in.
(c) **frame import**: ``from hetflow import frame`` over
    ``import numpy, pyarrow.compute; from mpi4py import MPI``, timed the same way.

The machine may be shared: each repetition runs every measurement once, in rotated
order, so background load hits all of them alike; only medians are compared. Every
process starts in an empty directory (the interpreter lists its working directory
when it first imports), and hetflow's modules are byte-compiled first, as an
installed package is: under ``PYTHONDONTWRITEBYTECODE`` an editable install would
otherwise recompile them in every rank.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import hetflow
from hetflow.executors.launch import default_mpiexec

PYTHON = sys.executable

#: In-process import timings: the statement to time, run by a fresh interpreter.
IMPORTS = {
    "mpi4py": "from mpi4py import MPI",
    "rank_runner": "import hetflow.executors._rank; from mpi4py import MPI",
    "frame_floor": "import numpy, pyarrow.compute; from mpi4py import MPI",
    "frame": "from hetflow import frame",
}

_TIMER = ("import time, sys; t0 = time.perf_counter(); exec(sys.argv[1]); "
          "print(time.perf_counter() - t0)")


@hetflow.mpi_app(ranks=2)
def noop(comm):
    """A task that does nothing: what is left is start-up and tear-down."""
    return None


def time_import(statement: str, cwd: str) -> float:
    """Seconds a fresh interpreter spends on ``statement`` (start-up excluded)."""
    out = subprocess.run([PYTHON, "-c", _TIMER, statement], check=True, capture_output=True,
                         text=True, cwd=cwd).stdout
    return float(out.strip().splitlines()[-1])


def time_bare(mpiexec: str, cwd: str) -> float:
    """Wall seconds of ``mpiexec -n 2 python -c "from mpi4py import MPI"``."""
    t0 = time.perf_counter()
    subprocess.run([mpiexec, "-n", "2", PYTHON, "-c", "from mpi4py import MPI"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    return time.perf_counter() - t0


def time_task(app) -> float:
    """Wall seconds from submitting a no-op ``app`` task to holding its result."""
    t0 = time.perf_counter()
    app().result()
    return time.perf_counter() - t0


def non_stdlib_imports(statement: str, cwd: str) -> list:
    """Top-level modules outside the standard library that ``statement`` imports (extension
    modules' internals such as Cython's runtime left out)."""
    probe = (f"{statement}\nimport sys, json\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} - "
             "set(sys.stdlib_module_names))))")
    out = subprocess.run([PYTHON, "-c", probe], check=True, capture_output=True, text=True,
                         cwd=cwd).stdout
    internal = ("__", "_cython_", "cython_runtime", "_sysconfigdata_", "_distutils_hack")
    return [m for m in json.loads(out.strip().splitlines()[-1]) if not m.startswith(internal)]


def byte_compile() -> None:
    """Write hetflow's bytecode caches (what ``pip install`` does for a regular install)."""
    import hetflow.executors

    for package in (hetflow, hetflow.executors):
        for folder in package.__path__:
            compileall.compile_dir(folder, quiet=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.startup_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="repetitions (median of; >= 7)")
    args = parser.parse_args(argv)
    mpiexec = default_mpiexec()
    byte_compile()
    cwd = tempfile.mkdtemp(prefix="startup-bench-")
    samples = {name: [] for name in ["bare", "task", *IMPORTS]}
    steps = [("bare", lambda: time_bare(mpiexec, cwd)), ("task", lambda: time_task(noop))]
    steps += [(name, lambda s=statement: time_import(s, cwd))
              for name, statement in IMPORTS.items()]
    with hetflow.runtime("mpirun", max_ranks=2):
        noop().result()                     # warm-up: first-use costs are not per task
        time_bare(mpiexec, cwd)
        for rep in range(args.reps):
            shift = rep % len(steps)
            for name, step in steps[shift:] + steps[:shift]:
                samples[name].append(step())
    med = {name: statistics.median(values) for name, values in samples.items()}
    print(f"median of {args.reps} interleaved repetitions (seconds)")
    for name, value in med.items():
        print(f"  {name:12s} {value:8.4f}   (min {min(samples[name]):.4f}, "
              f"max {max(samples[name]):.4f})")
    print("ratios (target)")
    print(f"  (a) mpirun no-op task / bare mpiexec+mpi4py      {med['task'] / med['bare']:6.2f}x"
          "  (<= 1.3)")
    print(f"  (b) import rank runner+mpi4py / mpi4py           "
          f"{med['rank_runner'] / med['mpi4py']:6.2f}x")
    print(f"  (c) from hetflow import frame / numpy+pa.compute+mpi4py "
          f"{med['frame'] / med['frame_floor']:6.2f}x  (<= 1.15)")
    print("rank runner imports beyond the standard library:",
          ", ".join(non_stdlib_imports(IMPORTS["rank_runner"], cwd)))
    print("from hetflow import frame imports beyond the standard library:",
          ", ".join(non_stdlib_imports(IMPORTS["frame"], cwd)))
    os.rmdir(cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
