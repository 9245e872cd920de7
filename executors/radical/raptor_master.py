"""hetflow's RAPTOR master: RP's own, except that it announces its task queue to the agent's
scheduler again and again until its first task arrives.

RP's master announces its queue once (``rp.raptor.Master.__init__``: connect, sleep a second,
publish ``register_raptor_queue`` on the control pubsub). A ZeroMQ PUB socket drops what it
sends before its subscriptions have reached it, and on a loaded node that can take more than
the second: the scheduler then holds every task for this master forever. That is the
symptom CI showed once: the runtime's start-up probe sat in ``AGENT_SCHEDULING`` (where the
scheduler keeps tasks for a master it has not heard of) until ``startup_timeout``. The
scheduler takes a repeated announcement as a new one (it replaces its putter for the queue
and relays the tasks it holds), so announcing again is safe; it stops with the first task,
which hetflow's probe sends at once.

RP loads this file by path in the pilot (the master task's ``raptor_file``, this file in
hetflow's install): it imports only ``hetflow.executors.radical.lowprio`` from hetflow (standard
library only). Every announcement goes through :meth:`Master.announce` (the tests' master
loses some there).

Its threads poll RP's queues; asked to (``$HETFLOW_YIELD_CPU``), it runs them at nice 19 within
its session, whose group the client lowers while a task runs (``executors/radical/priority.py``).
"""
import threading

import radical.pilot as rp
import radical.utils as ru

from hetflow.executors.radical import lowprio as _lowprio

#: Seconds between announcements, and how long to keep announcing without a task.
REPEAT_S, GIVE_UP_S = 2.0, 600.0
REGISTER = "register_raptor_queue"


class Master(rp.raptor.Master):

    def __init__(self, *args, **kwargs):
        self._served = threading.Event()
        if _lowprio.wanted():      # first: the threads RP starts below inherit it
            _lowprio.lower_threads()
        super().__init__(*args, **kwargs)

    def publish(self, pubsub, msg, topic=None):
        if isinstance(msg, dict) and msg.get("cmd") == REGISTER:
            self.announce(lambda: super(Master, self).publish(pubsub, msg, topic))
            threading.Thread(target=self._announce, args=(pubsub, msg), daemon=True,
                             name="hetflow-announce").start()
            return
        super().publish(pubsub, msg, topic)

    def announce(self, send) -> None:
        """Send one announcement of the queue (``send()`` puts it on the pubsub)."""
        send()

    def request_cb(self, tasks):
        self._served.set()
        return super().request_cb(tasks)

    def _announce(self, pubsub, msg):
        """Announce on a socket of this thread's own (ZeroMQ sockets are not thread-safe)
        every REPEAT_S until a task has arrived."""
        try:
            publisher = ru.zmq.Publisher(channel=pubsub,
                                         url=self._reg[f"bridges.{pubsub}"]["addr_pub"])
            for _ in range(int(GIVE_UP_S / REPEAT_S)):
                if self._served.wait(REPEAT_S):
                    return
                self._log.warning("hetflow: no task %.0f s after announcing the queue: "
                                  "announcing it again", REPEAT_S)
                self.announce(lambda: publisher.put(pubsub, msg))
            self._log.warning("hetflow: no task in %d s: stopped announcing", GIVE_UP_S)
        except Exception:  # noqa: BLE001 - RP's own single announcement still stands
            self._log.exception("hetflow: announcing the queue failed")
