"""RADICAL-Pilot's own processes run at the lowest CPU priority, so that the ranks never wait
for them (``RadicalExecutor(yield_cpu=True)``, the default).

Why (measured on a 2-core node, docs/runtimes/radical.md): RP runs ~30 processes of its own
(the client's bridges and components, the pilot's agent with its bridges and components,
the RAPTOR master) whose loops poll every ~10 ms; the intervals are constants in RP's code,
not configuration. Linux's autogroup scheduler shares the CPU between *sessions*: RP's
processes all sat in the client's session, one group as heavy as each rank's (each rank is
a session of its own: RP starts every task with ``new_session_per_task``). With two ranks
busy on two cores that group took a third of the node, and a 2-rank sort ran 2.3x slower
than under ``mpirun``.

What is done (nothing here needs privileges: only lowering is asked):

- RP starts its daemons by command name (``radical-pilot-bridge``, ``radical-pilot-component``):
  :func:`write_shims` puts two of that name first on the client's ``PATH``. Each makes its
  daemon a session of its own (a new autogroup), or lowers the
  daemon itself to nice 19 where there are no autogroups, then runs RP's. The pilot
  launcher (``pmgr_launching``) is not niced itself: the pilot's agent, and the ranks
  through it, descend from it. The agent shares its session; the ranks start sessions of
  their own.
- The agent's daemons other than its executor (whose children are the ranks) are lowered
  to nice 19 from the client once the pilot is active (:func:`lower_agent`).
- While a task has run for a second, the sessions of RP's daemons (the client's, the pilot's
  agent, the RAPTOR master) are lowered to nice 19, and raised back to 0 when no task runs
  (:class:`Yielder`): a nice-19 group next to other busy sessions gets ~1.5% of a core, so
  a pilot's start-up and dispatch under other load would crawl (measured: a bare Python
  start took 37 s in a nice-19 group, load 24).
- hetflow's RAPTOR MPI worker lowers every thread of its ranks but the one that runs the
  tasks (``executors/radical/raptor_worker.py``): that is within the rank's own group, for good.

The shims import nothing; the master and worker use ``executors/radical/lowprio.py``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from hetflow.executors.radical.lowprio import NICE, lower_threads

#: RP's daemon starters, looked up on ``PATH`` by RP's component manager.
COMMANDS = ("radical-pilot-bridge", "radical-pilot-component")
#: Components whose children are the pilot (and its ranks): not niced themselves.
PARENTS_OF_RANKS = ("pmgr_launching", "agent_executing")

_SHIM = """#!{python}
# hetflow (executors/radical/priority.py): RP's {command}, in a session of its own
import os, sys
args = sys.argv[1:]
try:
    os.setsid()
except OSError:
    pass
# Without autogroups (no /proc/self/autogroup) the daemon itself is niced, for good: the
# ones whose children are the pilot and its ranks are not.
if not os.path.exists("/proc/self/autogroup") and not (
        len(args) > 2 and args[2].startswith({parents!r})):
    try:
        os.setpriority(os.PRIO_PROCESS, 0, {nice})
    except OSError:
        pass
os.execv(sys.executable, [sys.executable, {real!r}] + args)
"""


def write_shims(bindir: str, python: str = sys.executable) -> str:
    """Write the two starters into ``bindir`` (created owner-only); return ``bindir``."""
    os.makedirs(bindir, mode=0o700, exist_ok=True)
    real_dir = os.path.dirname(python)
    for command in COMMANDS:
        path = os.path.join(bindir, command)
        text = _SHIM.format(python=python, command=command, nice=NICE,
                            parents=PARENTS_OF_RANKS, real=os.path.join(real_dir, command))
        with open(path, "w") as fh:
            fh.write(text)
        os.chmod(path, stat.S_IRWXU)
    return bindir


def is_rank_parent(title: str) -> bool:
    """Whether an RP process titled ``title`` starts the ranks (it is not niced)."""
    return any(title.startswith(f"rp.{name}.") for name in PARENTS_OF_RANKS)   # not its queue


def lower_agent(processes) -> int:
    """Lower the pilot agent's daemons (``psutil.Process`` objects of the pilot's session,
    titled ``rp.*`` by RP) to nice 19, all but those that start ranks. Returns how many."""
    count = 0
    for proc in processes:
        try:
            title = " ".join(proc.cmdline())
        except Exception:  # noqa: BLE001 - psutil.Error: gone or not ours
            continue
        if title.startswith("rp.") and not is_rank_parent(title):
            count += bool(lower_threads(proc.pid))
    return count


def is_daemon(cmdline: str) -> bool:
    """Whether a pilot-session process with this command line is one of RP's own (a bridge,
    component or agent, titled ``rp.*``; the pilot's bootstrap; the RAPTOR master)."""
    return (cmdline.startswith("rp.") or "bootstrap_0.sh" in cmdline
            or "radical-pilot-raptor-master" in cmdline)


