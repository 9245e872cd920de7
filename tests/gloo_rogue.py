"""A rogue process against a training group being built:
``python gloo_rogue.py PIDS REPORT [MODE:GATE ...]``.

Run by ``test_security.py`` as a separate program of the same machine. ``PIDS`` is a JSON
list of the ranks' pids (written, owner-only, by the task before it builds its group). The
rogue polls ``/proc/net/tcp{,6}`` and each pid's socket descriptors for loopback sockets that
start listening after it first looked (Gloo's: the group binds loopback on one host) and, the
moment one appears:

(a) sends a pickle (whose unpickling would create ``REPORT + ".marker"``) and random bytes;
(b) speaks Gloo's pair handshake (``gloo/transport/tcp``: the connecting side writes the
    8-byte sequence number of the pair it wants, the listener hands that connection to the
    pair waiting for the number), for the first few numbers a fresh listener gives out;
    whatever the rank then sends on a connection it paired with is echoed back (MODE
    ``echo``: a peer's answer in Gloo's frames, a 48-byte preamble then data, carrying the
    rank's own contribution), left unanswered (``silent``), or answered with the rank's own
    frame header claiming 1 TiB, then random bytes (``forge``);
(c) holds connections open without sending a byte.

Each ``MODE:GATE`` is one group the task builds (in order): the task holds its ranks after
their listeners are up and before they connect to each other, until the rogue creates
``GATE``. It does so once every rank's new listener has read the rogue's sequence numbers
(seen as the rank's accepted socket with nothing left to read), so each pair's passive side
has a rogue connection queued under the number it will ask for, ahead of its real peer.
After the gated groups, the rogue races the real peers of any further group (``echo``).

The rogue writes ``PIDS.seen`` once it has noted the listeners the pids had before. It serves
until its input closes (the test ends it), then writes ``REPORT`` (JSON): per port
attacked, the sequence numbers whose connection received data from a rank (paired).
"""
from __future__ import annotations

import builtins
import json
import os
import pickle
import socket
import struct
import sys
import threading
import time

#: Sequence numbers tried per listener: a listener numbers its pairs from 0.
SEQUENCES = range(4)
#: Silent connections held per listener.
SILENT = 8
#: Gloo's frame preamble: six size_t (nbytes, opcode, slot, offset, length, roffset).
PREAMBLE = struct.Struct("<6Q")


