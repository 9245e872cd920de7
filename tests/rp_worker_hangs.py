"""A RAPTOR worker whose ranks never come up (tests/rp_faults.py): each sleeps right after
MPI_Init, MPICH's shared-memory segments mapped and still named. RP loads this file by path
in the pilot, and never gets to its class."""
import time

import radical.pilot  # noqa: F401 - as the real worker's ranks do, before MPI
from mpi4py import MPI  # noqa: F401 - MPI_Init

time.sleep(86400)
