"""hetflow.torch against its baselines, side by side in one run.

``python -m hetflow.experiments.torch_bench [--reps N] [--rows N] [--steps N]`` prints:

(a) **DDP step**: the same training loop (a 64→256→1 MLP on 256 rows a step, 2 ranks, Gloo,
    one thread a rank) launched as a 2-rank ``@mpi_app`` through the ``mpirun`` runtime in
    ``hetflow.torch.process_group()``, and by ``torchrun --standalone --nproc-per-node 2``
    (``init_process_group("gloo")`` from its environment). Median step time (rank 0, after
    5 warm-up steps) and its ratio; and **submit to first step**: from the client's submit
    (hetflow) or ``Popen`` (torchrun) to rank 0 starting its first step, in wall-clock
    time; and the ratio.
(b) **hand-off** of ``--rows`` rows into tensors, in one process: ``hetflow.torch.batches``
    on one float32 column and on four stacked, against Deep RC's path
    (``to_pandas`` → ``to_numpy`` → ``astype`` → ``torch.from_numpy``; only the columns used
    go to pandas). One torch thread, as a rank with ``cores_per_rank=1`` has. Time (median) and
    bytes copied: every intermediate that is a fresh buffer rather than a view of its
    source counts (``copied_bytes`` for hetflow, checked by address).

Repetitions interleave the compared runs, so background load hits them alike; only medians
are compared. Prints a JSON line at the end (``--out`` also writes it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import hetflow

#: The training loop's shape (as RUNTIMES.md's measurement: 64→256→1 MLP, 256 rows a step).
IN, HIDDEN, ROWS_PER_STEP, WARMUP = 64, 256, 256, 5


def steps_loop(rank: int, steps: int, submitted: float) -> dict:
    """The training loop both launchers run (a group is up): per-step times and when the
    first step started (wall clock), relative to ``submitted``."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS_PER_STEP, IN, generator=g)
    y = torch.randn(ROWS_PER_STEP, 1, generator=g)
    first = None
    times = []
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        if first is None:
            first = time.time()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[WARMUP:]), "to_first_step_s": first - submitted}


@hetflow.mpi_app(ranks=2)
def hetflow_ddp(comm, steps: int, submitted: float):
    import hetflow.torch as ht

    with ht.process_group():
        return steps_loop(comm.Get_rank(), steps, submitted)


def _torchrun_worker(out: str, steps: int, submitted: float) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    got = steps_loop(dist.get_rank(), steps, submitted)
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(got, fh)
    # every rank done, then out without torch's teardown: a rank leaving through
    # destroy_process_group and the interpreter's exit was seen to abort ("terminate called
    # without an active exception"), after the barrier too, failing the whole comparison
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def torchrun_ddp(steps: int) -> dict:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        submitted = time.time()
        subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__,
                        "--worker", out, str(steps), repr(submitted)],
                       check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        with open(out) as fh:
            return json.load(fh)


def ddp_compare(reps: int, steps: int) -> dict:
    runs = {"hetflow": [], "torchrun": []}
    with hetflow.runtime("mpirun", max_ranks=2):
        for rep in range(reps):
            for name in (("hetflow", "torchrun") if rep % 2 == 0 else ("torchrun", "hetflow")):
                if name == "hetflow":
                    runs[name].append(hetflow_ddp(steps, time.time()).result())
                else:
                    runs[name].append(torchrun_ddp(steps))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    return {"reps": reps, "steps": steps, "median": med,
            "step_ratio": med["hetflow"]["step_s"] / med["torchrun"]["step_s"],
            "first_step_ratio": med["hetflow"]["to_first_step_s"] / med["torchrun"]["to_first_step_s"]}


# ----------------------------------------------------------------------------- hand-off
def deep_rc_path(table, columns, label):
    """Deep RC's copies: Arrow → pandas → NumPy → float32 → torch. Returns the tensors and
    the bytes of every intermediate that is a fresh buffer."""
    import numpy as np
    import torch

    copied = 0
    frame = table.select([*columns, label]).to_pandas()
    copied += sum(frame[c].to_numpy().nbytes for c in frame.columns
                  if not _same_memory(frame[c].to_numpy(), table.column(c)))
    values = frame[columns].to_numpy()
    copied += values.nbytes if not any(np.shares_memory(values, frame[c].to_numpy())
                                       for c in columns) else 0
    as32 = values.astype(np.float32)
    copied += as32.nbytes
    labels = frame[label].to_numpy().astype(np.float32)
    copied += labels.nbytes
    return torch.from_numpy(as32), torch.from_numpy(labels), copied


def _same_memory(values, column) -> bool:
    chunk = column.chunk(0)
    return values.__array_interface__["data"][0] == chunk.buffers()[1].address


def handoff_compare(reps: int, rows: int) -> dict:
    import numpy as np
    import pyarrow as pa
    from mpi4py import MPI

    import hetflow.torch as ht
    from hetflow.frame import DistributedTable

    import torch

    torch.set_num_threads(1)      # as a hetflow rank with cores_per_rank=1; pandas uses one
    rng = np.random.default_rng(0)
    names = ["a", "b", "c", "d"]
    table = pa.table({**{n: rng.standard_normal(rows).astype(np.float32) for n in names},
                      "y": rng.standard_normal(rows).astype(np.float32)})
    dt = DistributedTable(MPI.COMM_SELF, table)
    cases = {"one column": ["a"], "four columns": names}
    out = {}
    for case, columns in cases.items():
        times = {"hetflow": [], "pandas": []}
        copies = {}
        for rep in range(reps):
            for name in (("hetflow", "pandas") if rep % 2 == 0 else ("pandas", "hetflow")):
                start = time.perf_counter()
                if name == "hetflow":
                    data = ht.batches(dt, columns[0] if len(columns) == 1 else columns, "y",
                                      shuffle=False)
                    copies[name] = data.copied_bytes
                else:
                    _, _, copies[name] = deep_rc_path(table, columns, "y")
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[case] = {"rows": rows, "seconds": med, "bytes_copied": copies,
                     "speedup": med["pandas"] / med["hetflow"]}
    return out


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _torchrun_worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m hetflow.experiments.torch_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = {"handoff": handoff_compare(args.reps, args.rows)}
    for case, r in result["handoff"].items():
        print(f"hand-off, {case}, {r['rows']:,} rows: hetflow {r['seconds']['hetflow'] * 1e3:.2f} ms, "
              f"{r['bytes_copied']['hetflow']:,} B copied; pandas path "
              f"{r['seconds']['pandas'] * 1e3:.2f} ms, {r['bytes_copied']['pandas']:,} B; "
              f"{r['speedup']:.1f}x faster")
    result["ddp"] = ddp_compare(args.reps, args.steps)
    d = result["ddp"]
    print(f"DDP step (2 ranks, Gloo): hetflow {d['median']['hetflow']['step_s'] * 1e3:.3f} ms, "
          f"torchrun {d['median']['torchrun']['step_s'] * 1e3:.3f} ms: {d['step_ratio']:.3f}x")
    print(f"submit to first step: hetflow {d['median']['hetflow']['to_first_step_s']:.2f} s, "
          f"torchrun {d['median']['torchrun']['to_first_step_s']:.2f} s: {d['first_step_ratio']:.2f}x")
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
