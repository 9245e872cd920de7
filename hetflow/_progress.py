"""Progress on a terminal, silence elsewhere: tqdm bars for counted work, and a ticking
``waiting for the pilot: 12 s`` line for waits that last more than a few seconds.

Both write to stderr, and only when stderr is a terminal (``HETFLOW_PROGRESS=0`` turns
them off there too), so logs, pipes and CI output carry no progress noise.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator, Optional, TextIO

#: Seconds a wait must last before its line appears.
WAIT_SHOWN_AFTER_S = 3.0


def enabled(stream: Optional[TextIO] = None) -> bool:
    """Whether progress goes to ``stream`` (default stderr): only to a terminal."""
    if os.environ.get("HETFLOW_PROGRESS", "").lower() in ("0", "off", "no", "false"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


def bar(total: int, desc: str, stream: Optional[TextIO] = None, unit: str = "task"):
    """A tqdm bar over ``total`` steps; disabled (prints nothing) off a terminal."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(total=total, desc=desc, file=stream, unit=unit, leave=False,
                disable=not enabled(stream), dynamic_ncols=True)


@contextlib.contextmanager
def waiting(what: str, stream: Optional[TextIO] = None,
            after: float = WAIT_SHOWN_AFTER_S) -> Iterator[None]:
    """Show ``waiting for <what>: N s``, ticking each second, while the block runs longer
    than ``after`` seconds; the line is cleared when the wait ends."""
    stream = sys.stderr if stream is None else stream
    if not enabled(stream):
        yield
        return
    from tqdm import tqdm

    stop = threading.Event()
    shown = []

    def tick() -> None:
        t0 = time.monotonic()
        if stop.wait(after):
            return
        line = tqdm(total=None, desc=f"waiting for {what}", file=stream, leave=False,
                    bar_format="{desc}: {elapsed_s:.0f} s")
        line.start_t -= time.monotonic() - t0   # count from the start of the wait
        shown.append(line)
        while not stop.wait(1.0):
            line.refresh()

    ticker = threading.Thread(target=tick, daemon=True, name="hetflow-wait")
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        for line in shown:
            line.close()


class Campaign:
    """A user's tasks on a terminal: one tqdm bar, tasks done of those submitted, with how
    many run and how many failed. The kernel calls it; ``hetflow.runtime(progress=...)``
    makes it (by default only when stderr is a terminal)."""

    def __init__(self, label: str, stream: Optional[TextIO] = None):
        from tqdm import tqdm

        self._lock = threading.Lock()
        self._running: set = set()
        self._failed = 0
        self._bar = tqdm(total=0, desc=f"{label} tasks", file=sys.stderr if stream is None
                         else stream, unit="task", leave=True, dynamic_ncols=True)

    def submitted(self, task_id: int) -> None:
        with self._lock:
            self._bar.total += 1
            self._show()

    def started(self, task_id: int) -> None:
        with self._lock:
            self._running.add(task_id)
            self._show()

    def finished(self, task_id: int, state) -> None:
        with self._lock:
            self._running.discard(task_id)
            if state != "DONE":
                self._failed += 1
            self._bar.update(1)
            self._show()

    def _show(self) -> None:
        self._bar.set_postfix_str(f"running {len(self._running)}, failed {self._failed}",
                                  refresh=True)

    @contextlib.contextmanager
    def paused(self):
        """Clear the bar while other lines print (the ranks' output), then redraw it."""
        with self._lock:
            self._bar.clear()
            try:
                yield
            finally:
                self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            self._bar.close()
