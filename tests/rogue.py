"""A rogue process on the runtime's machine: ``python rogue.py MARKER TASK_ID HOST:PORT...``.

Run by ``test_security.py`` as a separate process (another program of the same
machine, as an attacker would be). For every given TCP port it sends:

(a) pickles whose unpickling would create the file ``MARKER``, as raw bytes and as
    ZeroMQ messages shaped like the pool's (registration, outcome);
(b) random bytes, raw and as ZeroMQ frames;
(c) a valid-looking but unsigned (or wrongly signed) outcome for task ``TASK_ID``
    that would make its result 999 if it were believed (pool-shaped and Parsl-shaped);
(d) ``CONNECTIONS`` connections in a loop, each opened and closed at once.

It prints one line per port and exits 0; what it provokes is for the test to check.
Only loopback and this machine's own addresses are ever contacted.
"""
from __future__ import annotations

import builtins
import os
import pickle
import socket
import sys
import time

import zmq

#: Connections opened and closed per port in (d).
CONNECTIONS = 2000
#: Ports attacked at once.
PARALLEL = 8


class Marker:
    """Unpickling this creates the marker file (``open(path, "w")`` runs at load time)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def _raw(host: str, port: int, data: bytes) -> None:
    try:
        with socket.create_connection((host, port), timeout=2) as sock:
            sock.sendall(data)
            time.sleep(0.05)
    except OSError:
        pass


def _zmq(ctx, host: str, port: int, messages, identity: bytes = b"") -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 200)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"tcp://{host}:{port}")
    for frames in messages:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    time.sleep(0.2)
    sock.close()


def _fake_outcome(task_id: int):
    """A well-formed RankOutcome saying the task's rank 0 returned 999, unsigned."""
    from hetflow.executors.payload import RankOutcome

    outcome = RankOutcome(rank=0, host=socket.gethostname(), pid=os.getpid(), ok=True,
                          started=time.time(), finished=time.time())
    return [task_id.to_bytes(8, "little"), pickle.dumps(outcome), pickle.dumps(999)]


def attack(marker: str, task_id: int, host: str, port: int, ctx) -> None:
    bomb = pickle.dumps(Marker(marker))
    junk = os.urandom(4096)
    outcome = _fake_outcome(task_id)
    # (a) pickles, raw and in the pool's message shapes (old unsigned and MAC-first)
    _raw(host, port, bomb)
    _zmq(ctx, host, port, [[b"R", bomb], [b"\0" * 32, b"R", bomb], [bomb],
                           [b"O", b"\0" * 8, bomb, b""], [b"\0" * 32, b"O", b"\0" * 8, bomb, b""]])
    # (b) random bytes
    _raw(host, port, junk)
    _zmq(ctx, host, port, [[junk], [junk[:32], junk[32:64]], [b"H"], [b"\0" * 32, b"H"]])
    # (c) an outcome for the running task, unsigned and wrongly signed, under identities a
    # rank of world 0 might have (the identity format before the nonce)
    for ident in (b"", b"0.0", b"0.1", b"0.0.c"):
        _zmq(ctx, host, port, [[b"O", *outcome], [os.urandom(32), b"O", *outcome]],
             identity=ident)
    # ... and shaped like a Parsl HTEX result (the interchange's and client's sockets)
    parsl_result = pickle.dumps({"type": "result", "task_id": task_id,
                                 "buffer": pickle.dumps(999)})
    _zmq(ctx, host, port, [[parsl_result], [b"", parsl_result], [pickle.dumps([parsl_result])]])
    # (d) many connections (a port that stops accepting is given up after a few tries)
    refused = 0
    for _ in range(CONNECTIONS):
        try:
            socket.create_connection((host, port), timeout=2).close()
            refused = 0
        except OSError:
            refused += 1
            if refused >= 5:
                print(f"{host}:{port}: stopped accepting connections", flush=True)
                break


def main(argv) -> int:
    marker, task_id, targets = argv[0], int(argv[1]), argv[2:]
    from concurrent.futures import ThreadPoolExecutor

    ctx = zmq.Context()

    def one(target: str) -> str:
        host, port = target.rsplit(":", 1)
        start = time.time()
        attack(marker, task_id, host, int(port), ctx)
        return f"{target}: done in {time.time() - start:.1f} s"

    # A few ports at a time: a pilot listens on dozens (RP's bridges).
    with ThreadPoolExecutor(PARALLEL) as pool:
        for line in pool.map(one, targets):
            print(line, flush=True)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
