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
#: How long a Gloo group's construction (its store included) and its membership check wait
#: for a peer (``timeout`` when shorter; ``timeout`` applies after; Gloo waits five times
#: this for a peer's first connection). The ranks meet over MPI just before each step, so a
#: real peer answers within milliseconds; a stranger who took a peer's connection while the
#: group was built may stay silent, and nothing else ends that.
BUILD_TIMEOUT = datetime.timedelta(seconds=30)


class IntruderError(HetflowError):
    """A process group's first collective did not return the tokens its ranks shared over
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
    """Every rank draws a token and shares it over MPI (which only the task's ranks reach);
    a Gloo/NCCL all-gather of the tokens must return exactly those, before any data moves.
    A stranger holding a peer's connection can echo what a rank sent it, never another
    rank's token. Raises :class:`IntruderError` on every rank when any rank's check fails."""
    token = secrets.randbits(63)
    tokens = comm.allgather(token)
    mine = torch.tensor([token], dtype=torch.int64, device=group.device)
    every = [torch.zeros_like(mine) for _ in range(group.size)]
    cause = None
    try:
        dist.all_gather(every, mine)
        good = [int(t.item()) for t in every] == tokens
    except RuntimeError as exc:       # a silent stranger: Gloo's timeout; a dropped peer
        good, cause = False, exc
    if not good:
        # Frees this rank's sockets: a peer whose real connection this rank never took
        # (a stranger's came first) fails now instead of at its timeout.
        dist.destroy_process_group()
    bad = [r for r, ok in enumerate(comm.allgather(good)) if not ok]
    if bad:
        raise IntruderError(f"the process group's first collective did not return the tokens "
                            f"its ranks shared over MPI on rank(s) {bad}: a connection of the "
                            "group is not one of the task's ranks") from cause


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


@contextlib.contextmanager
def process_group(comm=None, backend: str | None = None, *,
                  timeout: datetime.timedelta = DEFAULT_TIMEOUT):
    """Within: ``torch.distributed``'s default group on exactly the ranks of ``comm`` (the
    running task's communicator when None). Collective: every rank of ``comm`` enters it.

    ``backend``: ``"nccl"`` when every rank sees a CUDA device, else ``"gloo"``. The
    rendezvous runs over ``comm`` (no port of its own, no file, no environment variable to
    set); local ranks come from an all-gather of host names. Yields a :class:`Group`,
    once its first collective has shown that every connection is one of the task's ranks
    (else :class:`IntruderError` on every rank). ``timeout``: how long a collective waits
    for a peer (Gloo's construction and that check: :data:`BUILD_TIMEOUT` at most).
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

    building = min(timeout, BUILD_TIMEOUT) if chosen == "gloo" else timeout
    store = MPIStore(own, building)
    completed = False
    try:
        try:
            with _loopback_gloo(len(set(hosts)) == 1):
                dist.init_process_group(chosen, store=store, rank=rank, world_size=size,
                                        timeout=building,
                                        device_id=device if chosen == "nccl" else None)
            failed = None
        except RuntimeError as exc:
            failed = exc
        unbuilt = [r for r, ok in enumerate(own.allgather(failed is None)) if not ok]
        try:
            if unbuilt:
                raise HetflowError(f"the {chosen} process group could not be built on rank(s) "
                                   f"{unbuilt}") from failed
            _verify_members(own, group)
            if building != timeout:
                dist.distributed_c10d._set_pg_timeout(timeout)
                store.set_timeout(timeout)
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
            if dist.is_initialized():
                dist.destroy_process_group()
    finally:
        store.close(synchronise=completed)
