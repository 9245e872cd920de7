"""The pool's wire protocol: the frames between the client's ROUTER and each rank.

Imports nothing heavy: every rank of a pool world reads it at start-up. Each rank
has two DEALER sockets: its main one (identity ``b"<world>.<rank>.<nonce>"``, the
nonce random per rank so nobody can claim an identity before the rank does) that
takes tasks, and a control one (the same identity plus :data:`CONTROL_SUFFIX`)
whose thread heartbeats and obeys kill orders while the main thread runs a task.

Authentication: every message, both ways, starts with an HMAC-SHA256 (:class:`Signer`)
under the runtime's random key (a 0600 file in the pool's private run dir, named to
the ranks by :data:`KEY_ENV`), over the direction, the rank socket's identity and
every frame. The receiver checks it before it reads (let alone unpickles) anything,
so a frame is bound to its sender and direction: it cannot be replayed to another
rank or back. A message is a MAC frame, then its kind, then the kind's frames:

================  ============  =============================================
kind              direction     frames after the kind
================  ============  =============================================
:data:`REGISTER`  rank -> pool  JSON ``{world, rank, size, pid, supervisor, host}``
:data:`TASK`      pool -> rank  pickled header (:func:`task_frames`), payload
:data:`OUTCOME`   rank -> pool  task id and kept count, outcome (a plain success packed, with
                                a quick task's samples, else pickled), its value
:data:`DROP`      pool -> rank  key of a resident object to forget
:data:`EXIT`      pool -> rank  (none): leave the loop and exit
:data:`HEARTBEAT` control -> pool  (none); the pool answers :data:`HEARTBEAT_ACK`
:data:`KILL`      pool -> control  (none): end the rank's process now
================  ============  =============================================
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import secrets
import struct
from typing import List, Optional, Sequence, Tuple

from hetflow.executors import _ranksample

REGISTER = b"R"
TASK = b"T"
OUTCOME = b"O"
DROP = b"D"
EXIT = b"X"
HEARTBEAT = b"H"
HEARTBEAT_ACK = b"h"
KILL = b"K"

#: Appended to a rank's identity for its control socket.
CONTROL_SUFFIX = b".c"
#: Payloads and values at least this big travel zero-copy (below it copying is cheaper).
ZERO_COPY_BYTES = 65536


#: Names the key file for the ranks (a path, never the key); "" when authentication is off.
KEY_ENV = "HETFLOW_POOL_KEYFILE"
#: Direction tags inside the MAC: a rank's message cannot be reflected back to a rank.
TO_RANK, TO_POOL = b">", b"<"


class Signer:
    """Signs and checks messages with one runtime's key (``key=None``: authentication off,
    the MAC frame is empty and not checked; only for measuring its cost)."""

    def __init__(self, key: Optional[bytes]):
        self.key = key
        # HMAC's two keyed SHA-256 states (RFC 2104), made once: a message costs two state
        # copies and its own bytes, not the key set-up and an OpenSSL HMAC context
        # (``hmac.digest``: 3.8 us for a no-op task's message, against 1.6 us).
        self._inner = self._outer = None
        if key is not None:
            block = (key if len(key) <= 64 else hashlib.sha256(key).digest()).ljust(64, b"\0")
            self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
            self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    @classmethod
    def new(cls) -> "Signer":
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_env(cls) -> "Signer":
        """The ranks' signer: the key from the file :data:`KEY_ENV` names."""
        path = os.environ.get(KEY_ENV, "")
        if not path:
            return cls(None)
        with open(path, "rb") as fh:
            return cls(fh.read())

    def mac(self, direction: bytes, identity: bytes, frames: Sequence) -> bytes:
        """HMAC-SHA256 over the direction, then each part's length, then the parts."""
        if self._inner is None:
            return b""
        parts = (identity, *frames)
        inner = self._inner.copy()
        # The lengths first: the same bytes cut into other frames sign differently.
        inner.update(direction + struct.pack(
            f"<{len(parts)}Q", *[len(p) if type(p) is bytes else memoryview(p).nbytes
                                 for p in parts]))
        for part in parts:
            inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def sign(self, direction: bytes, identity: bytes, frames: Sequence) -> list:
        """``frames`` with their MAC in front, for the rank socket ``identity``."""
        return [self.mac(direction, identity, frames), *frames]

    def check(self, direction: bytes, identity: bytes, message: Sequence) -> Optional[list]:
        """The frames after the MAC when it is right (and there is a kind), else None."""
        if len(message) < 2:
            return None
        if self.key is not None and not hmac.compare_digest(
                bytes(message[0]), self.mac(direction, identity, message[1:])):
            return None
        return list(message[1:])


#: ZeroMQ's ZMQ_SNDMORE as a plain int: pyzmq's ``send_multipart`` ors its enum flag per
#: frame, three enum calls each (30 Python calls per 1-rank no-op task on the client).
_SNDMORE = 2


def send(socket, frames: Sequence, copy: bool = True) -> None:
    """``socket.send_multipart(frames, copy=copy)`` without the flag arithmetic."""
    put = socket.send
    for frame in frames[:-1]:
        put(frame, _SNDMORE, copy=copy)
    put(frames[-1], 0, copy=copy)


def recv_frames(socket, flags: int = 0) -> list:
    """``socket.recv_multipart(flags, copy=False)``, each frame's ``more`` read instead of
    the socket option (pyzmq makes an enum of the option each time: 6 Python calls for a
    message of 4 frames)."""
    frame = socket.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = socket.recv(flags, copy=False)
        frames.append(frame)
    return frames


