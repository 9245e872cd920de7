"""The rank-side runner every executor shares (imports no Parsl: ranks start fast).

``python -m hetflow.executors._rank TASKDIR`` is what one launch-per-task
executor runs on each rank: read ``TASKDIR/task.pkl``, run this rank's share on
``COMM_WORLD`` (the launch is the task's world), write ``TASKDIR/rank-<r>.pkl``.
A rank whose share raised calls ``Abort`` after reporting, so no peer hangs in a
collective it will never complete. Each rank runs under a supervisor (see
:mod:`hetflow.executors._supervise`) that records how it ended.
"""
from __future__ import annotations

import json
import os
import re
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, List

import cloudpickle

from hetflow.executors._supervise import describe, load_status, supervise
from hetflow.spec import Resources


@dataclass
class TaskPayload:
    """Everything a rank needs to run its part of a task."""

    task_id: int
    func: Callable
    args: tuple
    kwargs: dict
    resources: Resources

    def dumps(self) -> bytes:
        return cloudpickle.dumps(self)


@dataclass
class RankOutcome:
    """One rank's report: its value (pickled) or its error, and when it ran."""

    rank: int
    host: str
    pid: int
    ok: bool
    value: bytes = b""
    exception: bytes = b""
    exception_type: str = ""
    message: str = ""
    traceback: str = ""
    started: float = float("nan")
    finished: float = float("nan")

    def load_value(self):
        return pickle.loads(self.value)


def _error_outcome(rank: int, exc: BaseException, started: float, finished: float,
                   where: str = "") -> RankOutcome:
    try:
        exc_bytes = cloudpickle.dumps(exc)
        pickle.loads(exc_bytes)
    except Exception:  # the exception itself cannot travel: keep its text
        exc_bytes = b""
    return RankOutcome(rank=rank, host=socket.gethostname(), pid=os.getpid(), ok=False,
                       exception=exc_bytes, exception_type=type(exc).__qualname__,
                       message=(where + str(exc)), started=started, finished=finished,
                       traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def bind_rank_environment(resources: Resources, local_rank: int) -> None:
    """Set threads and GPU binding for this rank before user code imports anything."""
    os.environ["OMP_NUM_THREADS"] = str(resources.cores_per_rank)
    if resources.gpus_per_rank:
        first = local_rank * resources.gpus_per_rank
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(d) for d in range(first, first + resources.gpus_per_rank))


def run_on_rank(payload_bytes: bytes, comm, *, sys_path: List[str] = ()) -> RankOutcome:
    """Run one rank's share of a task on ``comm`` (the task's communicator).

    The app gets ``comm.Dup()``, never ``comm`` itself, so library traffic and
    user traffic can't cross. ``sys_path`` (the client's) is prepended first, so
    functions defined in the client's modules unpickle. Never raises: errors
    become the outcome.
    """
    from hetflow._task import task_comm

    rank = comm.Get_rank()
    started = time.time()
    for entry in reversed(sys_path):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        payload: TaskPayload = cloudpickle.loads(payload_bytes)
    except Exception as exc:  # e.g. the function's module is not importable on this rank
        return _error_outcome(rank, exc, started, time.time(), "could not unpickle the task: ")
    user_comm = comm.Dup()
    try:
        started = time.time()
        with task_comm(user_comm):
            value = payload.func(*payload.args, **payload.kwargs)
        finished = time.time()
    except BaseException as exc:  # noqa: BLE001 - SystemExit on a rank is a task failure too
        return _error_outcome(rank, exc, started, time.time())
    finally:
        try:
            user_comm.Free()
        except Exception:
            pass
    try:
        value_bytes = cloudpickle.dumps(value)
    except Exception as exc:
        return _error_outcome(rank, exc, started, finished, "return value cannot be pickled: ")
    return RankOutcome(rank=rank, host=socket.gethostname(), pid=os.getpid(), ok=True,
                       value=value_bytes, started=started, finished=finished)



