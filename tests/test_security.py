"""Nobody else runs code through a hetflow runtime (issue 14).

Per runtime, one runtime per module (it is shared by the tests of that runtime;
radical's owner-only check runs on the tests' shared pilot, ``conftest.SharedRuntime``):

- a rogue process (``rogue.py``, a separate ``python``) finds every TCP port the
  runtime's processes listen on (the client and every process carrying the
  runtime's token) and sends each one pickles that would create a marker file,
  random bytes, a forged outcome for the task running meanwhile, and 2,000
  connections. The marker never appears, the running task's result is the real
  one, the runtime runs new tasks after, and no process or descriptor leaks (the
  load test's counting).

  What listens, measured here: the client's own sockets (the pool's ROUTER;
  Parsl's three client sockets and its interchange, CurveZMQ), Hydra's control
  port (``mpiexec``, bound on all interfaces, the proxies and ranks inherit it),
  and each MPICH rank's netmod ports (ch4/OFI over TCP). Hydra and MPICH are
  third-party and unauthenticated: they survive all of the above on this build
  (the test attacks them too), but nothing stops a peer who speaks their
  protocols (see docs/security.md).
- a training stage's ports (mpirun's case: the code is hetflow.torch's on every runtime):
  the rogue attacks Gloo's listeners once the group is up, and ``gloo_rogue.py`` attacks
  them while the group is built (taking a peer's place in held groups, racing in others):
  no code runs, every rank gets the right result or IntruderError, within the walltime;
- every file and dir under the runtime's run dir is owner-only, while a task runs
  and after;
- the pool drops unsigned messages (counted, logged once) and treats a signed but
  malformed message from a rank as that rank's loss (TaskLost), not a broker crash;
- Parsl's executor runs with ``encrypted=True`` unless told otherwise;
- the checkpoint journal refuses a directory others can write to.
"""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time

import psutil
import pytest

import hetflow
from conftest import EXECUTOR_OPTIONS
from hetflow._guardian import marked_processes
from test_load import _snapshot

pytestmark = pytest.mark.timeout(600)

HERE = os.path.dirname(os.path.abspath(__file__))
#: radical's tests are apart (below): its rogue test is an expected failure, not run.
ROGUE_RUNTIMES = ["mpirun", "parsl", "pool"]


@hetflow.mpi_app(ranks=2)
def held(comm, release, value):
    """Wait (rank 0) until ``release`` exists, then a collective: ``value`` summed over ranks."""
    if comm.Get_rank() == 0:
        while not os.path.exists(release):
            time.sleep(0.05)
    return comm.allreduce(value)


@hetflow.mpi_app(ranks=1)
def rank_sum(comm, i):
    return comm.allreduce(i + comm.Get_rank())


def _executor_task(app_future, timeout=120):
    """The kernel's Task behind an AppFuture, once Parsl handed it to the executor."""
    deadline = time.time() + timeout
    while True:
        exec_fu = app_future.task_record.get("exec_fu")
        if exec_fu is not None:
            return exec_fu.hetflow_task
        assert time.time() < deadline, "the task never reached the executor"
        time.sleep(0.05)


def _wait_running(app_future, timeout=300):
    deadline = time.time() + timeout
    while hetflow.task_state(app_future) != hetflow.TaskState.EXECUTING:
        assert time.time() < deadline, f"task never ran: {hetflow.task_state(app_future)}"
        time.sleep(0.05)


def listening_ports(token: str) -> dict:
    """``{"host:port": process name}`` for every TCP port the runtime's processes listen on."""
    found = {}
    for pid in set(marked_processes(token)) | {os.getpid()}:
        try:
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status != psutil.CONN_LISTEN:
                    continue
                ip = conn.laddr.ip.replace("::ffff:", "")
                host = "127.0.0.1" if ip in ("0.0.0.0", "::", "::1") else ip
                found.setdefault(f"{host}:{conn.laddr.port}", proc.name())
        except psutil.Error:
            continue
    return found


