"""Run by the pilot job's bootstrap, in the pilot's sandbox (see ``configs.slurm_resource_config``)."""
import sys

from hetflow.executors.radical.configs import raise_agent_cores

if len(sys.argv) != 3 or sys.argv[1] != "agent-cores":
    sys.exit("usage: python -m hetflow.executors.radical agent-cores N")
raise_agent_cores(int(sys.argv[2]))
