"""Counting what the client's Python does while a pool runs tasks (tests/test_pool_calls.py,
tests/test_sampling_cost.py): a profile hook on every thread, installed before the runtime
starts its threads, counting only while the measured tasks run."""
import logging
import shutil
import sys
import tempfile
import threading

import hetflow


def run_counted(hook, counting: list, warm, run, **options):
    """Start a pool of 2 ranks (output off) whose threads all run ``hook`` (a
    ``sys.setprofile`` function), call ``warm()`` (imports, communicators, caches), then
    ``run()`` with ``counting[0]`` True and the caller's thread hooked too; return what
    ``run()`` returns. Log records at INFO and below are not made meanwhile, whatever level
    an earlier test left set (a fresh-clone CI run once counted 1,505 calls per task, most in
    logging)."""
    run_dir = tempfile.mkdtemp(prefix="hetflow-test-calls-")
    logging.disable(logging.INFO)
    threading.setprofile(hook)             # every thread the runtime starts from here on
    try:
        with hetflow.runtime("pool", max_ranks=2, output="off", run_dir=run_dir,
                             progress=False, **options):
            warm()
            sys.setprofile(hook)
            counting[0] = True
            try:
                return run()
            finally:
                counting[0] = False
                sys.setprofile(None)
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        logging.disable(logging.NOTSET)
        shutil.rmtree(run_dir, ignore_errors=True)