def _quiet(token: str, timeout: float = 60) -> set:
    """The runtime's processes once their set stops changing (tasks' launchers exit late)."""
    deadline = time.time() + timeout
    last = None
    while True:
        now = (set(marked_processes(token)), _snapshot()["children"])
        if now == last or time.time() > deadline:
            return now[0]
        last = now
        time.sleep(0.5)


def private_violations(root: str) -> list:
    """Entries under ``root`` (and ``root``) that others or the group could use."""
    bad = []
    for path in [root] + [os.path.join(d, n) for d, dirs, files in os.walk(root)
                          for n in dirs + files]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:       # removed meanwhile (a finished task's dir)
            continue
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
            bad.append(f"{stat.S_IMODE(st.st_mode):04o} {os.path.relpath(path, root)}")
    return bad


@pytest.fixture(scope="module", params=ROGUE_RUNTIMES + ["debug"])
def loaded(request, tmp_path_factory):
    """One runtime per executor for this module: ``(name, dfk, executor, run root)``."""
    name = request.param
    if name not in hetflow.available_runtimes():
        pytest.skip(f"{name} not installed")
    options = EXECUTOR_OPTIONS.get(name, {})
    # Ports the client listened on before this runtime existed are not the runtime's: in
    # the full suite an earlier test has initialised MPI in this process, and MPICH's
    # singleton netmod listens there (see the leak check below).
    _FOREIGN_PORTS[name] = _listening_here()
    with hetflow.runtime(name, **options) as dfk:
        executor = dfk.executors[name]
        root = os.path.dirname(os.path.dirname(executor.run_dir))   # <base>/runinfo/000
        assert rank_sum.options(ranks=min(2, executor.max_ranks))(1).result() in (1, 3)
        yield name, dfk, executor, root


_FOREIGN_PORTS: dict[str, set[int]] = {}


def _listening_here() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def _accepted_on(ports: set[int]) -> int:
    """Connections this process holds that were accepted on one of ``ports``."""
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.laddr and c.laddr.port in ports and c.status != psutil.CONN_LISTEN)


def _fd_targets() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _new_descriptors(before: dict[str, str], skip_ports: set[int]) -> list[str]:
    """The descriptors opened since ``before`` (a number now naming something else counts
    as new), but connections accepted on ``skip_ports``."""
    sockets = {c.fd: c for c in psutil.Process().net_connections(kind="all")}
    new = []
    for fd, target in sorted(_fd_targets().items(), key=lambda item: int(item[0])):
        conn = sockets.get(int(fd))
        if before.get(fd) == target or (conn and conn.laddr and conn.laddr.port in skip_ports
                                        and conn.status != psutil.CONN_LISTEN):
            continue
        new.append(f"{fd} -> {target}" + (f" {conn.laddr} {conn.raddr} {conn.status}"
                                          if conn else ""))
    return new


def _ranks(executor) -> int:
    return min(2, executor.max_ranks)


def test_runtime_files_are_owner_only(loaded, tmp_path):
    name, dfk, executor, root = loaded
    _owner_only(name, executor, root, [], tmp_path)


@pytest.mark.on_shared_runtime("radical")
def test_radical_files_are_owner_only(shared_executor, tmp_path):
    """The same on the tests' shared RADICAL-Pilot runtime (a pilot of this module's own
    cost a minute of the suite): its run dir, and the sandbox dir the tests gave it."""
    root = os.path.dirname(os.path.dirname(shared_executor.run_dir))
    assert not shared_executor.base.startswith(root + os.sep)   # checked apart, then
    _owner_only("radical", shared_executor, root, [shared_executor.base], tmp_path)


def _owner_only(name, executor, root, also, tmp_path):
    """Every entry under ``root`` and the dirs ``also`` is owner-only, while a task runs
    and after a task failed; ``root`` itself is 0700."""
    release = str(tmp_path / "release")
    fut = held.options(ranks=_ranks(executor))(release, 2) if name != "debug" else None
    bad = []
    if fut is not None:
        _wait_running(fut)
        time.sleep(1.0)                  # the ranks have written their pid and fault files
        for path in (root, *also):
            bad += private_violations(path)
        open(release, "w").close()
        assert fut.result(timeout=300) == 2 * _ranks(executor)
    else:
        open(release, "w").close()
        assert held.options(ranks=1)(release, 2).result() == 2
    with pytest.raises((hetflow.TaskFailed, ZeroDivisionError)):
        fail.options(ranks=_ranks(executor))().result(timeout=300)
    for path in (root, *also):
        bad += private_violations(path)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert not bad, f"{name}: entries others can use under {root}:\n" + "\n".join(bad)