class Marker:
    """Unpickling this creates the marker file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def _sockets(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _tcp_table() -> list[tuple[str, int, int, str, int, int]]:
    """(local host, local port, remote port, state, rx_queue, inode) of every TCP socket."""
    rows = []
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(name) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            host_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(host_hex)
            # /proc prints the address as host-order 32-bit words
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            host = socket.inet_ntop(family, raw)
            rx = int(f[4].split(":")[1], 16)
            rows.append((host, int(port_hex, 16), int(f[2].split(":")[1], 16), f[3], rx,
                         int(f[9])))
    return rows


def _other_sockets() -> set[int]:
    """Inodes of this namespace's sockets that are not TCP (never Gloo's listeners)."""
    inodes = set()
    for name, column in (("unix", 6), ("udp", 9), ("udp6", 9), ("netlink", 9), ("raw", 9)):
        try:
            with open(f"/proc/net/{name}") as fh:
                for line in fh.read().splitlines()[1:]:
                    f = line.split()
                    if len(f) > column and f[column].isdigit():
                        inodes.add(int(f[column]))
        except OSError:
            pass
    return inodes


class Watch:
    """The loopback listening sockets of some pids that appear from now on. Reads the
    socket tables only when a pid holds a socket not classified yet, so that polling stays
    cheap beside the ranks."""

    def __init__(self, pids):
        self.pids = pids
        self.settled = {ino for pid in pids for ino in _sockets(pid)}

    def new_listeners(self) -> list[tuple[int, str, int]]:
        fresh = {pid: _sockets(pid) - self.settled for pid in self.pids}
        if not any(fresh.values()):
            return []
        rows = {ino: (h, p, st) for h, p, _, st, _, ino in _tcp_table()}
        found = []
        for pid, inodes in fresh.items():
            others = None
            for ino in inodes:
                if ino not in rows:
                    others = _other_sockets() if others is None else others
                    if ino in others:
                        self.settled.add(ino)
                    continue                     # else a TCP socket not bound yet
                host, port, state = rows[ino]
                if state == "07":                # bound, not listening yet
                    continue
                self.settled.add(ino)
                if state == "0A" and host in ("127.0.0.1", "::1"):
                    found.append((pid, host, port))
        return sorted(found)


class Attack:
    """Everything the rogue does to one listening port."""

    def __init__(self, pid: int, host: str, port: int, marker: str, mode: str):
        self.pid, self.host, self.port, self.mode = pid, host, port, mode
        self.held: list[socket.socket] = []
        self.seq_socks: dict[int, socket.socket] = {}
        self.paired: dict[int, int] = {}          # seq -> bytes the rank sent on it
        self.echoed: dict[int, int] = {}
        self.errors: list[str] = []
        self._marker = marker

    def _connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=5)

    def strike(self) -> None:
        """(a), (b)'s handshake and (c), as fast as possible after the port appeared."""
        for seq in SEQUENCES:
            try:
                sock = self._connect()
                sock.sendall(struct.pack("<q", seq))
                self.seq_socks[seq] = sock
            except OSError as exc:
                self.errors.append(f"seq {seq}: {exc}")
        for data in (pickle.dumps(Marker(self._marker)), os.urandom(4096)):
            try:
                sock = self._connect()
                sock.sendall(data)
                self.held.append(sock)
            except OSError as exc:
                self.errors.append(f"junk: {exc}")
        for _ in range(SILENT):
            try:
                self.held.append(self._connect())
            except OSError as exc:
                self.errors.append(f"silent: {exc}")

    def handshakes_read(self, table) -> bool:
        """Every sequence number sent was read by the rank (its accepted socket for our
        connection has nothing left to read)."""
        mine = _sockets(self.pid)
        ours = {s.getsockname()[1] for s in self.seq_socks.values()}
        done = {r for h, p, r, st, rx, ino in table
                if p == self.port and r in ours and ino in mine and rx == 0}
        return done == ours

    def serve(self, stop: threading.Event) -> None:
        """(b) continued: echo back what the rank sends on a paired connection."""
        threads = [threading.Thread(target=self._echo, args=(seq, sock, stop), daemon=True)
                   for seq, sock in self.seq_socks.items()]
        for t in threads:
            t.start()
        return threads

    def _echo(self, seq: int, sock: socket.socket, stop: threading.Event) -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            self.paired[seq] = self.paired.get(seq, 0) + len(data)
            if self.mode == "silent":
                continue
            if self.mode == "forge" and len(data) >= PREAMBLE.size:
                # the rank's own frame header, claiming far more data than any buffer holds
                head = list(PREAMBLE.unpack_from(data))
                head[0] = head[4] = 1 << 40
                data = PREAMBLE.pack(*head) + os.urandom(4096)
            try:
                sock.sendall(data)
                self.echoed[seq] = self.echoed.get(seq, 0) + len(data)
            except OSError:
                return

    def close(self) -> None:
        """After the serving threads ended: what a rank sent that they did not read yet
        counts too (it was sent before the task ended, whenever this process ran)."""
        for seq, sock in self.seq_socks.items():
            sock.setblocking(False)
            try:
                while data := sock.recv(1 << 16):
                    self.paired[seq] = self.paired.get(seq, 0) + len(data)
            except OSError:
                pass
        for sock in [*self.held, *self.seq_socks.values()]:
            sock.close()

    def report(self) -> dict:
        return {"pid": self.pid, "port": self.port, "paired": self.paired,
                "echoed": self.echoed, "errors": self.errors}


def main(argv) -> int:
    pids_file, report_file, rounds = argv[0], argv[1], [a.split(":", 1) for a in argv[2:]]
    while not os.path.exists(pids_file):
        time.sleep(0.001)
    with open(pids_file) as fh:
        pids = json.load(fh)
    watch = Watch(pids)
    open(pids_file + ".seen", "w").close()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    attacks: list[Attack] = []
    current: list[Attack] = []          # this gated round's
    threads = []
    while not stop.is_set():
        mode, gate = rounds[0] if rounds else ("echo", None)
        for pid, host, port in watch.new_listeners():
            attack = Attack(pid, host, port, report_file + ".marker", mode)
            attack.strike()
            attacks.append(attack)
            current.append(attack)
            threads += attack.serve(stop)
        if gate and {a.pid for a in current} == set(pids):
            table = _tcp_table()
            if all(a.handshakes_read(table) for a in current):
                open(gate, "w").close()
                rounds.pop(0)
                current = []
        time.sleep(0.001)
    for t in threads:
        t.join()
    for attack in attacks:
        attack.close()
    with open(report_file, "w") as fh:
        json.dump([a.report() for a in attacks], fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
