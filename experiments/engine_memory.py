"""Peak memory per rank against its partition (``bench_engine --memory``): the engine's join,
sort and group-by on R ranks, int64 and string keys, each in an ``mpiexec`` launch of its own.

A rank's figure is bytes, not time: its resident set (Linux ``VmRSS``/``VmHWM``) at three
points of one launch, after the libraries are loaded and warmed up on 1,000 rows (``base``),
after its input partition is built and the allocators' free memory handed back (``data``),
and the highest during the operation (``peak``). ``(peak - base) / partition`` counts the
input partition itself, the output and all of the operation's scratch: the issue's goal is
at most 3. ``(peak - data) / partition`` is what the operation alone added.

Data: :func:`hetflow.frame.generate`'s (int64 ``key`` and ``value``, keys uniform in
``[0, 0.9 * rows)``, so a group-by makes about one group per row, its largest output); the
string case casts the key to its decimal text. Join: two such tables on ``key``; sort: one
by ``key``; group-by: one, the sum of ``value`` by ``key``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

OPS = ("join", "sort", "groupby")
KINDS = ("int64", "string")
#: The goal: a rank's peak above its base at most this many times its input partition.
GOAL = 3.0
SEEDS = {"left": 1, "right": 2}
_SELF = os.path.abspath(__file__)


def rss_mib() -> float:
    """Current resident set size (MiB)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Peak RSS since the last :func:`reset_peak` (Linux VmHWM), else since process start."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak() -> bool:
    """Restart the peak-RSS count (Linux >= 4.0: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def release_free_heap() -> None:
    """Hand the memory freed so far back to the OS (Arrow's pool's unused memory, then glibc's
    ``malloc_trim``), so a later RSS reading counts live data, not the allocators' leftovers."""
    import ctypes
    import gc

    import pyarrow as pa

    from hetflow.frame._backend import libc_function

    gc.collect()
    pa.default_memory_pool().release_unused()
    trim = libc_function("malloc_trim", ctypes.c_int, [ctypes.c_size_t])
    if trim is not None:
        trim(0)


# -- the ranks' side ------------------------------------------------------------------------
def _table(comm, rows: int, kind: str, seed: int):
    import pyarrow as pa

    from hetflow import frame
    from hetflow.frame._table import synthetic_partition

    t = synthetic_partition(comm.Get_rank(), comm.Get_size(), rows, seed=seed)
    if kind == "string":
        t = t.set_column(0, "key", t.column("key").cast(pa.string()))
    return frame.from_local(comm, t.combine_chunks())


def _run(op: str, left, right):
    from hetflow import frame

    if op == "join":
        return frame.join(left, right, on="key")
    if op == "sort":
        return frame.sort(left, "key")
    return left.groupby("key").agg({"value": "sum"})


def measure(comm, op: str, kind: str, rows: int) -> dict:
    """This rank's figures (MiB) for ``op`` on ``rows`` rows per rank and table (collective)."""
    warm = [_table(comm, 1000, kind, seed) for seed in SEEDS.values()]
    _run(op, *warm)
    del warm
    release_free_heap()
    base = rss_mib()
    tables = [_table(comm, rows, kind, SEEDS["left"])]
    if op == "join":
        tables.append(_table(comm, rows, kind, SEEDS["right"]))
    partition = sum(t.local.nbytes for t in tables) / 2**20
    release_free_heap()
    data = rss_mib()
    comm.Barrier()
    reset = reset_peak()
    out = _run(op, tables[0], tables[-1])
    peak = peak_rss_mib()
    out_mib = out.local.nbytes / 2**20
    del out
    return {"rank": comm.Get_rank(), "partition_mib": partition, "base_mib": base,
            "data_mib": data, "peak_mib": peak, "output_mib": out_mib, "peak_reset": reset}


def worker(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    every = comm.gather(measure(comm, args.op, args.key, args.rows_per_rank))
    if comm.Get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(every, fh)


# -- the driver -----------------------------------------------------------------------------
def launch(op: str, kind: str, rows_per_rank: int, ranks: int, timeout: float) -> list:
    """One ``mpiexec`` launch measuring ``op`` on ``kind`` keys: every rank's figures."""
    from hetflow.executors.launch import launcher_env

    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = local if os.path.exists(local) else "mpiexec"
    with tempfile.TemporaryDirectory(prefix="hetflow-memory-") as tmp:
        out = os.path.join(tmp, "memory.json")
        cmd = [mpiexec, "-n", str(ranks), sys.executable, _SELF, "--op", op, "--key", kind,
               "--rows-per-rank", str(rows_per_rank), "--out", out]
        subprocess.run(cmd, check=True, timeout=timeout, env=launcher_env(mpiexec))
        with open(out) as fh:
            return json.load(fh)


def ratios(m: dict):
    """``(peak - base) / partition`` and ``(peak - data) / partition`` of one rank's figures."""
    return ((m["peak_mib"] - m["base_mib"]) / m["partition_mib"],
            (m["peak_mib"] - m["data_mib"]) / m["partition_mib"])


def report(rows_per_rank: int, ranks: int, timeout: float, ops=OPS, kinds=KINDS) -> dict:
    """Every (op, key kind) measured and printed, one line per rank; ``{"op kind": ranks'
    figures}``."""
    print(f"peak memory per rank: {ranks} ranks, {rows_per_rank:,} rows per rank and table, "
          f"goal (peak - base) / partition <= {GOAL:g}", flush=True)
    print(f"{'op':<8} {'key':<7} {'rank':>4} {'partition MiB':>14} {'base':>8} {'data':>8} "
          f"{'peak':>8} {'output':>8} {'(peak-base)/part':>17} {'(peak-data)/part':>17}")
    found = {}
    for op in ops:
        for kind in kinds:
            every = launch(op, kind, rows_per_rank, ranks, timeout)
            found[f"{op} {kind}"] = every
            for m in every:
                whole, own = ratios(m)
                print(f"{op:<8} {kind:<7} {m['rank']:>4} {m['partition_mib']:>14.1f} "
                      f"{m['base_mib']:>8.1f} {m['data_mib']:>8.1f} {m['peak_mib']:>8.1f} "
                      f"{m['output_mib']:>8.1f} {whole:>17.2f} {own:>17.2f}", flush=True)
    print("base: RSS with the libraries loaded and warmed up, before the input; data: after the "
          "input is built; peak: highest RSS during the operation (VmHWM); MiB")
    return found


def main(argv=None) -> int:
    """The ranks' side of one launch (the driver is ``bench_engine --memory``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=OPS, required=True)
    ap.add_argument("--key", choices=KINDS, required=True)
    ap.add_argument("--rows-per-rank", type=int, required=True)
    ap.add_argument("--out", required=True)
    worker(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
