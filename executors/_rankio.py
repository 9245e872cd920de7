"""Rank side of a task's output and stacks (standard library only: ranks start fast).

While a rank runs its share of a task (:class:`Capture`, used by the shared runner), it
writes to the task's files dir (owner-only; on the client's node the one the client's kernel
made, elsewhere one in the run dir; see :mod:`hetflow.executors.rankio`):

=========================  ==========================================================
file                       what
=========================  ==========================================================
``out-<r>``                the rank's stdout and stderr (file descriptors 1 and 2, so
                           C code and subprocesses too), in the order written;
                           Python's streams are line-buffered meanwhile
``stack-<r>-<pid>.txt``    every thread's Python stack, written by faulthandler when
                           the client sends ``SIGUSR1`` (works while the rank waits
                           inside MPI, where no Python code runs); the name gives the
                           pid to signal, the open file proves the process is the rank
``returned-<r>``           created when the rank's function returned (or raised)
=========================  ==========================================================

A persistent rank (the pool's) writes neither of the last two per task: it registers one
stack file for its life at its start (:func:`keep_stacks`: ``stack-w<world>-<r>-<pid>.txt``
in the client's node root, :func:`process_stack_name`) and its runtime learns which ranks
returned from their outcomes; a task that captures no output then needs no files dir at all.

Nothing here is unpickled by anyone: the client reads text and file names.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys

#: The signal that asks a rank for its stacks.
STACK_SIGNAL = signal.SIGUSR1


def out_name(rank: int) -> str:
    return f"out-{rank}"


def returned_name(rank: int) -> str:
    return f"returned-{rank}"


def stack_name(rank: int, pid: int) -> str:
    return f"stack-{rank}-{pid}.txt"


def process_stack_name(world: int, rank: int, pid: int) -> str:
    """A persistent rank's stack file, for its life (:func:`keep_stacks`)."""
    return f"stack-w{world}-{rank}-{pid}.txt"


#: The stack file this process registered for its life (:func:`keep_stacks`), if any.
_kept_stacks = None


def keep_stacks(path: str) -> bool:
    """Have faulthandler write every thread's stack to ``path`` (owner-only) on
    ``SIGUSR1`` for the rest of this process's life; its tasks' :class:`Capture` then
    leaves the signal, and the returned marks, alone. False if it cannot."""
    global _kept_stacks
    try:
        fd = _private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    except OSError:
        return False
    try:
        faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError):
        os.close(fd)
        return False
    _kept_stacks = fd
    return True


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _ignore(signum, frame) -> None:
    """SIGUSR1 outside a task: a late request must not end a process that outlives it."""


class Capture:
    """One rank's capture for one task: a context manager around the task's function.

    ``output``: redirect file descriptors 1 and 2 to ``out-<rank>`` (False: leave them).
    Every step is best-effort: a files dir the rank cannot write (no shared file system)
    costs the task its captured output, never its run.
    """

    def __init__(self, directory: str, rank: int, output: bool = True):
        self.directory, self.rank, self.output = directory, rank, output
        self._stack = None
        self._saved: tuple = ()
        self._buffered: list = []
        self._swapped: list = []

    def __enter__(self) -> "Capture":
        if _kept_stacks is not None:     # the process's own stack file answers the signal
            if self.output:
                self._redirect()
            return self
        try:
            if signal.getsignal(STACK_SIGNAL) in (signal.SIG_DFL, None):
                signal.signal(STACK_SIGNAL, _ignore)   # what unregister() restores
        except (ValueError, OSError):                   # not the main thread: leave it
            pass
        try:
            # a plain descriptor: faulthandler writes to it; no io object (its ioctl, lseek)
            self._stack = _private(os.path.join(self.directory, stack_name(self.rank, os.getpid())),
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            faulthandler.register(STACK_SIGNAL, file=self._stack, all_threads=True, chain=False)
        except (OSError, ValueError, RuntimeError):
            self._close_stack()
        if self.output:
            self._redirect()
        return self

    def _redirect(self) -> None:
        try:
            fd = os.open(os.path.join(self.directory, out_name(self.rank)),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError:
            return
        _flush()
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for name, number in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            if _fileno(stream) != number:
                # A host that swapped the stream for its own (RAPTOR's workers do): this
                # task's prints go to the file descriptor all the same.
                self._swapped.append((name, stream))
                setattr(sys, name, open(number, "w", buffering=1, encoding="utf-8",
                                        errors="backslashreplace", closefd=False))
            elif hasattr(stream, "reconfigure") and not getattr(stream, "line_buffering", True):
                try:
                    stream.reconfigure(line_buffering=True)
                    self._buffered.append(stream)
                except (ValueError, OSError):
                    pass

    def __exit__(self, *exc) -> None:
        if self._saved:
            _flush()
            os.dup2(self._saved[0], 1)
            os.dup2(self._saved[1], 2)
            for fd in self._saved:
                os.close(fd)
            self._saved = ()
            for stream in self._buffered:
                try:
                    stream.reconfigure(line_buffering=False)
                except (ValueError, OSError):
                    pass
            self._buffered = []
            for name, stream in self._swapped:
                getattr(sys, name).close()
                setattr(sys, name, stream)
            self._swapped = []
        if self._stack is not None:
            try:
                faulthandler.unregister(STACK_SIGNAL)
            except (ValueError, RuntimeError):
                pass
            self._close_stack()
        if _kept_stacks is not None:     # its runtime learns of the return from the outcome
            return
        try:
            os.close(_private(os.path.join(self.directory, returned_name(self.rank)),
                              os.O_WRONLY | os.O_CREAT))
        except OSError:
            pass

    def _close_stack(self) -> None:
        if self._stack is not None:
            os.close(self._stack)
            self._stack = None


def _fileno(stream) -> int:
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):
        return -1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (ValueError, OSError):
            pass
