"""RADICAL-Pilot: one pilot per runtime session, MPI tasks run inside it.

Four objects, each readable alone:

- :mod:`.executor` — :class:`RadicalExecutor`, the kernel's hooks: which path a task
  takes (a RAPTOR function task on the runtime's one MPI worker, or an RP executable
  task for a task with a walltime), its completion, and the watchdog that recycles the
  worker under a task whose rank died or hung.
- :mod:`.pilot` — the pilot's life: RP's environment, session and pilot, the stall
  policy (a start that stalls inside RP is started once more), the master, the start-up
  probe, and the close.
- :mod:`.worker` — the RAPTOR worker: a small state machine (starting, up, replaced,
  broken) whose decisions are the pure :func:`~.worker.judge_start`.
- :mod:`.configs` — what RP is asked for: hetflow's resource configs, the descriptions of
  the pilot, master and workers (:class:`~.configs.Descriptions`), PSI/J's clean-up.

Where the pilot runs is the runtime's provider (:mod:`hetflow.executors.providers`).
Keeping RP from leaking processes, descriptors and environment is
:mod:`hetflow.executors._rp_hygiene`.
"""
from hetflow.executors._rp_hygiene import session_processes
from hetflow.executors.radical.configs import (LOCAL_RESOURCE, SLURM_RESOURCE, Descriptions,
                                               local_resource_config, slurm_resource_config)
from hetflow.executors.radical.executor import MODES, RadicalExecutor
from hetflow.executors.radical.pilot import probe_payload

__all__ = ["Descriptions", "LOCAL_RESOURCE", "MODES", "RadicalExecutor", "SLURM_RESOURCE",
           "local_resource_config", "probe_payload", "session_processes",
           "slurm_resource_config"]
