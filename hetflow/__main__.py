"""``hetflow demo``: the embedded default job (this machine, bare mpirun, small data);
``hetflow bench``: the paper's experiments (see experiments/)."""
from __future__ import annotations

import argparse
import sys


def _join_sort(comm, rows_per_rank):
    """The Cylon pipeline on one communicator: generate, join, sort, check against pyarrow."""
    from hetflow import frame

    left = frame.generate(comm, rows_per_rank, seed=1)
    right = frame.generate(comm, rows_per_rank, seed=2)
    joined = frame.join(left, right, on="key", how="inner")
    ordered = frame.sort(joined, "key")
    # Globally ordered: each rank's first key is >= the previous rank's last key.
    keys = ordered.local.column("key")
    edges = comm.allgather((keys[0].as_py(), keys[-1].as_py()) if len(keys) else None)
    edges = [e for e in edges if e is not None]
    in_order = all(a[1] <= b[0] for a, b in zip(edges, edges[1:]))
    # The same join on one process, from the gathered inputs.
    whole_left, whole_right = left.gather(), right.gather()
    reference = None
    if comm.Get_rank() == 0:
        reference = whole_left.join(whole_right, "key", join_type="inner",
                                    right_suffix="_y").num_rows
    return {"ranks": comm.Get_size(), "rows_in": left.num_rows() + right.num_rows(),
            "joined": ordered.num_rows(), "reference": reference, "in_order": in_order,
            "backend": ordered.backend}


def demo(ranks: int = 2, rows: int = 100_000, runtime: str = "mpirun") -> int:
    """Run the join -> sort pipeline as a ``ranks``-rank task and a 1-rank task side by side."""
    import hetflow

    app = hetflow.mpi_app(_join_sort, ranks=ranks)
    with hetflow.runtime(runtime, max_ranks=max(ranks + 1, 2)):
        futures = [app(rows), app.options(ranks=1)(rows)]
        results = [f.result() for f in futures]
        times = [hetflow.task_times(f) for f in futures]
    ok = True
    for result, t in zip(results, times):
        good = result["joined"] == result["reference"] and result["in_order"]
        ok &= good
        print(f"{result['ranks']} rank(s) via {runtime}: {result['rows_in']:,} rows in, "
              f"{result['joined']:,} joined and globally sorted (pyarrow on one process: "
              f"{result['reference']:,}) on the {result['backend']} path; "
              f"function {t.function_s:.2f} s, runtime overhead {t.overhead_s:.2f} s"
              + ("" if good else "  <-- MISMATCH"))
    print("demo: ok" if ok else "demo: FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    from hetflow import __version__

    parser = argparse.ArgumentParser(prog="hetflow")
    parser.add_argument("--version", action="version", version=f"hetflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded default job under bare mpirun")
    d.add_argument("--ranks", type=int, default=2)
    d.add_argument("--rows", type=int, default=100_000, help="rows per rank and table")
    d.add_argument("--runtime", default="mpirun", help="runtime name (default: mpirun)")
    sub.add_parser("bench", add_help=False,
                   help="run the paper's experiments and write reports (hetflow bench --help)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The experiments package owns its flags; hand it the rest untouched.
        from hetflow.experiments.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.ranks, args.rows, args.runtime)
    return 1


if __name__ == "__main__":
    sys.exit(main())
