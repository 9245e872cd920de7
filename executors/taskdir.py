"""The task directory: the one owner of its format (imports nothing heavy: ranks read it).

A launch-per-task runtime hands a task to its ranks, and gets their reports back,
through a directory. Files, all owner-only (dirs 0700, files 0600):

====================  =========  =====================================================
file                  written by  what
====================  =========  =====================================================
``task.pkl``          client     the pickled :class:`~hetflow.executors.payload.TaskPayload`
``meta.json``         client     ``{"resources": {...}, "sys_path": [...]}``
``rank-<r>.pkl``      rank r     its :class:`~hetflow.executors.payload.RankOutcome` (atomic)
``pid-<r>``           rank r     its pid, so a launcher's report can be traced to a rank
``fault-<r>.txt``     rank r     faulthandler's stack dump on a fatal signal
``exit-<r>.json``     rank r     ``{"exitcode": c}`` when it called ``os._exit(c)``
``status-<pid>.json`` supervisor how rank process ``pid`` ended, and when (see _supervise)
``shm-<r>.json``      rank r     ``{"host": h, "paths": [...]}``: the MPI's shared-memory
                                 segments it mapped that are still linked once it has
                                 started (Open MPI's), removed by the client on host ``h``
                                 when the launch has ended
``cancel``            client     asks a remote launcher to stop the job
``attempt``           client     the RP task running it now (radical's RAPTOR path: a copy
                                 of an earlier attempt that a RAPTOR master still held
                                 finds another name there and does not run)
``launcher.json``     launcher   where the job's launcher runs (host, pid, start ticks);
                                 a batch job's script: ``job`` id, ``launched`` (its
                                 start), then ``returncode`` (srun's) when it ends
``job.sh``            client     a batch job's script (the slurm runtime)
``stdout/stderr``     launcher   the launcher's output
====================  =========  =====================================================

A pool world's state directory uses the same per-rank files, indexed by world rank.

Death evidence is ranked once, here (:meth:`TaskDir.deaths`): the supervisors'
records give the order (the earliest end is the cause), a rank's own evidence the
best description; what only a launcher or pilot can tell (Hydra's report, RP's
``$RP_RET``) plugs in as a fallback source.
"""
from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable

from hetflow._private import PRIVATE_UMASK, private_dir, private_umask, user_umask  # noqa: F401

#: ``{rank: (description, text)}``: how ranks died, the cause first.
Deaths = dict[int, tuple[str, str]]

PAYLOAD, META, CANCEL, LAUNCHER = "task.pkl", "meta.json", "cancel", "launcher.json"
ATTEMPT = "attempt"


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, owner-only: a reader never sees half a file."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{os.getpid()}.tmp"
    with open(tmp, "wb", opener=_private) as fh:
        fh.write(data)
    os.replace(tmp, path)


def describe(status: dict) -> str:
    """How a supervisor's record says its rank ended ("was killed by signal 9")."""
    if status.get("signal"):
        return f"was killed by signal {status['signal']}"
    return f"exited with code {status.get('exitcode')}"


