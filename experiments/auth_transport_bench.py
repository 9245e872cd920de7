"""Which authentication for the pool's socket: ``python -m experiments.auth_transport_bench``.

Round trips of a pool-shaped message (a task frame of ``--size`` bytes out, an
outcome back) between a ROUTER and a DEALER over loopback TCP, the same way the
pool's broker and a rank talk, with: no authentication, CurveZMQ (with a ZAP
handler admitting one client key), and HMAC-SHA256 over every frame (signed by
the sender, checked by the receiver, in Python). Prints microseconds per round
trip; never fails on a time.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import threading
import time

import zmq


def _echo(ctx, endpoint, mode, keys, n, key):
    sock = ctx.socket(zmq.DEALER)
    if mode == "curve":
        sock.curve_publickey, sock.curve_secretkey = keys["client"]
        sock.curve_serverkey = keys["server"][0]
    sock.connect(endpoint)
    sock.send_multipart([b"R"])
    for _ in range(n):
        frames = sock.recv_multipart()
        if mode == "hmac":
            mac, body = frames[0], frames[1:]
            if not hmac.compare_digest(mac, _sign(key, body)):
                raise SystemExit("bad mac")
            out = [b"O", body[1][:8], b"x" * 64]
            sock.send_multipart([_sign(key, out)] + out)
        else:
            sock.send_multipart([b"O", frames[1][:8], b"x" * 64])
    sock.close(0)


def _sign(key: bytes, frames) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()


def run(mode: str, n: int, size: int) -> float:
    ctx = zmq.Context()
    keys = {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}
    auth = None
    router = ctx.socket(zmq.ROUTER)
    if mode == "curve":
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.certs["*"] = {keys["client"][0]: True}
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = keys["server"]
    port = router.bind_to_random_port("tcp://127.0.0.1")
    key = secrets.token_bytes(32)
    peer = threading.Thread(target=_echo, args=(ctx, f"tcp://127.0.0.1:{port}", mode, keys, n,
                                                key))
    peer.start()
    ident, _ = router.recv_multipart()
    payload = os.urandom(size)
    header = b"h" * 40
    t = time.perf_counter()
    for i in range(n):
        body = [b"T", i.to_bytes(8, "little") + header, payload]
        router.send_multipart([ident] + ([_sign(key, body)] + body if mode == "hmac" else body))
        frames = router.recv_multipart()[1:]
        if mode == "hmac" and not hmac.compare_digest(frames[0], _sign(key, frames[1:])):
            raise SystemExit("bad mac")
    elapsed = time.perf_counter() - t
    peer.join()
    router.close(0)
    if auth is not None:
        auth.stop()
    ctx.term()
    return 1e6 * elapsed / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=5000)
    parser.add_argument("--size", type=int, nargs="*", default=[1024, 65536, 1 << 20])
    args = parser.parse_args()
    print(f"{'payload':>10} {'plain us':>10} {'curve us':>10} {'hmac us':>10}")
    for size in args.size:
        n = max(200, args.n * 1024 // max(size, 1024))
        row = {mode: min(run(mode, n, size) for _ in range(3)) for mode in ("plain", "curve",
                                                                           "hmac")}
        print(f"{size:>10} {row['plain']:>10.1f} {row['curve']:>10.1f} {row['hmac']:>10.1f}")


if __name__ == "__main__":
    main()
