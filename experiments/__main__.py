"""``python -m hetflow.experiments ...``: the same as ``hetflow bench ...``."""
import sys

from hetflow.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m hetflow.experiments"))