def daemon_sessions(processes, client_sid: int) -> Dict[int, int]:
    """Session id -> one pid in it, for the sessions of RP's own daemons among ``processes``
    (``psutil.Process``), never the client's session nor a session holding a rank."""
    sessions: Dict[int, int] = {}
    ranks = set()
    for proc in processes:
        try:
            line = " ".join(proc.cmdline())
            sid = os.getsid(proc.pid)
        except (OSError, Exception):  # noqa: BLE001 - psutil.Error: gone
            continue
        if "raptor-worker" in line or "executors._rank" in line:
            ranks.add(sid)
        elif is_daemon(line):
            sessions.setdefault(sid, proc.pid)
    return {sid: pid for sid, pid in sessions.items() if sid != client_sid and sid not in ranks}


def set_group_nice(pid: int, nice: int, tries: int = 30) -> bool:
    """Set the autogroup nice of ``pid``'s session (the kernel allows one change per 0.1 s
    system-wide to an unprivileged user: EAGAIN is waited out)."""
    for _ in range(tries):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as fh:
                fh.write(str(nice))
            return True
        except BlockingIOError:
            time.sleep(0.1)
        except OSError:
            return False
    return False


class Yielder:
    """While some task's ranks have computed for ``after_s``, RP's daemon sessions run at
    nice 19; once no task's ranks compute (they all wrote their outcomes: the completion
    goes through RP) they are back at 0. Start-up, dispatch, completion and close are thus not
    slowed by other work on the node (a nice-19 group next to a busy session gets ~1.5% of a
    core: a task's completion kept waiting behind a load of 78, measured). Raising ~16 groups
    takes ~1.6 s for a user without CAP_SYS_ADMIN (the kernel allows one change per 0.1 s).

    Lowered, RP's ~16 groups still took 0.26-0.33 cores of a 2-core node from a 2-rank task
    (each nice-19 group weighs 15 against a rank's 1024; measured, experiments/runtime_cost.py).
    So while *every* task RP holds has all its ranks computing (``still``: RP has nothing
    to do until one ends), its daemons are stopped (SIGSTOP) after ``freeze_after_s``, and continued
    for ``thaw_for_s`` every ``frozen_max_s`` (RP's heartbeats time out after minutes) and
    at once by :meth:`thaw`, which the runtime calls before it hands RP anything (a submit, a
    cancel, a worker's recycling) and which the loop calls as soon as a task's ranks end.
    The processes that start the ranks (``PARENTS_OF_RANKS``) are never stopped. A stopped
    process dies by SIGKILL as any other (the guardian's way).

    An idle pilot (RP holds no task, starts or recycles no worker, cancels nothing) is
    stopped too, after ``idle_after_s``: its ~16 daemons poll on, ~0.6 cores of a 2-core node
    (measured, see docs/runtimes/radical.md). Whatever the runtime hands RP goes inside
    :meth:`handing`, which continues RP's daemons and keeps them running until it returns.

    ``state()``: ``(busy, still)``, whether some task's ranks are computing, and whether RP
    has nothing to do (every task it holds has all its ranks computing, or it holds none and
    is idle; ``still`` None: never freeze), read in one pass every ``period_s``;
    ``processes()``: the pilot session's processes.
    """

    def __init__(self, state: Callable[[], Tuple[bool, Optional[bool]]],
                 processes: Callable[[], list], after_s: float = 1.0, period_s: float = 0.1,
                 freeze_after_s: float = 0.2, frozen_max_s: float = 30.0,
                 thaw_for_s: float = 1.0, idle_after_s: float = 1.0):
        self.state, self.processes = state, processes
        self.after_s, self.period_s = after_s, period_s
        self.frozen_max_s, self.thaw_for_s = frozen_max_s, thaw_for_s
        self.freeze_after_s, self.idle_after_s = freeze_after_s, idle_after_s
        self.lowered = False
        #: How many times RP's sessions were lowered, and its daemons stopped (tests read it).
        self.lowerings = 0
        self.freezes = 0
        #: ... of which while RP was idle (no task at all).
        self.idle_freezes = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sessions: Dict[int, int] = {}
        self._guard = threading.Lock()
        self._frozen: list = []            # pids stopped now
        self._frozen_at = 0.0
        self._hold_until = 0.0             # no freeze before (monotonic)
        self._handing = 0                  # calls into RP under way (see handing)

    @property
    def frozen(self) -> bool:
        return bool(self._frozen)

    def start(self) -> None:
        if not os.path.exists("/proc/self/autogroup"):
            return                 # no autogroups: the shims niced the daemons themselves
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetflow-rp-yield")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.thaw()
        if self.lowered:
            self._set(0)

    def thaw(self, hold_s: Optional[float] = None) -> None:
        """Continue RP's stopped daemons now; no freeze for ``hold_s`` (default
        ``freeze_after_s``)."""
        with self._guard:
            self._hold_until = time.monotonic() + (self.freeze_after_s if hold_s is None
                                                   else hold_s)
            frozen, self._frozen = self._frozen, []
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass

    @contextlib.contextmanager
    def handing(self):
        """Around a call that hands RP something (a submit, a cancel, a worker's recycling):
        RP's daemons are continued first and not stopped before it returns."""
        with self._guard:
            self._handing += 1
        self.thaw()
        try:
            yield
        finally:
            with self._guard:
                self._handing -= 1
                self._hold_until = max(self._hold_until,
                                       time.monotonic() + self.freeze_after_s)

    def _freeze(self, idle: bool = False) -> None:
        pids = []
        for proc in self.processes():
            try:
                line = " ".join(proc.cmdline())
            except Exception:  # noqa: BLE001 - psutil.Error: gone
                continue
            if is_daemon(line) and not is_rank_parent(line) and "bootstrap_0.sh" not in line:
                pids.append(proc.pid)
        with self._guard:
            if time.monotonic() < self._hold_until or self._frozen or self._handing:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self._frozen.append(pid)
                except OSError:
                    pass
            self._frozen_at = time.monotonic()
            self.freezes += 1
            self.idle_freezes += idle

    def _run(self) -> None:
        since = still_since = None
        while not self._stop.wait(self.period_s):
            busy, still = self.state()
            now = time.monotonic()
            since = (since or now) if busy else None
            if busy and not self.lowered and now - since >= self.after_s:
                self._sessions = daemon_sessions(self.processes(), os.getsid(0))
                self._set(NICE)
                self.lowerings += 1
            elif not busy and self.lowered:
                self.thaw()
                self._set(0)
            if still is None:
                continue
            still_since = (still_since or now) if still else None
            if self._frozen and (not still or now - self._frozen_at >= self.frozen_max_s):
                self.thaw(hold_s=None if not still else self.thaw_for_s)
            elif still and not self._frozen and now >= self._hold_until and now - still_since \
                    >= (self.freeze_after_s if busy else self.idle_after_s):
                self._freeze(idle=not busy)

    def _set(self, nice: int) -> None:
        for pid in self._sessions.values():
            set_group_nice(pid, nice)
        self.lowered = nice > 0
