"""The Deep RC–shaped pipeline: data engineering → DDP training → evaluation, chained by futures.

Three ``mpi_app`` tasks (Deep RC, arXiv 2502.20724, runs the same shape on RADICAL-Pilot):

1. ``features`` (N ranks, CPU): synthetic events (``rows`` per rank: a user id and two
   measures) joined with a users table (a weight per user), then grouped by user into
   features, and a label computed from them: a distributed join and group-by with
   ``hetflow.frame``. The data are the same for every run with the same seed and ranks.
2. ``train`` (M ranks): ``hetflow.torch.process_group`` + ``hetflow.torch.batches``, a small
   MLP regression trained by DDP from the features table; beside it, on the same partition,
   Deep RC's copy path (``to_pandas`` → ``to_numpy`` → ``astype`` → ``torch.from_numpy``),
   timed in alternation with hetflow's ``batches`` so both see the same machine.
3. ``evaluate`` (N ranks): the trained weights on the features table, mean squared error
   against the label's variance.

The features table reaches the later tasks as (a) ``table``: the task returns the
``DistributedTable`` and its future, a ``hetflow.TableHandle``, is passed on (Parquet files
in the run's directory on most runtimes, the ranks' memory on the pool), or (b) ``keep``:
``hetflow.keep(table)`` on the pool's ranks, no disk (M must equal N).
"""
from __future__ import annotations

import time
from typing import Dict, List

FEATURES = ["x1_mean", "x2_mean", "xw_mean", "events"]
LABEL = "y"


def _users(seed: int, users: int):
    """Every user's weight, the same on every rank (drawn from ``seed`` alone)."""
    import numpy as np

    return np.random.default_rng([seed, 1_000_003]).uniform(0.5, 1.5, users)


def features_task(comm, rows_per_rank: int, seed: int, mode: str):
    """Join events with users, group by user into features and a label (N ranks)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from hetflow import frame

    rank, size = comm.Get_rank(), comm.Get_size()
    users = max(1, rows_per_rank * size // 4)
    rng = np.random.default_rng([seed, rank])
    events = frame.DistributedTable(comm, pa.table({
        "user": rng.integers(0, users, rows_per_rank, dtype=np.int64),
        "x1": rng.standard_normal(rows_per_rank),
        "x2": rng.uniform(0.0, 1.0, rows_per_rank)}))
    lo, hi = rank * users // size, (rank + 1) * users // size
    profile = frame.DistributedTable(comm, pa.table({
        "user": np.arange(lo, hi, dtype=np.int64), "w": _users(seed, users)[lo:hi]}))
    joined = frame.join(events, profile, on="user")
    joined = frame.with_columns(joined, xw=pc.field("x1") * pc.field("w"))
    grouped = frame.groupby(joined, "user").agg(
        {"x1": ["mean", "count"], "x2": "mean", "xw": "mean"})

    def columns(local: pa.Table) -> pa.Table:
        x1 = local.column("x1_mean").to_numpy()
        x2 = local.column("x2_mean").to_numpy()
        xw = local.column("xw_mean").to_numpy()
        n = local.column("x1_count").to_numpy().astype(np.float64)
        y = 2.0 * x1 - 3.0 * x2 + 1.5 * xw + np.tanh(x1 * xw) + 0.1 * np.log1p(n)
        out = {c: local.column(c) for c in ("user", "x1_mean", "x2_mean", "xw_mean")}
        out["events"] = pa.array(np.log1p(n))
        out[LABEL] = pa.array(y)
        return pa.table({k: pc.cast(v, pa.float32()) if k != "user" else v
                         for k, v in out.items()})

    table = frame.DistributedTable(comm, columns(grouped.local))
    if mode == "keep":
        import hetflow

        return {"table": hetflow.keep(table), "rows": comm.allreduce(table.local_rows)}
    return table


def _mlp(inputs: int, hidden: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def _deeprc_copy(local, features, label):
    """Deep RC's path from an Arrow partition to tensors; the bytes each step allocates."""
    import numpy as np
    import torch

    df = local.to_pandas()
    x = df[features].to_numpy()
    x = x.astype(np.float32)
    y = df[label].to_numpy().astype(np.float32)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    copied = int(df.memory_usage(index=False, deep=True).sum()) + 2 * x.nbytes + 2 * y.nbytes
    return tx, ty, copied