def local_rank() -> int:
    """This rank's index on its node, from the launcher's environment."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
                "SLURM_LOCALID", "PALS_LOCAL_RANKID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def write_outcome(taskdir: str, outcome: RankOutcome) -> None:
    """Write atomically, so a reader never sees half a report."""
    tmp = os.path.join(taskdir, f".rank-{outcome.rank}.tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(outcome, fh)
    os.replace(tmp, os.path.join(taskdir, f"rank-{outcome.rank}.pkl"))


def read_outcomes(taskdir: str) -> dict:
    """Every rank report present in ``taskdir``, by rank."""
    outcomes = {}
    for name in os.listdir(taskdir):
        if name.startswith("rank-") and name.endswith(".pkl"):
            with open(os.path.join(taskdir, name), "rb") as fh:
                outcome = pickle.load(fh)
            outcomes[outcome.rank] = outcome
    return outcomes


def record_deaths(taskdir: str, rank: int):
    """Leave evidence if this rank dies without reporting, so the error can name it.

    A fatal signal (segfault, abort) dumps the Python stack to ``fault-<rank>.txt``
    through faulthandler; ``os._exit(n)`` writes ``exit-<rank>.json`` first.
    Returns a function that removes the hooks again.
    """
    import faulthandler

    # The pid lets a launcher's report ("PID n ... killed") be traced back to this rank.
    with open(os.path.join(taskdir, f"pid-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    fault = open(os.path.join(taskdir, f"fault-{rank}.txt"), "w")
    faulthandler.enable(file=fault, all_threads=False)
    real_exit = os._exit

    def _exit(code: int = 0):
        try:
            with open(os.path.join(taskdir, f"exit-{rank}.json"), "w") as fh:
                json.dump({"exitcode": code}, fh)
        finally:
            real_exit(code)

    os._exit = _exit

    def undo() -> None:
        """Remove the hooks (for a process that outlives the task, e.g. a RAPTOR worker)."""
        os._exit = real_exit
        faulthandler.disable()
        fault.close()

    return undo


def read_deaths(taskdir: str) -> dict:
    """``{rank: (description, text)}`` for ranks that left death evidence, in rank order."""
    deaths = {}
    try:
        names = os.listdir(taskdir)
    except OSError:
        return deaths
    for name in names:
        path = os.path.join(taskdir, name)
        if name.startswith("exit-") and name.endswith(".json"):
            with open(path) as fh:
                code = json.load(fh)["exitcode"]
            deaths[int(name[5:-5])] = (f"called os._exit({code})", "")
        elif name.startswith("fault-") and name.endswith(".txt") and os.path.getsize(path):
            with open(path, errors="replace") as fh:
                text = fh.read()
            first = text.splitlines()[0] if text else "fatal signal"
            deaths.setdefault(int(name[6:-4]), (f"died ({first})", text))
    return dict(sorted(deaths.items()))


def read_rank_pids(taskdir: str) -> dict:
    """``{rank: pid}`` from the ``pid-<rank>`` files ranks leave (see :func:`record_deaths`)."""
    pids = {}
    try:
        names = os.listdir(taskdir)
    except OSError:
        return pids
    for name in names:
        if name.startswith("pid-"):
            try:
                with open(os.path.join(taskdir, name)) as fh:
                    pids[int(name[4:])] = int(fh.read().strip())
            except (OSError, ValueError):
                continue
    return pids


def read_supervised_ends(taskdir: str) -> dict:
    """``{rank: (description, at)}`` from the rank supervisors' records, earliest end first.

    A supervisor (see :mod:`hetflow.executors._supervise`) records how its rank ended
    before it ends itself, so before the launcher can stop any peer: the first record
    is the rank that died first, whatever the launcher then reports.
    """
    ends = {}
    for rank, pid in read_rank_pids(taskdir).items():
        status = load_status(taskdir, pid)
        if status is not None:
            ends[rank] = (describe(status), float(status.get("at", float("inf"))))
    return dict(sorted(ends.items(), key=lambda item: (item[1][1], item[0])))


def task_deaths(taskdir: str) -> dict:
    """Every rank death a task dir shows, the cause first: ``{rank: (description, text)}``.

    The supervisors' records give the order (earliest end first); a rank's own
    evidence (stack dump, ``os._exit`` code) gives the best description. Ranks with
    evidence but no record (an unsupervised rank) follow in rank order.
    """
    own = read_deaths(taskdir)
    ends = read_supervised_ends(taskdir)
    order = list(ends) + [r for r in own if r not in ends]
    return {r: own.get(r) or (ends[r][0], "") for r in order}


_HYDRA_BAD = re.compile(r"PID (\d+) RUNNING AT .*?\n=\s+EXIT CODE: (\d+)", re.S)
_HYDRA_SIGNAL = re.compile(r"EXIT STRING: .*?\(signal (\d+)\)")


def read_launcher_deaths(taskdir: str, launcher_stderr: str) -> dict:
    """Deaths the launcher saw but the rank could not record (SIGKILL leaves no evidence).

    Hydra reports ``PID n RUNNING AT host / EXIT CODE: c`` for the process that
    terminated badly; the ``pid-<rank>`` files map it back to a rank.
    """
    pids = {pid: rank for rank, pid in read_rank_pids(taskdir).items()}
    signal_match = _HYDRA_SIGNAL.search(launcher_stderr)
    deaths = {}
    # Only Hydra's first report: later ones are peers it stopped while cleaning up.
    for pid, code in _HYDRA_BAD.findall(launcher_stderr)[:1]:
        rank = pids.get(int(pid))
        if rank is None:
            continue
        if signal_match:
            what = f"was killed by signal {signal_match.group(1)}"
        else:
            what = f"exited with code {code}"
        deaths[rank] = (what, "")
    return deaths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    taskdir = argv[0]
    supervise(taskdir)                     # from here on: the rank (the supervisor's child)
    with open(os.path.join(taskdir, "meta.json")) as fh:
        meta = json.load(fh)
    bind_rank_environment(Resources(**meta["resources"]), local_rank())
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    record_deaths(taskdir, world.Get_rank())
    with open(os.path.join(taskdir, "task.pkl"), "rb") as fh:
        payload = fh.read()
    outcome = run_on_rank(payload, world, sys_path=meta["sys_path"])
    write_outcome(taskdir, outcome)
    if not outcome.ok and world.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        world.Abort(1)
    return 0


if __name__ == "__main__":
    # Run the importable module, not __main__, so reports pickle as hetflow.executors._rank.*
    from hetflow.executors import _rank

    sys.exit(_rank.main())
