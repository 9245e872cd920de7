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
- :mod:`.configs` — what RP is asked for: the provider's placement translated into
  hetflow's resource configs and the pilot's fields, the descriptions of the pilot,
  master and workers (:class:`~.configs.Descriptions`), PSI/J's clean-up.

Where the pilot runs is the runtime's provider (:mod:`hetflow.executors.providers`), whose
runtime-neutral ``Placement`` :mod:`.configs` translates.
Keeping RP from leaking processes, descriptors and environment is
:mod:`.hygiene`; what RP loads in the pilot is :mod:`.raptor_master` and
:mod:`.raptor_worker` (by path), and the ranks' side :mod:`.rank`.
"""
__all__ = ["Descriptions", "LOCAL_RESOURCE", "MODES", "RadicalExecutor", "SLURM_RESOURCE",
           "local_resource_config", "probe_payload", "session_processes",
           "slurm_resource_config"]

#: Where each public name lives. They load on first use: a rank importing :mod:`.rank`
#: does not pull in the executor kernel (and Parsl behind it).
_HOMES = {"session_processes": "hygiene", "LOCAL_RESOURCE": "configs",
          "SLURM_RESOURCE": "configs", "Descriptions": "configs",
          "local_resource_config": "configs", "slurm_resource_config": "configs",
          "MODES": "executor", "RadicalExecutor": "executor", "probe_payload": "pilot"}


def __getattr__(name):
    if name in _HOMES:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