@hetflow.mpi_app(ranks=1)
def fail(comm):
    return 1 // 0


def test_rogue_process_cannot_run_code_or_forge_results(loaded, tmp_path, caplog):
    name, dfk, executor, root = loaded
    caplog.set_level(logging.WARNING, logger="hetflow")
    token = dfk.hetflow_token
    ranks = _ranks(executor)
    marked_before = _quiet(token)        # the last test's processes have ended
    before = _snapshot()
    fds_before = _fd_targets()
    events_before = list(getattr(executor, "events", []))

    release = str(tmp_path / "release")
    if name == "debug":      # runs tasks in the client, one at a time: none runs meanwhile
        open(release, "w").close()
    fut = held.options(ranks=ranks)(release, 5)
    task = _executor_task(fut)
    if name != "debug":
        _wait_running(fut)
        time.sleep(1.0)                  # its ranks are up and listening too
    targets = listening_ports(token)
    assert targets, f"{name}: no listening port found"
    mpich_ports = set(_FOREIGN_PORTS.get(name, set()))
    if name == "debug":
        mpich_ports |= {int(t.rsplit(":", 1)[1]) for t in targets}
    held_before = _accepted_on(mpich_ports)
    marker = str(tmp_path / "marker")
    rogue = subprocess.run([sys.executable, os.path.join(HERE, "rogue.py"), marker,
                            str(task.id), *sorted(targets)],
                           capture_output=True, text=True, timeout=480)
    assert rogue.returncode == 0, rogue.stderr
    open(release, "w").close()

    assert fut.result(timeout=300) == 5 * ranks, "the running task's result was forged"
    assert not os.path.exists(marker), f"{name}: a rogue pickle was unpickled"
    sizes = (1, 2, 1, 2) if executor.max_ranks > 1 else (1, 1)
    assert [rank_sum.options(ranks=r)(i).result(timeout=300) for i, r in enumerate(sizes)] \
        == [i * r + r * (r - 1) // 2 for i, r in enumerate(sizes)]
    if name == "pool":
        assert executor.rejected > 0
        warned = [r for r in caplog.records if "not signed" in r.getMessage()]
        assert len(warned) <= 1, "a rejected peer must be logged once, then only counted"
        assert executor.events == events_before, f"the attack cost ranks: {executor.events}"

    deadline = time.time() + (10 if name == "debug" else 60)
    while True:       # processes end and descriptors close asynchronously
        after = _snapshot()
        leaked = _new_descriptors(fds_before, mpich_ports)
        if (after["children"] == before["children"] and not leaked) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert after["children"] == before["children"], f"leaked processes: {before} -> {after}"
    # Every descriptor the client holds now must have been open before the attack, but
    # one kind, known, third-party and named here rather than hidden: a client process
    # that has initialised MPI (the debug runtime does; in the full suite earlier tests
    # have) is an MPICH singleton whose netmod (ch4:ofi, TCP) listens on ports of its own
    # and keeps every connection it accepts there open until the process exits (2,000
    # connections per port). Pool and mpirun ranks do the same in their own processes.
    # Only connections accepted on such ports are passed over: ports the client listened
    # on before the runtime started, and for debug (which opens no socket of its own)
    # every port found above. Any other new descriptor (a file, a pipe, a socket the
    # runtime opened, a connection on the runtime's own port) is a leak. Checked per
    # descriptor, not by counting: MPICH accepts what waits in its backlog whenever MPI
    # makes progress, so a count of its connections races with the count of descriptors.
    accepted = _accepted_on(mpich_ports) - held_before
    if accepted:
        print(f"\n{name}: MPICH holds {accepted} more accepted connection(s) "
              f"on {sorted(mpich_ports)}")
    assert not leaked, (f"{name}: leaked file descriptors ({before['fds']} -> {after['fds']}):\n"
                        + "\n".join(leaked[:50]))
    deadline = time.time() + 60
    while not set(marked_processes(token)) <= marked_before and time.time() < deadline:
        time.sleep(0.2)
    assert set(marked_processes(token)) <= marked_before, \
        f"{name}: processes left over from the attack: {marked_before} -> " \
        f"{sorted(marked_processes(token))}"
    print(f"\n{name}: attacked {len(targets)} port(s): {targets}\n{rogue.stdout}")


@pytest.mark.xfail(run=False, reason="RADICAL-Pilot's servers and bridges stall under a "
                                      "local peer's junk (docs/security.md)")
def test_rogue_process_cannot_run_code_through_radical(tmp_path, caplog):
    """The attack above on a radical runtime of its own. Not run: it fails, and takes
    minutes doing so. RADICAL-Pilot's own ZMQ servers and bridges (msgpack; radical.utils
    binds them on every interface, any local peer can connect) stop accepting connections
    under the 2,000-connection flood, and even without the flood, after attacks (a)-(c)
    alone the running task never completes (tried: RP's registry logs msgpack ExtraData
    errors, the result is still missing 300 s later). A local denial of service hetflow
    cannot fix from outside RP (docs/security.md). Run it with ``--runxfail``, alone
    (this module's other runtimes hold Parsl's one DataFlowKernel)."""
    _FOREIGN_PORTS["radical"] = _listening_here()
    with hetflow.runtime("radical", **EXECUTOR_OPTIONS.get("radical", {})) as dfk:
        executor = dfk.executors["radical"]
        root = os.path.dirname(os.path.dirname(executor.run_dir))
        test_rogue_process_cannot_run_code_or_forge_results(("radical", dfk, executor, root),
                                                             tmp_path, caplog)


# ----------------------------------------------------------------------------- pool
@hetflow.mpi_app(ranks=1)
def forge_from_rank(comm, kind):
    """Send, on this rank's own (authenticated) socket to the pool, a signed but malformed
    message, as a buggy or compromised rank could; then wait to be stopped."""
    import gc

    import zmq

    from hetflow.executors.pool import wire

    sock = next(o for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed
                and o.type == zmq.DEALER
                and not o.getsockopt(zmq.IDENTITY).endswith(wire.CONTROL_SUFFIX))
    identity = sock.getsockopt(zmq.IDENTITY)
    frames = {"short": [wire.OUTCOME, b"\x01"],
              "garbage": [wire.OUTCOME, b"\0" * 8, b"not a pickle", b""],
              "object": [wire.OUTCOME, b"\0" * 8, __import__("pickle").dumps(42), b""],
              "register": [wire.REGISTER, b"[1, 2]"],
              "kind": [b"?"]}[kind]
    sock.send_multipart(wire.Signer.from_env().sign(wire.TO_POOL, identity, frames))
    time.sleep(60)
    return "not stopped"


def test_pool_malformed_signed_message_loses_only_that_rank():
    """In a child process (this module's runtimes hold Parsl's one DataFlowKernel), on a
    pool of one rank: each loss replaces the whole world, so no surviving MPI peer of a
    killed rank is involved, only the broker's handling of the message."""
    script = f"""
import sys
sys.path.insert(0, {HERE!r})
import hetflow
from test_security import forge_from_rank, rank_sum
with hetflow.runtime("pool", max_ranks=1) as dfk:
    executor = dfk.executors["pool"]
    for kind in ("short", "garbage", "object", "register", "kind"):
        try:
            forge_from_rank(kind).result(timeout=120)
            raise SystemExit(kind + ": a malformed message was believed")
        except hetflow.TaskLost as exc:
            assert "malformed" in str(exc), (kind, str(exc))
        assert executor._broken is None, executor._broken
        assert rank_sum.options(ranks=1)(4).result(timeout=120) == 4
    assert executor.rejected == 0, executor.rejected
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=400, cwd=HERE)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


def test_pool_key_file_is_private_and_not_in_argv(loaded):
    name, dfk, executor, root = loaded
    if name != "pool":
        pytest.skip("the pool's key")
    key = executor._signer.key
    assert key and len(key) == 32
    st = os.stat(executor._keyfile)
    assert stat.S_IMODE(st.st_mode) == 0o600
    for pid in marked_processes(dfk.hetflow_token):
        try:
            proc = psutil.Process(pid)
            assert key.hex() not in " ".join(proc.cmdline())
            assert all(key.hex() not in v for v in proc.environ().values())
        except psutil.NoSuchProcess:
            continue


# ----------------------------------------------------------------------------- parsl
def test_parsl_is_encrypted_by_default(loaded):
    name, dfk, executor, root = loaded
    if name != "parsl":
        pytest.skip("Parsl's executor")
    from hetflow.executors.parsl_htex import ParslMPIExecutor

    assert ParslMPIExecutor().encrypted is True
    assert ParslMPIExecutor(encrypted=False).encrypted is False
    assert executor.encrypted is True
    assert executor.cert_dir and os.path.isdir(executor.cert_dir)
    assert stat.S_IMODE(os.stat(executor.cert_dir).st_mode) == 0o700
    assert rank_sum.options(ranks=2)(1).result(timeout=300) == 3


# ----------------------------------------------------------------------------- journal
def test_checkpoint_journal_refuses_a_directory_others_can_write(tmp_path):
    """In a child process: this module's runtimes hold Parsl's one DataFlowKernel."""
    script = f"""
import os, stat, sys
sys.path.insert(0, {HERE!r})
import hetflow
from test_security import rank_sum
shared = os.path.join({str(tmp_path)!r}, "shared")
os.mkdir(shared)
for mode in (0o777, 0o775, 0o757):
    os.chmod(shared, mode)
    try:
        with hetflow.runtime("mpirun", checkpoint=shared):
            raise SystemExit("a runtime started on a checkpoint dir others can write")
    except hetflow.ConfigError as exc:
        assert "written by its group or by others" in str(exc), exc
fresh = os.path.join({str(tmp_path)!r}, "fresh")
with hetflow.runtime("mpirun", max_ranks=2, checkpoint=fresh):
    assert rank_sum.options(ranks=1)(4).result() == 4
assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
records = os.listdir(fresh)
assert records, "nothing journaled"
for r in records:
    assert stat.S_IMODE(os.stat(os.path.join(fresh, r)).st_mode) == 0o600, r
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=HERE)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


