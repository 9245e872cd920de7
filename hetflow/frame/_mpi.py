"""MPI itself, as the engine uses it: the lazily imported ``MPI`` module, waits that sleep
instead of busy-polling, and the raw byte collectives the exchanges are built on."""
from __future__ import annotations

import ctypes
import time
from typing import Optional

import numpy as np

from hetflow.errors import NotSupported
from hetflow.frame._backend import libc_function
from hetflow.frame._phases import phase

_INT_MAX = 2**31 - 1


class _LazyMPI:
    """mpi4py's ``MPI`` module, imported at its first use. Importing ``mpi4py.MPI`` initialises
    MPI, and a process that only imports the engine must not: a client that defines its apps
    beside ``from hetflow import frame`` would become an MPI singleton, and every process it
    forks would leave MPICH's shared-memory segment in /dev/shm (or trip Open MPI's fork
    check). The ranks, which call the engine, initialise MPI as before."""

    def __getattr__(self, name):
        from mpi4py import MPI

        return getattr(MPI, name)


MPI = _LazyMPI()


def check_large_counts(counts: np.ndarray) -> None:
    if counts.max(initial=0) > _INT_MAX and MPI.Get_version() < (4, 0):
        raise NotSupported(f"a rank would exchange {int(counts.max())} bytes with one peer, "
                           "more than 2**31-1, and this MPI library predates MPI-4 large counts")



# Waiting for peers. MPICH's blocking calls busy-poll: on a node with more ranks (and other
# work) than cores, a rank that waits for a slower peer burns the CPU that peer needs, and its
# CPU seconds double the operation's real work. Every wait of the exchange therefore posts a
# non-blocking call and polls it with MPI_Testall: a few hundred polls at full speed (a peer
# that is already there costs nothing extra), then sleeps from 20 us doubling to 50 us between
# polls (a wake-up costs a few microseconds of CPU, under a tenth of a core at that rate).
# The cap is short because one wait spans several steps of MPICH's protocol (the peer's
# request, the copy, the acknowledgement), each seen only at a poll: with 0.25 ms a 2-rank sort
# of 100k rows per rank spent ~2 ms of its ~5 ms in waits, with 50 us ~0.6 ms of ~3.7 ms, and
# 3 ranks sharing 2 cores ran their 4M-row join no slower.
# Large messages between ranks of one node go by CMA (one kernel copy done by the receiver
# inside a single poll, MPICH's default here), never a copy stalled on the sender's progress.
_SPIN_POLLS = 200
_FIRST_SLEEP, _MAX_SLEEP = 20e-6, 50e-6


def wait_all(requests) -> None:
    """Complete MPI requests, sleeping between polls instead of busy-waiting (see above)."""
    requests = [r for r in requests if r is not None]
    if not requests:
        return
    test = MPI.Request.Testall
    with phase("exchange"):
        for _ in range(_SPIN_POLLS):
            if test(requests):
                return
        delay = _FIRST_SLEEP
        slack = _set_timer_slack(_SLACK_NS)
        try:
            while not test(requests):
                time.sleep(delay)
                delay = min(delay * 2, _MAX_SLEEP)
        finally:
            if slack is not None:
                _set_timer_slack(slack)


# Linux lets a sleep overrun by the thread's timer slack (50 us by default) so that timers can
# be batched: a 20 us sleep took ~80 us here, and an operation waits several times. While it
# polls, a waiting rank asks for 1 us of slack (a 20 us sleep then takes ~30 us) and restores
# its own setting after.
_SLACK_NS = 1000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_prctl = None


def _set_timer_slack(ns: int) -> Optional[int]:
    """Set this thread's timer slack (Linux prctl); the previous value, or None if unsupported."""
    global _prctl
    if _prctl is None:  # looked up once; False where there is none (then sleep as is)
        _prctl = libc_function("prctl", ctypes.c_int,
                               [ctypes.c_int] + [ctypes.c_ulong] * 4) or False
    if not _prctl:
        return None
    old = _prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if old < 0 or _prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) != 0:
        return None
    return old


def barrier(comm) -> None:
    """``comm.Barrier()`` waited for asleep (see :func:`wait_all`): a rank that arrives first
    leaves the cores to the ranks still working instead of busy-polling beside them."""
    if comm.Get_size() > 1:
        wait_all([comm.Ibarrier()])



def starts(counts) -> np.ndarray:
    """Where each of ``counts``' segments starts when they lie end to end in one buffer (the
    displacements of a ``*v`` collective: the exclusive prefix sum)."""
    starts = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts


def alltoallv(comm, send: np.ndarray, send_counts: np.ndarray,
               recv_counts: np.ndarray) -> np.ndarray:
    check_large_counts(np.concatenate([send_counts, recv_counts]))
    send_displs = starts(send_counts)
    recv_displs = starts(recv_counts)
    recv = np.empty(int(recv_counts.sum()), np.uint8)
    wait_all([comm.Ialltoallv([send, (send_counts, send_displs), MPI.BYTE],
                              [recv, (recv_counts, recv_displs), MPI.BYTE])])
    return recv

