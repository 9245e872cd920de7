"""A ``torch.distributed.Store`` served over the task's MPI communicator: no port, no file.

torch's rendezvous needs a key-value store that every rank reaches (Gloo publishes each
rank's listening address in it, NCCL its unique id). ``TCPStore`` is an open,
unauthenticated port: a stranger on the host could read those addresses or overwrite one
with its own and be connected to as a peer. Here rank 0 keeps the table and answers the
other ranks' requests, which reach it over a private duplicate of the task's communicator,
so only the task's own ranks can read or write it. Rank 0's answers come from a thread,
because rank 0 itself may be blocked inside torch (Gloo waiting for its peers to connect)
while they still need the table; that needs MPI initialised with ``MPI_THREAD_MULTIPLE``
(mpi4py's default).
"""
from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

#: Message tags on the store's own communicator.
_REQUEST, _REPLY = 1, 2
#: The serving thread and a waiting client poll (MPICH's blocking calls spin a core): from
#: the first sleep to the longest, in seconds. Requests come in bursts (the group's
#: construction); between them the thread must not take the training's CPU: at 2 ms it
#: woke 500 times a second and a 2-rank DDP step on 2 cores took 1.27x torchrun's.
_FIRST_SLEEP, _MAX_SLEEP, _IDLE_SLEEP = 5e-5, 2e-3, 5e-2
#: After this long without a request the serving thread sleeps :data:`_IDLE_SLEEP`.
_IDLE_AFTER_S = 1.0


class _Table:
    """Rank 0's keys and values, and its waiters."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def apply(self, op: str, args: tuple):
        """Run one operation that never waits; returns its answer."""
        data = self.data
        with self.changed:
            if op == "set":
                data[args[0]] = args[1]
            elif op == "get":
                return data.get(args[0])
            elif op == "add":
                value = int(data.get(args[0], b"0")) + args[1]
                data[args[0]] = str(value).encode()
                answer = value
            elif op == "append":
                data[args[0]] = data.get(args[0], b"") + args[1]
            elif op == "compare_set":
                key, expected, desired = args
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = desired
                    answer = desired
                else:
                    answer = b"" if current is None else current
            elif op == "check":
                return all(k in data for k in args[0])
            elif op == "delete_key":
                answer = data.pop(args[0], None) is not None
            elif op == "num_keys":
                return len(data)
            else:
                raise ValueError(f"unknown store operation {op!r}")
            self.changed.notify_all()
            return answer if op in ("add", "compare_set", "delete_key") else None


class MPIStore(dist.Store):
    """The store of one process group, on a communicator of its own (``comm``, freed by
    :meth:`close` on every rank). Collective to build and to close."""

    def __init__(self, comm, timeout: datetime.timedelta):
        super().__init__()
        self._comm = comm
        self._rank = comm.Get_rank()
        self._timeout = timeout.total_seconds()
        self._stop = threading.Event()
        self._table = _Table() if self._rank == 0 else None
        self._server = None
        if self._rank == 0 and comm.Get_size() > 1:
            from mpi4py import MPI

            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                from hetflow.errors import ConfigError

                raise ConfigError(
                    "hetflow.torch needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's "
                    f"default); this process has thread level {MPI.Query_thread()}")
            self._server = threading.Thread(target=self._serve, name="hetflow-torch-store",
                                            daemon=True)
            self._server.start()

    # -- rank 0's side -------------------------------------------------------------------
    def _serve(self) -> None:
        from mpi4py import MPI

        comm, table = self._comm, self._table
        waiting: list[tuple[int, list, float]] = []     # (source, keys, deadline)
        status = MPI.Status()
        delay = _FIRST_SLEEP
        last = time.monotonic()
        while not self._stop.is_set():
            if comm.iprobe(source=MPI.ANY_SOURCE, tag=_REQUEST, status=status):
                last = time.monotonic()
                source = status.Get_source()
                op, args = comm.recv(source=source, tag=_REQUEST)
                if op == "wait":
                    waiting.append((source, list(args[0]), time.monotonic() + args[1]))
                else:
                    try:
                        answer = (True, table.apply(op, args))
                    except Exception as exc:  # noqa: BLE001 - travels back to the caller
                        answer = (False, repr(exc))
                    comm.send(answer, dest=source, tag=_REPLY)
                delay = _FIRST_SLEEP
            else:
                self._stop.wait(delay)
                idle = not waiting and time.monotonic() - last > _IDLE_AFTER_S
                delay = _IDLE_SLEEP if idle else min(delay * 2, _MAX_SLEEP)
            if waiting:
                now = time.monotonic()
                still = []
                for source, keys, deadline in waiting:
                    if table.apply("check", (keys,)):
                        comm.send((True, None), dest=source, tag=_REPLY)
                    elif now > deadline:
                        comm.send((False, f"timed out waiting for keys {keys}"), dest=source,
                                  tag=_REPLY)
                    else:
                        still.append((source, keys, deadline))
                waiting = still

    # -- every rank's side ---------------------------------------------------------------
    def _call(self, op: str, *args):
        if self._table is not None:
            return self._table.apply(op, args)
        comm = self._comm
        comm.send((op, args), dest=0, tag=_REQUEST)
        request = comm.irecv(source=0, tag=_REPLY)
        delay = _FIRST_SLEEP
        while True:
            done, answer = request.test()
            if done:
                break
            time.sleep(delay)
            delay = min(delay * 2, _MAX_SLEEP)
        ok, value = answer
        if not ok:
            raise dist.DistStoreError(f"hetflow.torch store: {value}")
        return value

    def _wait_keys(self, keys: list, timeout: float) -> None:
        if self._table is None:
            self._call("wait", keys, timeout)
            return
        table = self._table
        with table.changed:
            if not table.changed.wait_for(lambda: all(k in table.data for k in keys), timeout):
                raise dist.DistStoreError(f"hetflow.torch store: timed out waiting for keys {keys}")

    def set(self, key, value):
        self._call("set", key, bytes(value))

    def get(self, key):
        self._wait_keys([key], self._timeout)
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, int(value))

    def append(self, key, value):
        self._call("append", key, bytes(value))

    def compare_set(self, key, expected_value, desired_value):
        return self._call("compare_set", key, bytes(expected_value), bytes(desired_value))

    def check(self, keys):
        return self._call("check", list(keys))

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def wait(self, keys, timeout=None):
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        self._wait_keys(list(keys), seconds)

    def set_timeout(self, timeout):
        self._timeout = timeout.total_seconds()

    def multi_get(self, keys):
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values):
        for key, value in zip(keys, values):
            self.set(key, value)

    def close(self, synchronise: bool = True) -> None:
        """Stop serving (rank 0) and free the communicator. ``synchronise``: wait first
        until every rank has closed its group (so none still needs the table); a rank
        leaving on an error does not wait for peers that may never come."""
        if synchronise and self._comm.Get_size() > 1:
            self._comm.Barrier()
        self._stop.set()
        if self._server is not None:
            self._server.join()
        self._comm.Free()
