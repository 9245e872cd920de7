"""The pool's wire protocol: the frames between the client's ROUTER and each rank.

Imports nothing heavy: every rank of a pool world reads it at start-up. Each rank
has two DEALER sockets: its main one (identity ``b"<world>.<rank>"``) that takes
tasks, and a control one (the same identity plus :data:`CONTROL_SUFFIX`) whose
thread heartbeats and obeys kill orders while the main thread runs a task.
A message is a list of frames whose first frame is its kind:

================  ============  =============================================
kind              direction     frames after the kind
================  ============  =============================================
:data:`REGISTER`  rank -> pool  pickled ``{world, rank, size, pid, supervisor, host}``
:data:`TASK`      pool -> rank  pickled header (:func:`task_frames`), payload
:data:`OUTCOME`   rank -> pool  task id (8 bytes LE), pickled outcome, its value
:data:`DROP`      pool -> rank  key of a resident object to forget
:data:`EXIT`      pool -> rank  (none): leave the loop and exit
:data:`HEARTBEAT` control -> pool  (none); the pool answers :data:`HEARTBEAT_ACK`
:data:`KILL`      pool -> control  (none): end the rank's process now
================  ============  =============================================
"""
from __future__ import annotations

import pickle
from typing import List, Tuple

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


def identity(world: int, rank: int) -> bytes:
    """The main socket identity of world rank ``rank`` of world ``world``."""
    return f"{world}.{rank}".encode()


def control_identity(rank_identity: bytes) -> bytes:
    return rank_identity + CONTROL_SUFFIX


def rank_identity(control: bytes) -> bytes:
    """The main identity behind a control socket's identity."""
    return control[:-len(CONTROL_SUFFIX)] if control.endswith(CONTROL_SUFFIX) else control


def register_frames(info: dict) -> List[bytes]:
    return [REGISTER, pickle.dumps(info)]


def read_register(frame: bytes) -> dict:
    return pickle.loads(frame)


def task_frames(task_id: int, ranks: Tuple[int, ...], slots: Tuple[int, ...], cache: bool,
                cores_per_rank: int, payload: bytes) -> list:
    """A task for the ranks ``ranks`` of a world (pool ``slots``, in task-rank order).

    ``cache``: the ranks keep the communicator over ``ranks`` for later tasks.
    """
    return [TASK, pickle.dumps((task_id, tuple(ranks), tuple(slots), cache, cores_per_rank)),
            payload]


def read_task_header(frame: bytes) -> Tuple[int, tuple, tuple, bool, int]:
    """``(task_id, ranks, slots, cache, cores_per_rank)`` from a :data:`TASK` header frame."""
    return pickle.loads(frame)


def outcome_frames(task_id: int, outcome) -> list:
    """A rank's outcome; its already-pickled value travels as its own frame (no second pickle)."""
    value, outcome.value = outcome.value, b""
    return [OUTCOME, task_id.to_bytes(8, "little"),
            pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL), value]


def read_outcome(id_frame: bytes, outcome_frame: bytes, value: bytes):
    """``(task_id, outcome)`` from an :data:`OUTCOME` message's frames, its value restored."""
    outcome = pickle.loads(outcome_frame)
    outcome.value = value
    return int.from_bytes(id_frame, "little"), outcome
