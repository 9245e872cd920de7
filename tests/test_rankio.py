"""Rank output modes, the stack request's safety, and the campaign's progress bar.

The per-runtime behaviour (lines prefixed, in order, on every runtime; a hang warned about
and explained by stacks) is in test_parity.py; this file covers what one runtime shows.
"""
import os
import subprocess

import pytest

import hetflow
from hetflow import _progress
from hetflow.executors import _rankio, rankio

pytestmark = pytest.mark.timeout(120)


@hetflow.mpi_app(ranks=2)
def shout(comm, tail=""):
    import sys

    print(f"out {comm.Get_rank()}")
    sys.stderr.write(f"err {comm.Get_rank()}{tail}")   # the last line has no newline
    return comm.Get_rank()


def test_files_mode_writes_a_file_per_task_and_nothing_to_the_console(tmp_path, capsys):
    with hetflow.runtime("mpirun", max_ranks=2, run_dir=str(tmp_path), output="files"):
        fut = shout()
        assert fut.result() == 0
    assert "[task" not in capsys.readouterr().out
    log = tmp_path / "runinfo" / "000" / "mpirun" / "output" / "task-000000.log"
    lines = log.read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[task 0 rank {rank}] ")]
        assert mine == [f"[task 0 rank {rank}] out {rank}", f"[task 0 rank {rank}] err {rank}"]
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    assert "[task 0 rank 1] err 1\n" in hetflow.task_output(fut)


def test_off_leaves_the_ranks_output_to_their_launcher(tmp_path, capsys):
    with hetflow.runtime("mpirun", max_ranks=2, run_dir=str(tmp_path), output="off",
                         keep_task_dirs=True):
        fut = shout("\n")
        assert fut.result() == 0
    assert "[task" not in capsys.readouterr().out and hetflow.task_output(fut) == ""
    task = tmp_path / "runinfo" / "000" / "mpirun" / "task-000000"
    launcher = (task / "stdout").read_text() + (task / "stderr").read_text()
    assert "out 1" in launcher and "err 0" in launcher
    assert not [name for name in os.listdir(task) if name.startswith("out-")]


def test_a_bad_output_is_a_config_error(tmp_path):
    with pytest.raises(hetflow.ConfigError, match="output must be"):
        with hetflow.runtime("mpirun", max_ranks=1, run_dir=str(tmp_path), output="loud"):
            pass


def test_a_pid_not_holding_the_stack_file_is_never_signalled(tmp_path):
    # A stack file naming a process that is not the task's rank (a reused pid, a forged
    # name): the process must not get SIGUSR1, whose default action would end it.
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / _rankio.stack_name(0, bystander.pid)).write_text("")
        assert rankio.stacks([str(tmp_path)], [0], wait_s=0.3) == {}
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@hetflow.mpi_app
def fail(comm):
    raise ValueError("no")


def test_the_campaign_bar_counts_done_running_and_failed(capsys):
    with hetflow.runtime("mpirun", max_ranks=2, progress=True):
        assert shout("\n").result() == 0
        with pytest.raises(hetflow.TaskFailed):
            fail().result()
    err = capsys.readouterr().err
    assert "mpirun tasks" in err and "2/2" in err and "failed 1" in err, err


def test_no_bar_off_a_terminal_by_default(capsys):
    assert not _progress.enabled(open(os.devnull, "w"))
    with hetflow.runtime("mpirun", max_ranks=2):
        assert shout("\n").result() == 0
    assert "mpirun tasks" not in capsys.readouterr().err


def test_a_stack_shows_the_task_thread_first_without_the_runtime_threads():
    # A pool rank's dump holds its control thread and zmq's beside the task's; the user must
    # read where their function is first, and a thread of their own is still shown.
    dump = "\n".join([
        "Thread 0x01 (most recent call first):",
        '  File "/v/site-packages/zmq/utils/garbage.py", line 56 in run',
        '  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner',
        "",
        "Thread 0x02 (most recent call first):",
        '  File "/v/site-packages/hetflow/executors/pool/worker.py", line 91 in _control_loop',
        '  File "/usr/lib/python3.11/threading.py", line 982 in run',
        "",
        "Thread 0x03 (most recent call first):",
        '  File "/home/u/mine.py", line 3 in helper_loop',
        '  File "/usr/lib/python3.11/threading.py", line 982 in run',
        "",
        "Current thread 0x04 (most recent call first):",
        '  File "/v/site-packages/hetflow/frame/_table.py", line 54 in num_rows',
        '  File "/home/u/app.py", line 23 in mistake',
        '  File "/v/site-packages/hetflow/_task.py", line 40 in __call__',
        '  File "/v/site-packages/hetflow/executors/_rank.py", line 200 in run_on_rank',
    ])
    text = rankio.with_source(dump)
    headers = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert headers == ["Current thread 0x04 (most recent call first):",
                       "Thread 0x03 (most recent call first):"]
    assert "num_rows" in text and "helper_loop" in text
    assert "_control_loop" not in text and "garbage.py" not in text and "run_on_rank" not in text


def test_the_follower_reads_nothing_of_a_task_whose_files_have_not_grown(tmp_path):
    # The follower visits each running task every POLL_S: a visit to a task whose files are
    # as they were costs a stat of its dir, no read (counted, not timed).
    import io
    import threading
    import types

    task = types.SimpleNamespace(id=7, resources=types.SimpleNamespace(ranks=2), done=False,
                                 times=types.SimpleNamespace(returned={}, launched=0.0))
    stream = io.StringIO()
    files = rankio.TaskFiles(task, "t", (str(tmp_path),), stream, str(tmp_path),
                             threading.Lock())
    reads = []
    poll = files.poll
    files.poll = lambda final=False: (reads.append(final), poll(final))

    def settled():              # the dir's mtime well in the past: not "too recent to tell"
        os.utime(tmp_path, ns=(1, 1))

    (tmp_path / _rankio.out_name(0)).write_text("a\n")
    settled()
    files.follow(30.0)
    assert len(reads) == 1 and stream.getvalue() == "[task 7 rank 0] a\n"
    for _ in range(5):
        files.follow(30.0)
    assert len(reads) == 1                          # nothing grew: nothing read
    with open(tmp_path / _rankio.out_name(0), "a") as fh:
        fh.write("b\n")                             # the file grew, the dir did not change
    files.follow(30.0)
    assert len(reads) == 2 and stream.getvalue().endswith("[task 7 rank 0] b\n")
    (tmp_path / _rankio.returned_name(1)).write_text("")
    files.follow(30.0)
    assert list(task.times.returned) == [1] and len(reads) == 3
    files.close(success=True)
