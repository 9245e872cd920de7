"""The runtime guardian alone (no runtime): what it kills when its client dies, and what not.

(tests/test_faults.py kills real clients holding each executor's runtime.)
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from hetflow._guardian import marked_processes, marker, process_environ

pytestmark = pytest.mark.timeout(60)

#: A client that starts, in this order: an older child (before its guardian), a guardian,
#: a daemonised child (double fork + setsid: re-parented to init, marked), and a fork that
#: never exec'd (unmarked, known only as a descendant). It prints their pids and waits
#: for "stop" (normal exit) or to be killed.
CLIENT = textwrap.dedent('''
    import os, subprocess, sys, time
    from hetflow._guardian import Guardian
    from hetflow.executors.rankio import node_root

    older = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    guardian = Guardian()
    daemon = subprocess.run(
        ["sh", "-c", "setsid sh -c 'sleep 300 >/dev/null 2>&1 & echo $!' </dev/null"],
        capture_output=True,
        text=True).stdout.strip()
    forked = os.fork()
    if forked == 0:
        time.sleep(300)
        os._exit(0)
    time.sleep(0.1)           # (tracked every 0.5 s, or found as an orphan of its group)
    ranks_dir = node_root("/nonexistent", "test")     # a runtime's in-memory rank files
    print(ranks_dir, guardian.token, older.pid, daemon, forked, flush=True)
    if sys.stdin.readline().strip() == "stop":
        guardian.stop()
        print("stopped", flush=True)
        sys.stdin.readline()
''')


def _client(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ranks_dir, token, *pids = proc.stdout.readline().split()
    _client.ranks_dir = ranks_dir
    return proc, token, [psutil.Process(int(p)) for p in pids]


def _gone(proc, timeout=10):
    """True once ``proc`` ended (a zombie has ended: it waits for init to reap it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _cleanup(proc, procs):
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()


def test_client_sigkill_kills_what_it_started_and_nothing_else(tmp_path):
    bystander = subprocess.Popen(["sleep", "300"])     # another process on the machine
    proc, token, (older, daemon, forked) = _client(tmp_path)
    try:
        assert daemon.pid in marked_processes(token)    # marked, though not the client's child
        assert forked.pid not in marked_processes(token)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _gone(daemon), "a daemonised child outlived its client"
        assert _gone(forked), "a fork of the client outlived it"
        assert not marked_processes(token)
        assert older.is_running(), "a child the client started before its runtime was killed"
        assert bystander.poll() is None
        assert "its guardian killed 2 process(es)" in proc.stderr.read()
        assert not os.path.exists(_client.ranks_dir), "the in-memory rank files outlived it"
    finally:
        bystander.kill()
        bystander.wait()
        _cleanup(proc, [older, daemon, forked])


def test_normal_exit_kills_nothing(tmp_path):
    proc, token, (older, daemon, forked) = _client(tmp_path)
    try:
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "stopped"
        os.kill(proc.pid, signal.SIGKILL)            # after stop(): no guardian any more
        proc.wait()
        time.sleep(1)
        assert daemon.is_running() and forked.is_running() and older.is_running()
    finally:
        _cleanup(proc, [older, daemon, forked])
        shutil.rmtree(_client.ranks_dir, ignore_errors=True)   # the runtime's, were there one


def test_tokens_are_distinct_and_marks_nest():
    from hetflow._guardian import Guardian

    outer = Guardian()
    inner = Guardian()
    try:
        assert outer.token != inner.token
        child = subprocess.Popen(["sleep", "30"])
        try:
            found_outer = marked_processes(outer.token)
            found_inner = marked_processes(inner.token)
            assert child.pid in found_outer and child.pid in found_inner
        finally:
            child.kill()
            child.wait()
    finally:
        inner.stop()
        outer.stop()
    assert not any(k.startswith("HETFLOW_RUNTIME_") for k in os.environ)


def test_the_close_waits_for_what_is_still_exiting_and_leaves_the_users_children():
    # A runtime's detached process still exiting when its executors' shutdown returned (a
    # Parsl worker pool, a pilot's component): hetflow.runtime's close returns once it has
    # ended. A process the user started inside the block carries the mark too, and is
    # neither waited for nor killed.
    import hetflow

    with hetflow.runtime("debug") as dfk:
        token = dfk.hetflow_token
        detached = subprocess.run(["sh", "-c", "sleep 2 </dev/null >/dev/null 2>&1 & echo $!"],
                                  capture_output=True, text=True).stdout.strip()
        users = subprocess.Popen(["sleep", "60"])
        assert {int(detached), users.pid} <= set(marked_processes(token))
    try:
        assert marked_processes(token) == [users.pid]
        assert users.poll() is None
    finally:
        users.kill()
        users.wait()


def test_a_process_reads_marked_from_the_moment_it_is_started():
    # subprocess.Popen returns while the child may still be inside execve, whose environment
    # then reads empty (more than half the time here): the scan waits for it to read, or a
    # close's settle and a killed client's sweep could miss a process just started (the race
    # behind a failure of the test above). A process started with no environment at all
    # reads empty, as it is.
    name = marker("0123456789abcdef")
    env = {**os.environ, name: "1"}
    for _ in range(100):
        child = subprocess.Popen(["sleep", "60"], env=env)
        try:
            environ = process_environ(child.pid)
        finally:
            child.kill()
            child.wait()
        assert (name + "=1").encode() in environ.split(b"\0")
    bare = subprocess.Popen(["sleep", "60"], env={})
    try:
        assert process_environ(bare.pid) == b""
    finally:
        bare.kill()
        bare.wait()
    assert process_environ(bare.pid) is None
