"""``hetflow demo``: the embedded default job (this machine, bare mpirun, small data)."""
from __future__ import annotations

import argparse
import sys


def demo(ranks: int = 2, rows: int = 100_000) -> int:
    import hetflow

    @hetflow.mpi_app(ranks=ranks, returns="all")
    def partition_stats(comm, rows_per_rank):
        import numpy as np

        rng = np.random.default_rng(comm.Get_rank())
        keys = rng.integers(0, int(0.9 * rows_per_rank * comm.Get_size()), rows_per_rank)
        dest = keys % comm.Get_size()
        counts = np.bincount(dest, minlength=comm.Get_size())
        received = comm.alltoall(counts.tolist())
        return {"rank": comm.Get_rank(), "size": comm.Get_size(), "rows_in": int(sum(received))}

    with hetflow.runtime("mpirun"):
        result = partition_stats(rows).result()
    for row in result:
        print(f"rank {row['rank']}/{row['size']}: {row['rows_in']} rows after hash exchange")
    assert sum(r["rows_in"] for r in result) == rows * ranks
    print("demo: ok")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hetflow")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the embedded default job under bare mpirun")
    d.add_argument("--ranks", type=int, default=2)
    d.add_argument("--rows", type=int, default=100_000)
    sub.add_parser("bench", add_help=False,
                   help="run the paper's experiments and write reports (hetflow bench --help)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The experiments package owns its flags; hand it the rest untouched.
        from experiments.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.ranks, args.rows)
    return 1


if __name__ == "__main__":
    sys.exit(main())
