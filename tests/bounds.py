"""Time bounds shared by the test modules whose apps the ranks import (no imports here: a
rank that unpickles a test's app imports its module, and with it this one)."""

#: How long a test waits for a task that may first need a new RAPTOR worker (radical: an
#: earlier test's fault recycled the worker). Worker starts took up to ~100 s inside a Slurm
#: allocation on this loaded 2-core host (the next task after a killed rank: 76 s, and over
#: 90 s in one run), and a worker that never comes up is replaced only after worker_start_s
#: (the runtime's startup_timeout: 240 s inside the allocation tests), so a bound above one
#: failed start plus one more. A bound against a hang, not a timing.
RECOVERY_S = 360
