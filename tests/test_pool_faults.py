"""The pool's fault decision (``pool.faults.settle_lost``) on plain data: no MPI, no processes.

Slots are numbers; ``busy`` says which task each live slot runs; ``evidence`` is
how a rank ended where something recorded it.
"""
from hetflow.executors.pool.faults import MAX_REQUEUES, RunningTask, rank_death, settle_lost


def test_a_rank_that_died_fails_its_task_and_its_peers_are_stopped():
    busy = {10: 1, 11: 1, 12: 1, 20: 2}
    tasks = {1: RunningTask((10, 11, 12)), 2: RunningTask((20,))}
    plan = settle_lost([11], busy, tasks, {11: ("called os._exit(3)", "")})
    assert plan.fail == {1: {1: ("called os._exit(3)", "")}}
    assert plan.dead == {1: [11]}
    assert plan.stop == [10, 12]                    # they may wait in a collective forever
    assert plan.lost == [11, 10, 12]                # one replacement world of 3 ranks
    assert plan.requeue == [] and plan.forget == []  # task 2 elsewhere is untouched


def test_a_death_nobody_recorded_is_still_a_death_when_not_collateral():
    plan = settle_lost([5], {5: 7, 6: 7}, {7: RunningTask((6, 5))}, {})
    assert plan.fail == {7: {1: ("died", "")}}
    assert plan.stop == [6]


def test_collateral_loss_requeues_and_stops_the_survivors():
    busy = {0: 1, 1: 1, 2: 2}
    tasks = {1: RunningTask((0, 1)), 2: RunningTask((2,))}
    plan = settle_lost([0, 2], busy, tasks, {}, collateral=True)
    assert sorted(plan.requeue) == [1, 2] and plan.fail == {}
    assert plan.stop == [1]                          # task 1's rank that is still alive
    assert sorted(plan.lost) == [0, 1, 2]


def test_collateral_loss_requeues_up_to_max_requeues_then_fails():
    busy = {0: 1}
    for requeues in range(MAX_REQUEUES):
        plan = settle_lost([0], busy, {1: RunningTask((0,), requeues=requeues)}, {},
                           collateral=True)
        assert plan.requeue == [1] and plan.fail == {}
    plan = settle_lost([0], busy, {1: RunningTask((0,), requeues=MAX_REQUEUES)}, {},
                       collateral=True)
    assert plan.requeue == [] and plan.fail == {1: {}}   # no evidence: "died without reporting"


def test_collateral_loss_with_death_evidence_fails_the_task_that_caused_it():
    busy = {0: 1, 1: 1}
    plan = settle_lost([0, 1], busy, {1: RunningTask((0, 1))},
                       {1: ("was killed by signal 11", "")}, collateral=True)
    assert plan.requeue == [] and plan.fail == {1: {1: ("was killed by signal 11", "")}}


def test_a_peer_s_own_evidence_counts_even_when_it_is_not_yet_seen_dead():
    busy = {0: 1, 1: 1}
    plan = settle_lost([0], busy, {1: RunningTask((0, 1))}, {1: ("died (Fatal error)", "t")},
                       collateral=True)
    assert plan.fail == {1: {1: ("died (Fatal error)", "t")}} and plan.stop == [1]


def test_the_blamed_task_is_not_failed_again_only_forgotten():
    busy = {3: 9, 4: 9}
    plan = settle_lost([3, 4], busy, {9: RunningTask((3, 4))}, {}, blame=9)
    assert plan.forget == [9]
    assert plan.fail == {} and plan.requeue == [] and plan.stop == []
    assert plan.lost == [3, 4]


def test_a_delivered_task_is_only_forgotten():
    busy = {0: 4, 1: 4}
    plan = settle_lost([0], busy, {4: RunningTask((0, 1), done=True)}, {0: ("died", "")})
    assert plan.forget == [4]
    assert plan.fail == {} and plan.requeue == [] and plan.stop == []   # its stuck peer waits
    assert plan.lost == [0]                                              # for the peer grace


def test_idle_ranks_are_only_replaced():
    plan = settle_lost([7, 8, 7], {}, {}, {})
    assert plan.lost == [7, 8]
    assert plan.dead == {} and plan.fail == {} and plan.requeue == [] and plan.stop == []


def test_two_tasks_hit_at_once_are_settled_each_on_its_own():
    busy = {0: 1, 1: 1, 2: 2, 3: 2}
    tasks = {1: RunningTask((0, 1)), 2: RunningTask((2, 3))}
    plan = settle_lost([1, 2], busy, tasks, {1: ("called os._exit(1)", "")})
    assert plan.fail == {1: {1: ("called os._exit(1)", "")}, 2: {0: ("died", "")}}
    assert plan.stop == [0, 3]
    assert sorted(plan.lost) == [0, 1, 2, 3]