class TaskDir:
    """One task's directory (or a pool world's state directory)."""

    def __init__(self, path: str):
        self.path = path
        self.stdout = os.path.join(path, "stdout")
        self.stderr = os.path.join(path, "stderr")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open_output(self):
        """The launcher's ``(stdout, stderr)`` files, owner-only, for ``Popen`` (the caller
        closes them: ``with out, err:``)."""
        return open(self.stdout, "wb", opener=_private), open(self.stderr, "wb", opener=_private)

    def _names(self):
        try:
            return os.listdir(self.path)
        except OSError:
            return []

    # ------------------------------------------------------------------ client side
    def create(self, payload: bytes, resources: dict, sys_path) -> "TaskDir":
        """Write what the ranks read: the payload and ``meta.json``."""
        private_dir(self.path)
        write_private(self.file(PAYLOAD), payload)
        write_private(self.file(META), json.dumps(
            {"resources": resources, "sys_path": list(sys_path)}).encode())
        return self

    def ask_to_stop(self) -> None:
        """Ask the launcher watching this dir (maybe on another node) to stop the job."""
        private_dir(self.path)
        write_private(self.file(CANCEL), b"")

    def stop_requested(self) -> bool:
        return os.path.exists(self.file(CANCEL))

    def set_attempt(self, name: str) -> None:
        """Name the attempt that runs the task from now on (see ``ATTEMPT``)."""
        write_private(self.file(ATTEMPT), name.encode())

    def is_attempt(self, name: str) -> bool:
        """Whether ``name`` is the task's current attempt (False once the dir is gone)."""
        try:
            with open(self.file(ATTEMPT), "rb") as fh:
                return fh.read().decode() == name
        except OSError:
            return False

    def clear(self) -> None:
        """Empty the dir (a task that runs again must not see its last run's files)."""
        import shutil   # client side only: ranks do not pay for it

        for name in self._names():
            path = self.file(name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)

    # ------------------------------------------------------------------ rank side
    def read_payload(self) -> bytes:
        with open(self.file(PAYLOAD), "rb") as fh:
            return fh.read()

    def read_meta(self) -> dict:
        with open(self.file(META)) as fh:
            return json.load(fh)

    def write_outcome(self, outcome) -> None:
        write_private(self.file(f"rank-{outcome.rank}.pkl"), pickle.dumps(outcome))

    def record_deaths(self, rank: int) -> Callable[[], None]:
        """Leave evidence if this rank dies without reporting, so the error can name it.

        Writes ``pid-<rank>``; a fatal signal dumps the stack to ``fault-<rank>.txt``
        (faulthandler); ``os._exit(n)`` writes ``exit-<rank>.json`` first. Returns a
        function that removes the hooks (for a process that outlives the task).
        """
        import faulthandler

        write_private(self.file(f"pid-{rank}"), str(os.getpid()).encode())
        fault = open(self.file(f"fault-{rank}.txt"), "w", opener=_private)
        faulthandler.enable(file=fault, all_threads=False)
        real_exit = os._exit
        exit_path = self.file(f"exit-{rank}.json")

        def _exit(code: int = 0):
            try:
                write_private(exit_path, json.dumps({"exitcode": code}).encode())
            finally:
                real_exit(code)

        os._exit = _exit

        def undo() -> None:
            os._exit = real_exit
            faulthandler.disable()
            fault.close()

        return undo

    @staticmethod
    def is_shm_record(name: str) -> bool:
        """Whether file ``name`` is a rank's shared-memory record (:meth:`record_shm`)."""
        return name.startswith("shm-") and name.endswith(".json")

    def record_shm(self, rank: int, host: str, paths) -> None:
        write_private(self.file(f"shm-{rank}.json"),
                      json.dumps({"host": host, "paths": sorted(paths)}).encode())

    def shm_recorded(self, host: str) -> set:
        """The segment paths the ranks on ``host`` recorded (``record_shm``)."""
        paths = set()
        for name in self._names():
            if self.is_shm_record(name):
                try:
                    with open(self.file(name)) as fh:
                        record = json.load(fh)
                    if record.get("host") == host:
                        paths.update(p for p in record.get("paths", ()) if isinstance(p, str))
                except (OSError, ValueError, AttributeError):
                    continue
        return paths

    def status_path(self, pid: int) -> str:
        return self.file(f"status-{pid}.json")

    def write_status(self, pid: int, record: dict) -> None:
        """The supervisor's record of how rank process ``pid`` ended."""
        write_private(self.status_path(pid), json.dumps(record).encode())

    def write_launcher(self, info: dict) -> None:
        write_private(self.file(LAUNCHER), json.dumps(info).encode())

    # ------------------------------------------------------------------ reading reports
    def outcomes(self) -> dict:
        """Every complete rank report present, by rank."""
        found = {}
        for name in self._names():
            if name.startswith("rank-") and name.endswith(".pkl"):
                try:
                    with open(self.file(name), "rb") as fh:
                        outcome = pickle.load(fh)
                except (OSError, EOFError, pickle.UnpicklingError):
                    continue
                found[outcome.rank] = outcome
        return found

    def has_outcome(self, rank: int) -> bool:
        return os.path.exists(self.file(f"rank-{rank}.pkl"))

    def pids(self) -> dict[int, int]:
        """``{rank: pid}`` from the ``pid-<rank>`` files."""
        pids = {}
        for name in self._names():
            if name.startswith("pid-"):
                try:
                    with open(self.file(name)) as fh:
                        pids[int(name[4:])] = int(fh.read().strip())
                except (OSError, ValueError):
                    continue
        return pids

    def any_rank_started(self) -> bool:
        """A rank that reached the runner leaves ``fault-<rank>.txt``."""
        return any(name.startswith("fault-") for name in self._names())

    def read_launcher(self) -> dict | None:
        try:
            with open(self.file(LAUNCHER)) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def load_status(self, pid: int) -> dict | None:
        """The supervisor's record ``{"signal": s}`` or ``{"exitcode": c}`` (with ``"at"``), or None."""
        try:
            with open(self.status_path(pid)) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def own_deaths(self) -> Deaths:
        """Ranks that left evidence themselves (``os._exit`` code, fatal-signal stack), by rank."""
        deaths: Deaths = {}
        for name in self._names():
            path = self.file(name)
            try:
                if name.startswith("exit-") and name.endswith(".json"):
                    with open(path) as fh:
                        code = json.load(fh)["exitcode"]
                    deaths[int(name[5:-5])] = (f"called os._exit({code})", "")
                elif name.startswith("fault-") and name.endswith(".txt") and os.path.getsize(path):
                    with open(path, errors="replace") as fh:
                        text = fh.read()
                    first = text.splitlines()[0] if text else "fatal signal"
                    deaths.setdefault(int(name[6:-4]), (f"died ({first})", text))
            except (OSError, ValueError, KeyError):
                continue
        return dict(sorted(deaths.items()))

    def supervised_ends(self) -> dict[int, tuple[str, float]]:
        """``{rank: (description, at)}`` from the supervisors' records, earliest end first."""
        ends = {}
        for rank, pid in self.pids().items():
            status = self.load_status(pid)
            if status is not None:
                ends[rank] = (describe(status), float(status.get("at", float("inf"))))
        return dict(sorted(ends.items(), key=lambda item: (item[1][1], item[0])))

    def deaths(self, *fallbacks: Callable[[], Deaths]) -> Deaths:
        """Every rank death this dir shows, the cause first: ``{rank: (description, text)}``.

        The supervisors' records give the order (earliest end first); a rank's own
        evidence the description; ranks with evidence but no record (unsupervised)
        follow in rank order. Only when the dir shows no death at all is each
        ``fallback`` asked in turn (what a launcher or pilot saw: a SIGKILL leaves
        nothing in the dir when no supervisor watched the rank).
        """
        own = self.own_deaths()
        ends = self.supervised_ends()
        order = list(ends) + [r for r in own if r not in ends]
        found = {r: own.get(r) or (ends[r][0], "") for r in order}
        for source in fallbacks:
            if found:
                break
            found = source() or {}
        return found
