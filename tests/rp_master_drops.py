"""hetflow's RAPTOR master that drops its first queue announcement (tests/rp_faults.py):
the loss executors/radical/raptor_master.py survives. RP loads this file by path in the pilot."""
from hetflow.executors.radical.raptor_master import Master as _Master


class Master(_Master):

    to_drop = 1

    def announce(self, send) -> None:
        if self.to_drop > 0:
            self.to_drop -= 1
            self._log.info("hetflow test: dropped a queue announcement")
            return
        send()
