"""The pool's node-aware placement on plain data (no MPI): a task that fits on one node
runs on one node, a bigger one packs the nodes in order, task rank 0 is the lowest
world rank."""
from hetflow.executors.pool.scheduler import PoolScheduler


def _pool(layout):
    """A scheduler over one world whose world ranks run on ``layout`` (node per rank);
    slot ids are given in a shuffled registration order, as ranks register."""
    sched = PoolScheduler()
    order = sorted(range(len(layout)), key=lambda r: (r * 7) % len(layout))
    for slot, wrank in enumerate(order):
        sched.add_slot(slot, 0, layout[wrank], wrank)
    sched.release(range(len(layout)))
    return sched


def _placed(sched, slots):
    return [sched.where[s] for s in slots]


def test_a_task_that_fits_on_one_node_runs_on_one_node():
    sched = _pool(["n1", "n2", "n1", "n2"])            # srun's cyclic layout
    got = _placed(sched, sched.take("a", 2))
    assert got == [("n1", 0), ("n1", 2)]
    got = _placed(sched, sched.take("b", 2))
    assert got == [("n2", 1), ("n2", 3)]


def test_a_multi_node_task_packs_nodes_in_order():
    sched = _pool(["n1", "n1", "n2", "n2", "n3", "n3"])
    assert _placed(sched, sched.take("a", 1)) == [("n1", 0)]    # best fit: fills n1's hole later
    got = _placed(sched, sched.take("b", 4))
    assert [node for node, _ in got] == ["n1", "n2", "n2", "n3"]
    assert [wrank for _, wrank in got] == sorted(wrank for _, wrank in got)


def test_best_fit_node_keeps_a_whole_node_free():
    sched = _pool(["n1", "n1", "n2", "n2"])
    sched.take("a", 1)                                           # n1 has one free left
    assert _placed(sched, sched.take("b", 1)) == [("n1", 1)]     # not n2
    assert [n for n, _ in _placed(sched, sched.take("c", 2))] == ["n2", "n2"]
