"""One rank of a pool world: ``python -m hetflow.executors.pool.worker ADDRESS WORLD STATEDIR``.

Started once per rank by ``mpiexec -n N`` (or srun); it connects to the pool's
ZeroMQ ROUTER, registers, then runs tasks until told to exit. Each task names the
world ranks it runs on; the rank builds (and caches) a communicator over exactly
those ranks with ``Create_group`` (collective over the group only, so disjoint
tasks never wait on each other) and runs the shared :func:`run_on_rank` on it.

A second thread answers heartbeats and obeys "kill" orders: a rank stuck in a
collective (walltime, cancel, a dead peer) cannot be interrupted inside MPI, so
the pool ends the process and replaces it. Blocking receives everywhere: an idle
rank uses no CPU; a rank waiting for its peers (to make a communicator, to start a
task) sleeps between polls (``_rank.wait``), where MPI's blocking calls busy-poll.

The process the launcher starts forks at once: the child is the MPI rank, the
parent only waits for it and writes how it ended (``status-<pid>.json`` in the
world's state directory). A rank killed by a signal (SIGKILL above all) leaves no
evidence of its own, and its real parent (hydra_pmi_proxy) reports nothing until
the whole world ends; the supervisor lets the pool name the signal at once.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from hetflow.executors.pool import wire
from hetflow.executors._supervise import KILLED_EXIT, supervise
from hetflow.executors.taskdir import TaskDir


def _local_rank() -> int:
    from hetflow.executors._rank import local_rank
    return local_rank()


def _bind(local_rank: int) -> None:
    """Pin to a core and bind GPUs before anything (CUDA, OpenMP) reads the environment.

    A rank keeps its devices for life (CUDA reads ``CUDA_VISIBLE_DEVICES`` once), so they
    are bound here, by the runtimes' one binding, from the ids this world was given; the
    pool then sends GPU tasks only to ranks holding devices (``pool.scheduler``).
    """
    from hetflow.executors._rank import bind_gpus

    devices = os.environ.get("HETFLOW_POOL_DEVICES")
    bind_gpus(None if devices is None else json.loads(devices), local_rank,
              int(os.environ.get("HETFLOW_POOL_GPUS_PER_RANK", "0") or 0))
    cores = os.environ.get("HETFLOW_POOL_CORES", "")
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            allowed = sorted(os.sched_getaffinity(0))
            wanted = [int(c) for c in cores.split(",") if c != ""]
            core = wanted[local_rank % len(wanted)] if wanted else None
            if core is not None and core in allowed:
                os.sched_setaffinity(0, {core})
        except (OSError, ValueError):
            pass  # pinning is an optimisation; never a reason not to start


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _control_loop(ctx, address: str, identity: bytes, signer, real_exit, heartbeat_s: float,
                  orphan_s: float, client_pid: int) -> None:
    """Heartbeats out, kill orders in; exit when the client is gone (no orphans).

    On the client's host its pid says whether it is gone; acknowledgements only where it
    runs elsewhere. A client alive but silent for ``orphan_s`` (its broker thread waiting for
    the kernel's lock behind 100,000 queued tasks) had both ranks of a world end themselves,
    and the pool failed the task one of them ran (the 100,000-task soak's one lost task)."""
    import zmq

    ctrl_id = wire.control_identity(identity)
    ctrl = ctx.socket(zmq.DEALER)
    ctrl.setsockopt(zmq.IDENTITY, ctrl_id)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.connect(address)
    beat = signer.sign(wire.TO_POOL, ctrl_id, [wire.HEARTBEAT])
    last_ack = time.monotonic()
    next_beat = 0.0
    while True:
        now = time.monotonic()
        if now >= next_beat:          # one heartbeat per interval, however fast acks come
            ctrl.send_multipart(beat)
            next_beat = now + heartbeat_s
        if ctrl.poll(max(1, int((next_beat - now) * 1000))):
            msg = signer.check(wire.TO_RANK, ctrl_id, ctrl.recv_multipart())
            if msg is None:
                continue              # not the pool's: ignore
            if msg[0] == wire.KILL:
                sys.stdout.flush()
                sys.stderr.flush()
                real_exit(KILLED_EXIT)
            last_ack = time.monotonic()
        if client_pid:
            if not _parent_alive(client_pid):
                real_exit(KILLED_EXIT)
        elif time.monotonic() - last_ack > orphan_s:
            real_exit(KILLED_EXIT)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    address, world_id, statedir = argv[0], int(argv[1]), TaskDir(argv[2])
    supervise(statedir)                    # from here on: the rank (the child)
    _bind(_local_rank())
    for entry in reversed(os.environ.get("HETFLOW_POOL_SYSPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)

    import zmq
    from mpi4py import MPI

    from hetflow import resident
    from hetflow.executors._mpishm import forget_mpi_shm_names
    from hetflow.executors._rank import (bind_threads, duplicate, group_comm, kept_comms,
                                         release_comm, run_on_rank)

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    meeting = duplicate(world)             # for group_comm's meetings alone (asleep: its wait)
    forget_mpi_shm_names(world, statedir)  # a world the pool kills leaves nothing in /dev/shm
    real_exit = os._exit                   # the worker's own exits are not deaths to record
    statedir.record_deaths(rank)           # evidence if a task kills this process
    resident._set_pool(os.environ.get("HETFLOW_POOL_UID", "pool"))

    signer = wire.Signer.from_env()
    ctx = zmq.Context()
    identity = wire.identity(world_id, rank)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    client_pid = int(os.environ.get("HETFLOW_POOL_CLIENT_PID", "0") or 0)
    if os.environ.get("HETFLOW_POOL_CLIENT_HOST") != socket.gethostname():
        client_pid = 0   # another node: rely on heartbeat acknowledgements instead
    stacks_root = os.environ.get("HETFLOW_POOL_STACKS")
    if client_pid and stacks_root:   # the client's node: one stack file for the rank's life
        from hetflow.executors import _rankio

        _rankio.keep_stacks(os.path.join(stacks_root, _rankio.process_stack_name(
            world_id, rank, os.getpid())))
    threading.Thread(target=_control_loop, name="pool-control", daemon=True,
                     args=(ctx, address, identity, signer, real_exit,
                           float(os.environ.get("HETFLOW_POOL_HEARTBEAT", "1.0")),
                           float(os.environ.get("HETFLOW_POOL_ORPHAN", "30")), client_pid)).start()
    sock.send_multipart(signer.sign(wire.TO_POOL, identity, wire.register_frames({
        "world": world_id, "rank": rank, "size": world.Get_size(), "pid": os.getpid(),
        "supervisor": os.getppid(), "host": socket.gethostname(),
        "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")})))

    # world ranks -> (generation, communicator, the user's duplicate of it); the client decides
    # what is cached. The user's is kept too: a rank that returned may hold a message its
    # failed peer sent on it, and freeing it let the next communicator reuse its context id
    # (Open MPI 4.1.4 crashed in the next COMM_SELF.Dup(), in mca_pml_ob1_add_comm).
    comms = {}
    stale = []   # cached communicators of a generation a failed task ended: kept, never freed
    while True:
        message = wire.recv_frames(sock)
        frames = signer.check(wire.TO_RANK, identity, [f.buffer for f in message])
        if frames is None:
            continue                        # not signed by the pool: never read
        kind = bytes(frames[0])
        if kind == wire.EXIT:
            break
        if kind == wire.DROP:               # drop a kept object (hetflow.resident.release)
            resident._drop(bytes(frames[1]).decode())
            continue
        if kind != wire.TASK:
            continue
        task_id, ranks, slots, cache, generation, cores_per_rank = \
            wire.read_task_header(bytes(frames[1]))
        cached = comms.get(ranks)
        if cached is not None and cached[0] != generation:
            stale.extend(c for c in comms.pop(ranks)[1:] if c not in (None, MPI.COMM_SELF))
            cached = None
        if cached is not None:
            _, comm, user = cached
        else:
            user = None
            if len(ranks) == 1:
                comm = MPI.COMM_SELF             # run_on_rank's duplicate of it is freed
            else:
                comm = group_comm(world, meeting, ranks)
                if cache:
                    user = duplicate(comm)
            if cache:
                comms[ranks] = (generation, comm, user)
        bind_threads(cores_per_rank)
        resident._enter_task(task_id, slots, slots[ranks.index(rank)], comm)
        try:
            outcome = run_on_rank(frames[2], comm, user_comm=user)
        finally:
            resident._leave_task()
        if not cache and comm is not MPI.COMM_SELF:
            release_comm(comm, failed=not outcome.ok)
        # (a cached one of a failed task stays where it is: the pool moves the ranks'
        # generation on, so it is never used again, nor freed; the pool replaces the world
        # before the communicators kept so run out: the count travels with each outcome)
        copy = len(outcome.value) < wire.ZERO_COPY_BYTES
        frames = wire.outcome_frames(task_id, outcome, len(stale) + kept_comms())
        wire.send(sock, signer.sign(wire.TO_POOL, identity, frames), copy=copy)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip MPI_Finalize: it may wait on peers that died; the launcher reaps us either way.
    real_exit(0)
    return 0


if __name__ == "__main__":
    # Run the importable module, not a second copy of it as __main__
    from hetflow.executors.pool import worker

    sys.exit(worker.main())