def train_task(comm, table, epochs: int, batch_size: int, hidden: int, lr: float, seed: int,
               handoff_repeats: int = 3):
    """DDP training of the MLP on the features table (M ranks); losses, timings, weights."""
    import numpy as np
    import torch

    import hetflow.torch as ht

    t_start = time.perf_counter()
    torch.set_num_threads(1)   # one core per rank: ranks share the node's cores
    received = comm.allreduce(table.local_rows)
    # The hand-off to tensors, side by side in alternation on this rank's partition: Deep RC's
    # four-step copy against hetflow's batches (one stacking copy of the feature columns).
    deeprc, ours, ours_copied, deeprc_copied = [], [], 0, 0
    for _ in range(handoff_repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        tx, ty, deeprc_copied = _deeprc_copy(table.local, FEATURES, LABEL)
        deeprc.append(time.perf_counter() - t0)
        del tx, ty
        comm.Barrier()
        t0 = time.perf_counter()
        data = ht.batches(table, FEATURES, LABEL, batch_size=batch_size, shuffle=False)
        for _batch in data:
            pass
        ours.append(time.perf_counter() - t0)
        ours_copied = data.copied_bytes
    t_train = time.perf_counter()
    with ht.process_group() as group:
        torch.manual_seed(seed)
        model = _mlp(len(FEATURES), hidden)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=lr)
        data = ht.batches(table, FEATURES, LABEL, batch_size=batch_size, seed=seed)
        losses: List[float] = []
        steps, step_s = 0, []
        for epoch in range(epochs):
            data.set_epoch(epoch)
            total = 0.0
            for features, label in data:
                t0 = time.perf_counter()
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp(features).squeeze(1), label)
                loss.backward()
                opt.step()
                step_s.append(time.perf_counter() - t0)
                total += float(loss.detach())
                steps += 1
            # The epoch's mean loss over every rank's batches (each rank has as many).
            losses.append(comm.allreduce(total) / max(1, comm.Get_size() * len(data)))
        backend = group.backend
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    t_end = time.perf_counter()
    return {"rows_received": received, "losses": losses, "steps": steps,
            "batches_per_epoch": len(data), "backend": backend, "ranks": comm.Get_size(),
            "step_s": float(np.median(step_s)) if step_s else None,
            "train_s": t_end - t_train, "to_tensors_s": t_train - t_start,
            "deeprc_s": float(np.median(deeprc)), "hetflow_s": float(np.median(ours)),
            "deeprc_copied_bytes": comm.allreduce(deeprc_copied),
            "hetflow_copied_bytes": comm.allreduce(ours_copied),
            "partition_bytes": comm.allreduce(table.local.nbytes), "state": state}


def evaluate_task(comm, table, trained: Dict):
    """Mean squared error of the trained weights on the table, and the label's variance."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    model = _mlp(len(FEATURES), trained["state"]["0.weight"].shape[0])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in trained["state"].items()})
    local = table.local
    x = torch.from_numpy(np.stack([local.column(c).to_numpy() for c in FEATURES], axis=1))
    y = local.column(LABEL).to_numpy().astype(np.float64)
    with torch.no_grad():
        pred = model(x).squeeze(1).double().numpy() if len(y) else np.zeros(0)
    n = comm.allreduce(len(y))
    sse = comm.allreduce(float(((pred - y) ** 2).sum()))
    total, total_sq = comm.allreduce(float(y.sum())), comm.allreduce(float((y ** 2).sum()))
    mean = total / max(1, n)
    variance = total_sq / max(1, n) - mean ** 2
    mse = sse / max(1, n)
    return {"rows": n, "mse": mse, "label_variance": variance,
            "r2": 1.0 - mse / variance if variance > 0 else None}


def run_chain(*, feature_ranks: int, train_ranks: int, rows_per_rank: int, mode: str,
              epochs: int, batch_size: int = 64, hidden: int = 16, lr: float = 0.01,
              seed: int = 0, timeout: float = 900.0) -> Dict:
    """Submit the three tasks on the current runtime, chained by futures; their figures."""
    import hetflow
    from hetflow.errors import ConfigError

    if mode not in ("table", "keep"):
        raise ConfigError(f"pipeline: mode must be 'table' or 'keep', got {mode!r}")
    if mode == "keep" and train_ranks != feature_ranks:
        raise ConfigError(f"pipeline: 'keep' hands the table over on the same ranks: "
                          f"train_ranks ({train_ranks}) must equal feature ranks ({feature_ranks})")
    features = hetflow.mpi_app(features_task, ranks=feature_ranks)
    train = hetflow.mpi_app(train_task, ranks=train_ranks)
    evaluate = hetflow.mpi_app(evaluate_task, ranks=feature_ranks)
    t0 = time.perf_counter()
    f_features = features(rows_per_rank, seed, mode)
    if mode == "keep":   # the Resident comes back inside a dict: resolve it to pass it on
        produced = f_features.result(timeout=timeout)
        table, rows_produced = produced["table"], produced["rows"]
    else:
        table = f_features
    f_train = train(table, epochs, batch_size, hidden, lr, seed)
    f_eval = evaluate(table, f_train)
    evaluation = f_eval.result(timeout=timeout)
    makespan = time.perf_counter() - t0
    trained = f_train.result(timeout=0)
    if mode == "table":
        handle = f_features.result(timeout=0)
        rows_produced = handle.num_rows
    stages = {}
    for name, future in (("features", f_features), ("train", f_train), ("evaluate", f_eval)):
        times = hetflow.task_times(future)
        stages[name] = None if times is None else {
            "total_s": times.delivered - times.submitted, "function_s": times.function_s,
            "overhead_s": times.overhead_s, "started": times.started, "finished": times.finished}
    handoff_s = None
    if stages["features"] and stages["train"]:
        # From the features' function returning to the training function starting: the
        # table's way out of one task and into the next (return, launch, read).
        handoff_s = stages["train"]["started"] - stages["features"]["finished"]
    trained.pop("state")
    if mode == "table":
        hetflow.resident.release(handle)
    else:
        hetflow.resident.release(table)
    return {"mode": mode, "makespan_s": makespan, "rows_produced": rows_produced,
            "stages": stages, "handoff_s": handoff_s, "train": trained, "evaluation": evaluation}
