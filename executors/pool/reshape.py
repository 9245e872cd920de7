"""The pool's reshaping: a queue head no world can hold makes the pool drain and restart
as one world of every slot (consolidation), on the broker thread (``broker``: its
:class:`~.broker.Broker`)."""
from __future__ import annotations

from hetflow import errors


def unblock(broker) -> None:
    """The queue's head cannot run now: fail it if it never can; consolidate if needed."""
    with broker.pool.placement() as scheduler:
        head = scheduler.head()
        gpu = head is not None and bool(head[0].resources.gpus_per_rank)
        sizes = scheduler.world_sizes(gpu=gpu)
        pinned = scheduler.pinned_of(head[0]) if head is not None else None
    if head is None or broker.pool.stopping:
        return
    task, need = head[0], head[1]
    if pinned is not None:
        lost = [s for s in pinned if s not in broker.mpi.slots or not broker.mpi.slots[s].alive]
        if lost:
            if broker.pool.dequeue(task):
                broker.pool.finish(task, error=errors.resident_lost(
                    task.id, broker.pool.label, pinned, lost))
        return
    if max(sizes.values(), default=0) >= need or broker.mpi.starting():
        return
    if not broker.consolidating:
        broker.consolidating = True
        broker.event(
            f"task {task.id} needs {need} {'GPU ' if gpu else ''}ranks but the largest "
            f"world has {max(sizes.values(), default=0)} (worlds: {sizes}): draining and "
            f"restarting the pool as one world of {broker.pool.max_ranks} ranks "
            "(resident data on the old ranks is lost)")
        with broker.pool.placement() as scheduler:
            scheduler.hold(broker.mpi.retire_all())
    finish_consolidation(broker)


def finish_consolidation(broker) -> None:
    """The worlds being drained are idle: end them and start the one world of every slot."""
    if not broker.consolidating or broker.pool.stopping:
        return
    if broker.mpi.any_busy():
        return
    for world in list(broker.mpi.worlds.values()):
        broker.remove_slots(broker.mpi.retire(world))
    broker.consolidating = False
    launch_full(broker)


def launch_full(broker) -> None:
    """Start a world of every slot the pool has (at its start, after a consolidation)."""
    pool = broker.pool
    broker.mpi.launch(pool.max_ranks, cores=list(range(pool.max_ranks)),
                      devices=list(pool.gpu_ids) if pool.gpus else None)
