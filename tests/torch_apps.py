"""Training apps the torch tests run on every runtime (imported by the ranks: torch is
imported inside the apps, so the test process itself never pays for it).

The model and data are deterministic: float64, a seeded linear model, rows drawn from one
seeded generator and dealt to the ranks. Tolerance of the parity check: :data:`PARITY_ATOL`.
"""
from __future__ import annotations

import os

import hetflow
from meet import meet

#: DDP's weights against one process trained on the same global batches (float64: the
#: gradient all-reduce sums in another order than the concatenated batch's mean).
PARITY_ATOL = 1e-12
FEATURES = ["x0", "x1", "x2"]


def dealt_table(comm, rows: int, empty_rank=None, seed: int = 7):
    """``rows`` rows of ``y = x @ w + noise``, dealt contiguously to the ranks but
    ``empty_rank`` (which gets none)."""
    import numpy as np
    import pyarrow as pa

    from hetflow import frame

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.standard_normal(rows)
    owners = [r for r in range(comm.Get_size()) if r != empty_rank]
    rank = comm.Get_rank()
    if rank in owners:
        i = owners.index(rank)
        lo, hi = rows * i // len(owners), rows * (i + 1) // len(owners)
    else:
        lo = hi = 0
    columns = {name: x[lo:hi, j] for j, name in enumerate(FEATURES)}
    columns["y"] = y[lo:hi]
    return frame.DistributedTable(comm, pa.table(columns))


def train(comm, rows=40, empty_rank=None, epochs=2, batch_size=8, mine=None, theirs=None,
          kill_rank=None, kill_step=None):
    """DDP over ``hetflow.torch.process_group``; then rank 0 trains one plain model on the
    global batches every rank fed (gathered over MPI) and compares. Returns
    ``{"diff", "moved", "steps", "rows", "met", "backend", "size", "hosts", "local"}``
    (rank 0's view; ``local``: every rank's (local rank, local size))."""
    import signal

    import torch
    import torch.distributed as dist

    import hetflow.torch as ht

    table = dealt_table(comm, rows, empty_rank)
    with ht.process_group() as group:
        met = meet(comm, mine, theirs, timeout=300.0) if mine else None
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).double()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = ht.batches(table, FEATURES, "y", batch_size=batch_size, seed=3)
        fed = []
        for epoch in range(epochs):
            data.set_epoch(epoch)
            for x, y in data:
                if comm.Get_rank() == kill_rank and len(fed) == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), y)
                loss.backward()
                opt.step()
                fed.append((x.clone(), y.clone()))
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        backend, size, hosts = group.backend, group.size, group.hosts
        local = (group.local_rank, group.local_size)
        assert dist.is_initialized()
    assert not dist.is_initialized()
    every = comm.gather(fed, root=0)
    local_rows = comm.gather(data.local_rows, root=0)
    locals_ = comm.gather(local, root=0)
    if comm.Get_rank() != 0:
        return None
    steps = len(fed)
    assert all(len(f) == steps for f in every), [len(f) for f in every]
    reference = torch.nn.Linear(3, 1).double()
    reference.load_state_dict(initial)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.cat([every[r][step][0] for r in range(len(every))])
        y = torch.cat([every[r][step][1] for r in range(len(every))])
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x).squeeze(1), y).backward()
        opt.step()
    diff = max(float((trained[k] - v).abs().max()) for k, v in reference.state_dict().items())
    moved = max(float((trained[k] - v).abs().max()) for k, v in initial.items())
    return {"diff": diff, "moved": moved, "steps": steps, "rows": local_rows, "met": met,
            "backend": backend, "size": size, "hosts": hosts, "local": locals_}


ddp_train = hetflow.mpi_app(ranks=2)(train)
