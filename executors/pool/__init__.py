"""hetflow's own pilot: a persistent MPI pool with a fresh communicator per task.

- :mod:`.executor` — :class:`PoolExecutor`: the kernel's hooks and the pool's options.
- :mod:`.wire` — the messages between the pool and its ranks, and their signatures.
- :mod:`.worlds` — the MPI worlds and their ranks (slots): launching, registering, liveness.
- :mod:`.broker` — the broker thread: the message loop, the only owner of worlds and socket.
- :mod:`.faults` — who fails, who re-runs and what is replaced when ranks are lost.
- :mod:`.reshape` — the drain and restart as one world when a task fits in no world.
- :mod:`.scheduler` — placement over slots grouped by MPI world.
- :mod:`.worker` — one rank of a world (``python -m hetflow.executors.pool.worker``).

The client's names load on first use: a rank importing :mod:`.worker` does not pull in
the executor kernel (and Parsl behind it).
"""

__all__ = ["PoolExecutor"]


def __getattr__(name):
    if name == "PoolExecutor":
        from hetflow.executors.pool.executor import PoolExecutor
        return PoolExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
