"""What an MPI app's ranks get of the cores under each runtime, and what the runtime's own
processes take meanwhile.

``python -m hetflow.experiments.contention [--executors mpirun,pool,radical] [--rows 100000]
[--repeats 30] [--pause-radical]`` runs one 2-rank task per runtime (the weak experiment's
join: ``--rows`` rows per rank and table), which times the join ``--repeats`` times and
reports, per rank, what its task thread got while it did (the loop's length: below):

- the join's median time (``barrier; t0; join; barrier; t1``);
- the thread's CPU seconds over the loop's wall time (1.0: it ran all the time);
- how often another thread took its core (involuntary context switches per second);
- the CPU the node's other processes used meanwhile, in cores (``/proc/stat``'s busy time less
  this task's ranks; the same on every rank).

``/proc/stat`` counts in clock ticks (10 ms), up to one tick off per CPU at each end, so the
loop runs at least ``--repeats`` joins *and* at least ``MIN_WINDOW_S`` seconds: over a 2 ms loop
one stray tick would read as several cores.

A runtime whose own processes keep the cores busy while the ranks compute (RADICAL-Pilot's
agent, components and bridges poll every 10 ms) takes CPU from the ranks, and each time it
takes it from one rank, the others wait for that rank at the next exchange. With
``--pause-radical`` the radical task's rank 0 stops RADICAL-Pilot's own processes (those named
``rp.*`` and the RAPTOR master) with SIGSTOP for the timed loop only and resumes them after,
to measure the join without them: a diagnostic, not a way to run. Linux only (``/proc``).
"""
from __future__ import annotations

import argparse
import os
import sys

import hetflow

RANKS = 2
MIN_WINDOW_S = 1.0  # 100 ticks: /proc/stat's rounding stays under 0.02 cores per CPU


def _busy_ticks() -> int:
    """The node's busy clock ticks so far, all CPUs (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def _thread_switches() -> int:
    """Involuntary context switches of the calling thread so far."""
    import threading

    with open(f"/proc/self/task/{threading.get_native_id()}/status") as fh:
        for line in fh:
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def _radical_service_pids(exclude) -> list:
    """This user's RADICAL-Pilot processes other than ``exclude``: its components and bridges
    (named ``rp.*``) and the RAPTOR master."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            with open(f"/proc/{entry}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:  # gone meanwhile
            continue
        if name.startswith("rp.") or b"radical-pilot-raptor-master" in cmdline:
            pids.append(int(entry))
    return pids


@hetflow.mpi_app(ranks=RANKS, returns="all")
def probe(comm, rows: int, repeats: int, pause: bool):
    """Time the join on this task's ranks and account what their threads got (see above)."""
    import signal
    import time

    import numpy as np
    from hetflow import frame
    from hetflow.frame._mpi import barrier

    left = frame.generate(comm, rows, seed=1)
    right = frame.generate(comm, rows, seed=2)
    key = left.local.column_names[0]
    for _ in range(5):
        frame.join(left, right, on=key, how="inner")
    ours = comm.allgather(os.getpid())
    paused = []
    if pause and comm.Get_rank() == 0:
        paused = _radical_service_pids(set(ours))
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
    try:
        barrier(comm)
        busy0, cpu0, switches0 = _busy_ticks(), time.thread_time(), _thread_switches()
        own0 = time.process_time()
        wall0 = time.perf_counter()
        times = []
        more = True
        while more:  # rank 0 decides for all, so every rank runs the same number of joins
            barrier(comm)
            t0 = time.perf_counter()
            frame.join(left, right, on=key, how="inner")
            barrier(comm)
            times.append(time.perf_counter() - t0)
            more = comm.bcast(len(times) < repeats
                              or time.perf_counter() - wall0 < MIN_WINDOW_S, root=0)
        wall = time.perf_counter() - wall0
        cpu, switches = time.thread_time() - cpu0, _thread_switches() - switches0
        busy = (_busy_ticks() - busy0) / os.sysconf("SC_CLK_TCK")
        own = sum(comm.allgather(time.process_time() - own0))
    finally:
        for pid in paused:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    return {"join_ms": float(np.median(times)) * 1e3, "thread_cpu_share": cpu / wall,
            "preempted_per_s": switches / wall, "others_cores": max(busy - own, 0.0) / wall,
            "paused": len(paused)}


def run(executors, rows: int, repeats: int, pause_radical: bool) -> list:
    """One probe task per runtime (after one to warm up); rows of results, one per rank."""
    out = []
    for name in executors:
        with hetflow.runtime(name, max_ranks=RANKS):
            probe(rows, 2, False).result()
            ranks = probe(rows, repeats, pause_radical and name == "radical").result()
        for rank, result in enumerate(ranks):
            out.append({"executor": name, "rank": rank, **result})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executors", default="mpirun,pool,radical")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per rank and table")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--pause-radical", action="store_true",
                        help="stop RADICAL-Pilot's own processes during the radical task's "
                             "timed loop (a diagnostic)")
    args = parser.parse_args(argv)
    rows = run([e.strip() for e in args.executors.split(",") if e.strip()], args.rows,
               args.repeats, args.pause_radical)
    print(f"{RANKS}-rank join, {args.rows:,} rows per rank and table, at least {args.repeats} "
          f"times and {MIN_WINDOW_S:g} s, {os.cpu_count()} cores")
    print(f"{'executor':<9} {'rank':>4} {'join ms':>8} {'thread cpu':>10} {'preempted/s':>11} "
          f"{'others (cores)':>14} {'paused':>6}")
    for r in rows:
        print(f"{r['executor']:<9} {r['rank']:>4} {r['join_ms']:>8.2f} "
              f"{r['thread_cpu_share']:>10.2f} {r['preempted_per_s']:>11.0f} "
              f"{r['others_cores']:>14.2f} {r['paused']:>6}")
    print("thread cpu: the rank's task thread's CPU seconds over the loop's wall time; "
          "preempted/s: its involuntary context switches; others: the CPU of every other "
          "process of the node meanwhile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
