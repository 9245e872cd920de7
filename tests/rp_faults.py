"""RADICAL-Pilot's failures, made to happen from the test side: a Descriptions the shared
radical runtime starts with (conftest.SharedRuntime), changing what RP is asked for.

- every RAPTOR master drops its first queue announcement (rp_master_drops.py), as a ZeroMQ
  PUB socket does under load;
- with ``stall_first_agent``: the first pilot's agent blocks in its start-up (it is asked to
  prepare an environment whose set-up sleeps), as RP's agent now and then never reports
  itself active;
- with ``hold_first_master``: the first master asks for a named environment nobody
  registers, so the agent's scheduler holds it, as a stuck scheduler does;
- ``next_workers``: faults for the next replacement workers, one each, in order:
  ``"hang"`` (its launch never starts the ranks' Python), ``"srun"`` (its launch prints an
  srun error and hangs, as Hydra does when srun cannot start its proxies), ``"init"`` (its
  ranks sleep right after MPI_Init, MPICH's segments still named: rp_worker_hangs.py).
"""
import os

from hetflow.executors.radical import Descriptions

HERE = os.path.dirname(os.path.abspath(__file__))
SRUN_ERROR = "srun: error: Unable to confirm allocation for job 0: (a test fault)"


class FaultyDescriptions(Descriptions):

    def __init__(self, stall_first_agent: bool = False, hold_first_master: bool = False):
        self.stall_first_agent = stall_first_agent
        self.hold_first_master = hold_first_master
        self.pilots = self.masters = 0
        self.next_workers: list = []

    def pilot(self, description: dict) -> dict:
        self.pilots += 1
        if self.stall_first_agent and self.pilots == 1:
            description["prepare_env"] = {"hetflow-stall": {"type": "shell",
                                                            "pre_exec": ["sleep 3600"]}}
        return description

    def master(self, description: dict) -> dict:
        self.masters += 1
        description["raptor_file"] = os.path.join(HERE, "rp_master_drops.py")
        if self.hold_first_master and self.masters == 1:
            description["named_env"] = "hetflow-never-registered"
        return description

    def worker(self, description: dict, replacement: bool) -> dict:
        if not replacement or not self.next_workers:
            return description
        fault = self.next_workers.pop(0)
        if fault == "hang":       # before the rank's Python starts (RP's pre_exec)
            description["pre_exec"] = description["pre_exec"] + ["sleep 86400"]
        elif fault == "srun":
            description["pre_exec"] = description["pre_exec"] + [
                f"echo '{SRUN_ERROR}' >&2", "sleep 86400"]
        elif fault == "init":
            description["raptor_file"] = os.path.join(HERE, "rp_worker_hangs.py")
        else:
            raise ValueError(f"unknown worker fault {fault!r}")
        return description
