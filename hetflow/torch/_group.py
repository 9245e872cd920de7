"""``process_group``: torch.distributed on exactly the ranks of a hetflow task."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import secrets

import torch
import torch.distributed as dist

from hetflow.errors import ConfigError, HetflowError

#: How long torch waits in a collective or in the rendezvous before it raises. A task's
#: walltime, when it has one, ends it sooner.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class IntruderError(HetflowError):
    """A process group's first collective did not carry the secret its ranks shared over
    MPI: some connection of the group is not one of the task's own ranks."""


@dataclasses.dataclass(frozen=True)
class Group:
    """What :func:`process_group` built, as seen from this rank."""

    rank: int            #: this rank in the group (the task communicator's rank)
    size: int            #: ranks in the group
    local_rank: int      #: this rank's index among the group's ranks on its host
    local_size: int      #: the group's ranks on this rank's host
    hosts: tuple         #: every rank's host name, by rank
    backend: str         #: "gloo" or "nccl"
    device: torch.device  #: where this rank's tensors go (``cuda:i`` with NCCL, else ``cpu``)


_active: list = []


def active_group() -> Group | None:
    """The :class:`Group` of the enclosing :func:`process_group` on this rank, if any."""
    return _active[-1] if _active else None


def _task_comm(comm):
    if comm is not None:
        return comm
    from hetflow._task import current_comm

    comm = current_comm()
    if comm is None:
        raise HetflowError("hetflow.torch.process_group() ran outside a hetflow task: pass "
                           "comm= or call it inside an @hetflow.mpi_app")
    return comm


@contextlib.contextmanager
def _loopback_gloo(on_one_host: bool):
    """Gloo binds its listening sockets to the address ``GLOO_SOCKET_IFNAME`` names, else to
    the host name's: a group on one host binds loopback only, out of other hosts' reach.
    Set for the group's construction only, the process's own value given back after."""
    if not on_one_host or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def _verify_members(comm, group: Group) -> None:
    """Rank 0 sends a fresh secret over MPI (which only the task's ranks share); a Gloo/NCCL
    all-gather of it must come back whole from every rank, before any data moves."""
    secret = comm.bcast(secrets.randbits(62) if comm.Get_rank() == 0 else None, root=0)
    mine = torch.tensor([secret, group.rank], dtype=torch.int64, device=group.device)
    every = [torch.zeros_like(mine) for _ in range(group.size)]
    dist.all_gather(every, mine)
    seen = [tuple(int(v) for v in t.tolist()) for t in every]
    good = comm.allreduce(int(seen == [(secret, r) for r in range(group.size)]), op=_min())
    if not good:
        raise IntruderError("the process group's first collective came back without the "
                            "secret its ranks shared over MPI: a connection of the group is "
                            "not one of the task's ranks")


#: What Gloo says when a peer's connection ends under a collective.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: How long a rank whose peer vanished waits to be ended by its runtime (see
#: :func:`_wait_to_be_ended`) before it reports the collective's error itself.
PEER_LOST_WAIT_S = 60.0


def _peer_lost(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOST)


def _wait_to_be_ended() -> None:
    """A collective failed because a peer's connection closed: that peer died (or left
    raising an error of its own, which it reports). Every runtime ends a task's other ranks
    when one dies, and reports the dead rank (TaskLost) or the peer's own error; this rank,
    had it reported "connection closed" first, would hide that cause behind a side effect
    (an MPI rank in the same place waits in its collective until ended). So it waits,
    asleep, as an MPI rank would; if nothing ends it, its own error is reported after all."""
    import time

    deadline = time.monotonic() + PEER_LOST_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)


def _min():
    from mpi4py import MPI

    return MPI.MIN


@contextlib.contextmanager
def process_group(comm=None, backend: str | None = None, *,
                  timeout: datetime.timedelta = DEFAULT_TIMEOUT):
    """Within: ``torch.distributed``'s default group on exactly the ranks of ``comm`` (the
    running task's communicator when None). Collective: every rank of ``comm`` enters it.

    ``backend``: ``"nccl"`` when every rank sees a CUDA device, else ``"gloo"``. The
    rendezvous runs over ``comm`` (no port of its own, no file, no environment variable to
    set); local ranks come from an all-gather of host names. Yields a :class:`Group`.
    The group is destroyed on leaving, also when the body raised.
    """
    comm = _task_comm(comm)
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised on this rank: "
                          "hetflow.torch.process_group() does not nest")
    if backend not in (None, "gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    own = comm.Dup()         # the store's and the checks' traffic never meets the user's
    try:
        rank, size = own.Get_rank(), own.Get_size()
        host = os.uname().nodename
        cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        facts = own.allgather((host, cuda, backend))
        hosts = tuple(h for h, _, _ in facts)
        asked = {b for _, _, b in facts}
        if len(asked) != 1:
            raise ConfigError(f"the ranks asked for different backends: {sorted(map(str, asked))}")
        every_cuda = all(c for _, c, _ in facts)
        chosen = backend or ("nccl" if every_cuda else "gloo")
        if chosen == "nccl" and not every_cuda:
            raise ConfigError("backend='nccl' needs a CUDA device on every rank; ranks "
                              f"without one: {[r for r, f in enumerate(facts) if not f[1]]}")
        local_rank = hosts[:rank].count(host)
        local_size = hosts.count(host)
        if chosen == "nccl":
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        group = Group(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                      hosts=hosts, backend=chosen, device=device)
    except BaseException:
        own.Free()
        raise
    from hetflow.torch._store import MPIStore

    store = MPIStore(own, timeout)
    completed = False
    try:
        with _loopback_gloo(len(set(hosts)) == 1):
            dist.init_process_group(chosen, store=store, rank=rank, world_size=size,
                                    timeout=timeout, device_id=device if chosen == "nccl" else None)
        try:
            _verify_members(own, group)
            _active.append(group)
            try:
                yield group
            except BaseException as exc:
                if _peer_lost(exc):
                    _wait_to_be_ended()
                raise
            finally:
                _active.pop()
            completed = True
        finally:
            dist.destroy_process_group()
    finally:
        store.close(synchronise=completed)