def test_rank_death_combines_own_evidence_with_the_supervisor_s_record():
    assert rank_death(None, None) is None
    assert rank_death(None, {"signal": 15}) == ("was killed by signal 15", "")
    assert rank_death(None, {"exitcode": 3}) == ("exited with code 3", "")
    assert rank_death(("called os._exit(3)", ""), {"exitcode": 3}) == ("called os._exit(3)", "")
    assert rank_death(("died (Fatal Python error: Segmentation fault)", "stack"),
                      {"signal": 11}) == (
        "died (Fatal Python error: Segmentation fault), was killed by signal 11", "stack")


def test_the_rank_that_left_evidence_is_named_before_a_peer_that_left_none():
    # Rank 1 was killed from outside (its supervisor recorded signal 9); rank 0 died of
    # its loss before its own supervisor had written anything: rank 1 is the cause.
    busy = {0: 5, 2: 5}
    plan = settle_lost([0, 2], busy, {5: RunningTask((0, 2))},
                       {2: ("was killed by signal 9", "")})
    assert list(plan.fail[5].items()) == [(1, ("was killed by signal 9", "")), (0, ("died", ""))]


def test_evidence_order_is_kept_cause_first():
    busy = {0: 5, 1: 5, 2: 5}
    evidence = {2: ("was killed by signal 9", ""), 0: ("exited with code 1", "")}
    plan = settle_lost([0, 1, 2], busy, {5: RunningTask((0, 1, 2))}, evidence)
    assert list(plan.fail[5]) == [2, 0, 1]


def test_a_task_whose_ranks_ended_through_no_fault_of_its_own_is_requeued_despite_evidence():
    # Its rank exited with KILLED_EXIT (its world's ranks took the client for gone), or was
    # killed before the task was sent to it: Worlds.not_its_doing says so; evidence exists.
    busy = {0: 1, 1: 1}
    evidence = {0: ("exited with code 86", "")}
    plan = settle_lost([0], busy, {1: RunningTask((0, 1))}, evidence, innocent={1})
    assert plan.requeue == [1] and plan.fail == {} and plan.stop == [1]
    plan = settle_lost([0], busy, {1: RunningTask((0, 1), requeues=MAX_REQUEUES)}, evidence,
                       innocent={1})
    assert plan.requeue == [] and plan.fail == {1: {0: ("exited with code 86", "")}}
    plan = settle_lost([0], busy, {1: RunningTask((0, 1))}, evidence)   # not innocent: fails
    assert plan.requeue == [] and plan.fail == {1: {0: ("exited with code 86", "")}}


def test_not_its_doing_reads_the_supervisors_records(tmp_path):
    import time

    from hetflow.executors._supervise import KILLED_EXIT
    from hetflow.executors.pool.worlds import World, Worlds
    from hetflow.executors.taskdir import TaskDir

    worlds = Worlds(str(tmp_path), "tcp://127.0.0.1:1", command=lambda n: [], python="python",
                    env={}, pin=False, mpiexec=None, send=lambda *a, **k: True,
                    lost_after_s=10.0)
    taskdir = TaskDir(str(tmp_path))
    worlds.worlds[0] = World(0, 4, None, taskdir, [])
    slots = [worlds.register(b"r%d" % r, {"world": 0, "rank": r, "pid": 100 + r, "host": "h"})
             for r in range(4)]
    sent = time.time()
    taskdir.write_status(100, {"exitcode": KILLED_EXIT, "at": sent + 5})   # told to exit
    taskdir.write_status(101, {"signal": 9, "at": sent - 1})               # before it was sent
    taskdir.write_status(102, {"signal": 9, "at": sent + 1})               # while it ran
    assert worlds.not_its_doing([slots[0].id], sent)
    assert worlds.not_its_doing([slots[0].id, slots[1].id], sent)
    assert not worlds.not_its_doing([slots[2].id], sent)
    assert not worlds.not_its_doing([slots[0].id, slots[2].id], sent)
    assert not worlds.not_its_doing([slots[3].id], sent)                   # no record at all
    with open(taskdir.file("exit-0.json"), "w") as fh:                     # the task's os._exit
        fh.write('{"exitcode": %d}' % KILLED_EXIT)
    assert not worlds.not_its_doing([slots[0].id], sent)