# ----------------------------------------------------------------------------- the pool's MAC
def test_pool_mac_is_hmac_sha256_of_the_documented_layout():
    """The signer's HMAC (its keyed states made once) is the standard library's, over the
    direction, the part lengths, the identity and the frames; any change breaks it."""
    import hmac
    import struct

    from hetflow.executors.pool import wire

    ident = wire.identity(0, 1)
    for key in (os.urandom(32), os.urandom(100)):          # 100: longer than SHA-256's block
        signer = wire.Signer(key)
        for size in (0, 300, 3000, 70_000):
            frames = [wire.TASK, os.urandom(size), memoryview(os.urandom(size // 2 + 1))]
            parts = [ident, *map(bytes, frames)]
            head = wire.TO_RANK + struct.pack(f"<{len(parts)}Q", *map(len, parts))
            expected = hmac.digest(key, head + b"".join(parts), "sha256")
            message = signer.sign(wire.TO_RANK, ident, frames)
            assert message[0] == expected
            assert signer.check(wire.TO_RANK, ident, message) == frames
            assert signer.check(wire.TO_POOL, ident, message) is None          # reflected
            assert signer.check(wire.TO_RANK, wire.identity(0, 1), message) is None
            moved = [message[0], frames[0], bytes(frames[1]) + bytes(frames[2])[:1],
                     bytes(frames[2])[1:]]                  # same bytes, other frame cuts
            assert signer.check(wire.TO_RANK, ident, moved) is None
            assert wire.Signer(os.urandom(32)).check(wire.TO_RANK, ident, message) is None


@hetflow.mpi_app(ranks=2, walltime=300)
def held_training(comm, release, up):
    """A training stage: a Gloo group up, rank 0 waits for ``release`` while rank 1 waits in
    a Gloo all-reduce, then a DDP step. Rank 0 writes every rank's listening ports to ``up``."""
    import json

    import torch
    import torch.distributed as dist

    import hetflow.torch as ht

    with ht.process_group() as group:
        mine = sorted(c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN)
        ports = comm.gather(mine, root=0)
        if group.rank == 0:
            with open(up + ".tmp", "w") as fh:
                json.dump(ports, fh)
            os.replace(up + ".tmp", up)
            while not os.path.exists(release):
                time.sleep(0.05)
        total = torch.tensor([float(group.rank + 1)])
        dist.all_reduce(total)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        model(torch.ones(2, 4)).sum().backward()
        return total.item(), float(model.module.weight.grad.sum())


def _gloo_case(name: str) -> None:
    """Skip unless on mpirun with torch installed: Gloo's ports are hetflow.torch's, the same
    on every runtime, so mpirun's case covers them."""
    import importlib.util

    if name != "mpirun":
        pytest.skip("Gloo's ports are hetflow.torch's, the same on every runtime: mpirun's case")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch extra)")


def test_rogue_process_cannot_join_or_disturb_training(loaded, tmp_path):
    """Every port a training stage's ranks listen on (Gloo's, bound to loopback, and MPI's)
    gets the rogue's pickles, junk and 2,000 connections while the group is up and one rank
    waits in a collective: no code runs, the result is the real one, within the walltime.
    The same code builds the group on every runtime; run on mpirun (torch imports: ~4 s)."""
    name, dfk, executor, root = loaded
    _gloo_case(name)
    release, up = str(tmp_path / "release"), str(tmp_path / "up")
    fut = held_training(release, up)
    deadline = time.time() + 280
    while not os.path.exists(up):
        assert time.time() < deadline and not fut.done(), fut.exception() if fut.done() else \
            "the training group never came up"
        time.sleep(0.1)
    import json

    with open(up) as fh:
        rank_ports = set().union(*map(set, json.load(fh)))
    targets = listening_ports(dfk.hetflow_token)
    gloo = {t for t in targets if t.startswith("127.0.0.1:") and int(t.rsplit(":", 1)[1])
            in rank_ports}
    assert len(gloo) >= 2, f"no loopback (Gloo) port of the ranks among {targets}"
    marker = str(tmp_path / "marker")
    rogue = subprocess.run([sys.executable, os.path.join(HERE, "rogue.py"), marker, "0",
                            *sorted(targets)], capture_output=True, text=True, timeout=480)
    assert rogue.returncode == 0, rogue.stderr
    open(release, "w").close()
    total, grad = fut.result(timeout=300)
    assert total == 3.0 and grad == pytest.approx(8.0), "the training's result was disturbed"
    assert not os.path.exists(marker), "a rogue pickle was unpickled"
    assert rank_sum.options(ranks=2)(1).result(timeout=300) == 3
    print(f"\n{name}: attacked {len(targets)} port(s) of a training stage (on loopback, Gloo's and Hydra's: "
          f"{sorted(gloo)})\n{rogue.stdout}")


@hetflow.mpi_app(ranks=2, walltime=120, returns="all")
def training_built_under_attack(comm, pids, gates, races):
    """Builds a Gloo group once per path in ``gates``, each rank held after its listener is
    up and before it connects until that file exists (the window a stranger has, held open
    by the test), then ``races`` groups unheld; one all-reduce in each. First writes the
    ranks' pids to ``pids`` (owner-only) and waits for the rogue's ``pids.seen``. Returns
    this rank's outcome per group: the sum, or the name of the hetflow error raised."""
    import datetime
    import json

    import torch
    import torch.distributed as dist

    import hetflow.torch as ht
    from hetflow.torch import _store

    every = comm.gather(os.getpid(), root=0)
    if comm.Get_rank() == 0:
        with os.fdopen(os.open(pids + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                       "w") as fh:
            json.dump(every, fh)
        os.replace(pids + ".tmp", pids)
        while not os.path.exists(pids + ".seen"):
            time.sleep(0.01)
    comm.Barrier()
    gate = [None]

    def held(method):
        # Gloo asks the store for its peers' addresses once its own listener is up and
        # before it connects: the test holds each rank there (the fault injected from the
        # test's side; hetflow's path is the user's).
        def call(self, *args):
            if gate[0] is not None:
                while not os.path.exists(gate[0]):
                    time.sleep(0.001)
                gate[0] = None
            return method(self, *args)
        return call

    real = _store.MPIStore.get, _store.MPIStore.wait
    _store.MPIStore.get, _store.MPIStore.wait = held(real[0]), held(real[1])
    outcomes = []
    try:
        for path in [*gates, *[None] * races]:
            gate[0] = path
            try:
                with ht.process_group(timeout=datetime.timedelta(seconds=5)) as group:
                    total = torch.tensor([float(group.rank + 1)])
                    dist.all_reduce(total)
                    outcomes.append(total.item())
            except hetflow.HetflowError as exc:
                outcomes.append(type(exc).__name__)
    finally:
        _store.MPIStore.get, _store.MPIStore.wait = real
    return outcomes


def test_rogue_process_cannot_join_a_training_group_being_built(loaded, tmp_path):
    """A rogue watching the ranks' pids connects to each Gloo listener the moment it appears
    (``gloo_rogue.py``: a pickle, junk, Gloo's pair handshake, silent connections). In three
    groups the test holds the ranks until the rogue's handshakes are read, so the rogue takes
    a peer's place (seen: a rank sent it data); it echoes that rank's frames back, stays
    silent, or answers with a frame claiming 1 TiB. Every rank raises IntruderError in each
    (the silent and forged ones after the 5 s construction timeout, not the task's walltime).
    In three unheld groups the rogue races the real peers: every rank gets the sum, or
    IntruderError where the rogue was paired. No code runs, the task ends within its
    walltime, and the runtime's next task succeeds."""
    import json

    name, dfk, executor, root = loaded
    _gloo_case(name)
    pids, report = str(tmp_path / "pids"), str(tmp_path / "report")
    modes = ["echo", "silent", "forge"]
    gates = [str(tmp_path / mode) for mode in modes]
    rogue = subprocess.Popen([sys.executable, os.path.join(HERE, "gloo_rogue.py"), pids, report,
                              *(f"{mode}:{gate}" for mode, gate in zip(modes, gates))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        ranks = training_built_under_attack(pids, gates, 3).result(timeout=300)
    finally:
        _, err = rogue.communicate("", timeout=60)      # its input closed: it stops
    assert rogue.returncode == 0, err
    assert stat.S_IMODE(os.stat(pids).st_mode) == 0o600
    with open(report) as fh:
        attacks = json.load(fh)
    groups = list(zip(*ranks))                          # per group: every rank's outcome
    print(f"\nper group, every rank's outcome: {groups}\nrogue: {attacks}")
    for held, mode in enumerate(modes):
        # one listener per rank and group on this build; the pair's passive side took the
        # rogue's connection for the number it waited for, and sent the rogue data
        ports = attacks[2 * held:2 * held + 2]
        assert sorted(bool(a["paired"]) for a in ports) == [False, True], (mode, ports)
        assert groups[held] == ("IntruderError", "IntruderError"), (mode, groups)
    raced = groups[len(gates):]
    assert all(o in ((3.0, 3.0), ("IntruderError", "IntruderError")) for o in raced), groups
    # a group fails only where the rogue won the race
    won = sum(bool(a["paired"]) for a in attacks[2 * len(gates):])
    assert raced.count(("IntruderError", "IntruderError")) <= won, (groups, attacks)
    assert not os.path.exists(report + ".marker"), "a rogue pickle was unpickled"
    assert rank_sum.options(ranks=2)(1).result(timeout=300) == 3
