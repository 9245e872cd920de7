"""Two tasks running at the same time, shown: each touches a file the other waits for."""
from __future__ import annotations

import os
import time


def meet(comm, mine: str, theirs: str, timeout: float = 60.0) -> bool:
    """Rank 0 touches ``mine`` and waits up to ``timeout`` s for ``theirs``; every rank
    returns whether it appeared (collective over ``comm``)."""
    met = None
    if comm.Get_rank() == 0:
        open(mine, "w").close()
        deadline = time.time() + timeout
        while not os.path.exists(theirs) and time.time() < deadline:
            time.sleep(0.01)
        met = os.path.exists(theirs)
    return comm.bcast(met, root=0)