def recv(socket, flags: int = 0) -> List[bytes]:
    """``socket.recv_multipart(flags)`` (see :func:`recv_frames`)."""
    return [frame.bytes for frame in recv_frames(socket, flags)]


def identity(world: int, rank: int) -> bytes:
    """A fresh main socket identity for world rank ``rank`` of world ``world``."""
    return f"{world}.{rank}.{secrets.token_hex(16)}".encode()


def control_identity(rank_identity: bytes) -> bytes:
    return rank_identity + CONTROL_SUFFIX


def rank_identity(control: bytes) -> bytes:
    """The main identity behind a control socket's identity."""
    return control[:-len(CONTROL_SUFFIX)] if control.endswith(CONTROL_SUFFIX) else control


def register_frames(info: dict) -> List[bytes]:
    return [REGISTER, json.dumps(info).encode()]


def read_register(frame: bytes) -> dict:
    """The rank's registration, checked for shape (a malformed one raises ValueError)."""
    info = json.loads(frame)
    if not (isinstance(info, dict) and all(isinstance(info.get(k), int) for k in
                                           ("world", "rank", "pid"))
            and isinstance(info.get("host"), str)):
        raise ValueError(f"malformed registration {info!r}")
    return info


def task_frames(task_id: int, ranks: Tuple[int, ...], slots: Tuple[int, ...], cache: bool,
                generation: int, cores_per_rank: int, payload: bytes) -> list:
    """A task for the ranks ``ranks`` of a world (pool ``slots``, in task-rank order).

    ``cache``: the ranks keep the communicator over ``ranks`` for later tasks, under
    ``(ranks, generation)``; a task failed on those ranks moves their generation on, so
    every one of them creates a new communicator at once (see ``_rank.release_comm``).
    """
    return [TASK, pickle.dumps((task_id, tuple(ranks), tuple(slots), cache, generation,
                                cores_per_rank)), payload]


def read_task_header(frame: bytes) -> Tuple[int, tuple, tuple, bool, int, int]:
    """``(task_id, ranks, slots, cache, generation, cores_per_rank)`` from a :data:`TASK`
    header frame."""
    return pickle.loads(frame)


#: A rank's plain success (:func:`outcome_frames`): a tag, then rank, pid, started, finished,
#: then its host's name. Unpickling a RankOutcome cost the client 11 us (its class looked up).
_DONE, _DONE_HEAD = b"S", struct.Struct("<qqdd")
#: The same with the rank's two samples of a quick task between the stamps and the host
#: (``_ranksample.pack``): a pickled RankOutcome with them cost the client 3-4 times as much.
_SAMPLED = b"T"
_PLAIN_ATTRIBUTES: Optional[int] = None


def outcome_frames(task_id: int, outcome, kept: int = 0) -> list:
    """A rank's outcome; its already-pickled value travels as its own frame (no second pickle).
    ``kept``: the communicators of failed tasks the rank keeps (``_rank.release_comm``).
    A success carrying nothing but its stamps travels as :data:`_DONE_HEAD`, else pickled."""
    global _PLAIN_ATTRIBUTES
    value, outcome.value = outcome.value, b""
    if _PLAIN_ATTRIBUTES is None:
        _PLAIN_ATTRIBUTES = len(type(outcome)(0, "", 0, True).__dict__)
    frame = None
    if outcome.ok and outcome.original is None and len(outcome.__dict__) == _PLAIN_ATTRIBUTES:
        head = _DONE_HEAD.pack(outcome.rank, outcome.pid, outcome.started, outcome.finished)
        if outcome.samples is None:
            frame = _DONE + head + outcome.host.encode()
        else:       # sampling on: a quick task's two samples packed too, where they can be
            samples = _ranksample.pack(outcome.samples, outcome.pid, outcome.host)
            if samples is not None:
                frame = _SAMPLED + head + samples + outcome.host.encode()
    if frame is None:
        frame = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    return [OUTCOME, struct.pack("<QI", task_id, kept), frame, value]


def read_outcome(id_frame: bytes, outcome_frame: bytes, value: bytes):
    """``(task_id, outcome, kept)`` from an :data:`OUTCOME` message's frames, its value restored
    (only ever called on an authenticated message; a malformed one raises)."""
    from hetflow.executors.payload import RankOutcome

    if len(id_frame) != 12:
        raise ValueError(f"task id frame of {len(id_frame)} bytes")
    if outcome_frame[:1] == _DONE:
        rank, pid, started, finished = _DONE_HEAD.unpack_from(outcome_frame, 1)
        outcome = RankOutcome(rank, outcome_frame[1 + _DONE_HEAD.size:].decode(), pid, True,
                              value, started=started, finished=finished)
    elif outcome_frame[:1] == _SAMPLED:
        rank, pid, started, finished = _DONE_HEAD.unpack_from(outcome_frame, 1)
        at, size = 1 + _DONE_HEAD.size, _ranksample.SAMPLES_PACKED
        host = outcome_frame[at + size:].decode()
        outcome = RankOutcome(rank, host, pid, True, value, started=started, finished=finished)
        # left packed: made the samples' dicts only if someone reads them (_ranksample.expand)
        outcome.samples = (pid, host, bytes(outcome_frame[at:at + size]))
    else:
        outcome = pickle.loads(outcome_frame)
        if not isinstance(outcome, RankOutcome):
            raise TypeError(f"outcome frame holds a {type(outcome).__name__}")
        outcome.value = value
    task_id, kept = struct.unpack("<QI", id_frame)
    return task_id, outcome, kept
