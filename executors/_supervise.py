"""A rank's supervisor: the process a launcher starts forks at once, the child is the rank.

The parent only waits for the child and writes how it ended (``status-<pid>.json`` in the task dir)
before ending the same way. A rank killed by a signal (SIGKILL above all) leaves no
evidence of its own, and its launcher cannot say reliably which rank died first:
Hydra stops a dead rank's peers within milliseconds, and under load both its report
and a watcher's poll sometimes named a peer it stopped. The supervisor makes the
record deterministic: the launcher waits on the supervisor, so the victim's record is
written before the launcher learns of any death, while a peer the launcher stops is
SIGKILLed together with its supervisor (directly, or through ``PR_SET_PDEATHSIG``)
and leaves none.
"""
from __future__ import annotations

import os
import signal
import time

#: Exit code of a rank stopped on purpose (the pool's walltime, cancel, stuck peer).
KILLED_EXIT = 86

#: Signals the supervisor passes on to the rank (a launcher's cleanup, Ctrl-C).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
PR_SET_PDEATHSIG = 1


def supervise(statedir) -> None:
    """Fork; return in the child (the rank). The parent waits, records the child's end, exits alike.

    ``statedir`` is the :class:`~hetflow.executors.taskdir.TaskDir` the record goes to.
    """
    from hetflow.executors.taskdir import private_dir

    private_dir(statedir.path)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        try:   # die with the supervisor (a launcher may SIGKILL only its direct children)
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:
            os._exit(KILLED_EXIT)
        return
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(child, signum))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(KILLED_EXIT)
    record = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
              else {"exitcode": os.waitstatus_to_exitcode(status)})
    record["at"] = time.time()
    try:
        statedir.write_status(child, record)
    except OSError:
        pass
    if "signal" in record:   # end the way the rank ended, so the launcher reports the same
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if record["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(record["signal"], signal.SIG_DFL)
            os.kill(os.getpid(), record["signal"])
        except (OSError, ValueError):
            pass
        os._exit(128 + record["signal"])
    os._exit(record["exitcode"])


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass
