"""Progress output (tqdm): shown on a terminal, nothing at all otherwise."""
import io
import os
import re
import subprocess
import sys
import time

import pytest

from hetflow import _progress

pytestmark = pytest.mark.timeout(60)


class Pipe(io.StringIO):
    """A stream that is not a terminal (what CI, logs and pipes are)."""

    def isatty(self):
        return False


def _tty():
    """A pseudo-terminal: (stream the code writes to, fd to read what it wrote)."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return os.fdopen(slave, "w", buffering=1), master


def _read(fd) -> str:
    import select

    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        out += os.read(fd, 65536)
    return out.decode(errors="replace")


def test_nothing_is_printed_when_not_on_a_terminal():
    stream = Pipe()
    with _progress.waiting("the pilot", stream=stream, after=0.1):
        time.sleep(1.5)
    bar = _progress.bar(10, "[weak]", stream)
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert stream.getvalue() == ""


def test_a_long_wait_ticks_on_a_terminal():
    # Read the terminal while the wait goes on, until the line has ticked past 1 s: on a
    # busy machine a tick can come late (a fixed sleep would race the ticker thread).
    stream, fd = _tty()
    text, deadline = "", time.monotonic() + 30
    with _progress.waiting("the pilot", stream=stream, after=0.2):
        while time.monotonic() < deadline:
            text += _read(fd)
            ticks = [int(n) for n in re.findall(r"waiting for the pilot: (\d+) s", text)]
            if ticks and max(ticks) >= 2:
                break
    assert ticks and max(ticks) >= 2 and ticks == sorted(ticks), repr(text)


def test_a_short_wait_shows_nothing_even_on_a_terminal():
    stream, fd = _tty()
    with _progress.waiting("the pilot", stream=stream, after=5):
        time.sleep(0.2)
    assert _read(fd) == ""


def test_bar_draws_on_a_terminal_and_can_be_turned_off(monkeypatch):
    stream, fd = _tty()
    bar = _progress.bar(4, "[weak]", stream)
    bar.update(4)
    bar.close()
    assert "[weak]" in _read(fd)
    monkeypatch.setenv("HETFLOW_PROGRESS", "0")
    assert not _progress.enabled(stream)


def test_a_runtime_started_off_a_terminal_prints_nothing(tmp_path):
    """The pool's start-up wait, end to end, with stderr a pipe."""
    code = ("import hetflow\n"
            "with hetflow.runtime('pool', max_ranks=2):\n"
            "    pass\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "waiting for" not in proc.stderr and "\r" not in proc.stderr
