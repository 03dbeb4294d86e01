"""The side channel over the rendezvous store (gloo, nccl): see ``launcher.faults.side_channel``.

Keys, all under ``ddp/side/``: ``beat/<rank>`` (a counter the rank raises each beat, read only
by its watchers), ``box/<rank>`` (the rank's mailbox: senders append framed messages, the rank
reads it with its beat), ``all`` (broadcasts, read by every rank with its beat), ``post/<rank>/
<name>`` (posts), ``node/<rank>`` and ``nodes`` (the nodes, gathered once by rank 0 into one
run-length list that every rank reads: O(nodes) bytes per rank, not O(ranks)).

Per rank and beat: one ``set`` and one ``multi_get`` of a handful of keys, whatever the size of
the job: the store's host serves 2 calls per rank per beat.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from launcher.faults import watch
from launcher.faults.c10d_log import quiet_c10d
from launcher.faults.side_channel import ChannelGone, Message, SideChannel
from launcher.placement.env import JobEnv

_ROOT = "ddp/side"
#: a store call that has not returned by then fails (a beat's, a send's)
CALL_S = 5.0
#: how long the ranks wait for each other at the start (the rendezvous is done by then)
START_S = 300.0
#: how long the store's host waits at the end for the others to let go of it
CLOSE_S = 5.0
#: what a rank that leaves the job writes as its beat (``leave``), and how long it tries
LEFT = b"left"
LEAVE_S = 1.0


def _frame(source: int, kind: str, payload: bytes) -> bytes:
    name = kind.encode()
    return b"%d %d %d\n" % (source, len(name), len(payload)) + name + payload


def _unframe(data: bytes, offset: int) -> tuple[list[Message], int]:
    """The whole messages in ``data`` from ``offset``, and where the next one starts."""
    messages = []
    while (end := data.find(b"\n", offset)) >= 0:
        source, kind_len, payload_len = (int(field) for field in data[offset:end].split())
        body = end + 1
        if body + kind_len + payload_len > len(data):
            break
        kind = data[body:body + kind_len].decode()
        messages.append(Message(source, kind, data[body + kind_len:body + kind_len + payload_len]))
        offset = body + kind_len + payload_len
    return messages, offset


def _runs(nodes: list[str]) -> str:
    runs: list[list] = []
    for node in nodes:
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    return json.dumps(runs)


def _expand(runs: bytes) -> list[str]:
    return [node for node, count in json.loads(runs) for _ in range(count)]


class StoreSideChannel(SideChannel):
    """The side channel through one TCPStore client of this rank's own."""

    host_rank = 0

    def __init__(self, env: JobEnv, store: dist.Store):
        start = timedelta(seconds=START_S)
        self._store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                    timeout=start)  # also the connection's: many connect at once
        self._lock = threading.Lock()
        rank = env.rank
        self._box = f"{_ROOT}/box/{rank}"
        self._all = f"{_ROOT}/all"
        self._store.compare_set(self._box, "", "")  # may hold a message already: kept
        self._store.set(f"{_ROOT}/beat/{rank}", "0")
        self._store.set(f"{_ROOT}/node/{rank}", env.node_name)
        if rank == 0:
            keys = [f"{_ROOT}/node/{other}" for other in range(env.world_size)]
            self._store.wait(keys, start)
            self._store.compare_set(self._all, "", "")
            self._store.set(f"{_ROOT}/nodes",
                            _runs([value.decode() for value in self._store.multi_get(keys)]))
        self._store.wait([f"{_ROOT}/nodes"], start)
        super().__init__(env, _expand(self._store.get(f"{_ROOT}/nodes")))
        self._store.set_timeout(timedelta(seconds=CALL_S))
        self.watch = watch.watch(self.nodes, rank)
        self._reads = [f"{_ROOT}/beat/{other}" for other in self.watch.watched]
        self._reads += [self._box, self._all]
        self._seen: list[bytes] = [b""] * len(self.watch.watched)
        self._offsets = [0, 0]
        self._count = 0
        self._left = False

    def _call(self, method, *args):
        """One store call under the lock; ChannelGone when it fails or another call has held
        the lock CALL_S."""
        if not self._lock.acquire(timeout=CALL_S):
            raise ChannelGone("the side channel's store does not answer")
        try:
            with quiet_c10d():
                return method(*args)
        except (RuntimeError, OSError) as exc:  # torch's DistError; older releases' plain ones
            raise ChannelGone(str(exc)) from exc
        finally:
            self._lock.release()

    def exchange(self) -> set[int]:
        """Beat; the watched ranks heard since the last call, and the messages that came
        delivered. ChannelGone when the store does not answer."""
        self._count += 1
        # decided under the store's lock: a beat never overwrites ``leave``'s mark
        self._call(lambda: self._store.set(f"{_ROOT}/beat/{self.rank}",
                                           LEFT if self._left else str(self._count)))
        values = self._call(self._store.multi_get, self._reads)
        beats = values[:-2]
        heard = {rank for rank, value, seen in zip(self.watch.watched, beats, self._seen,
                                                  strict=True) if value != seen or value == LEFT}
        self._seen = beats
        for index, data in enumerate(values[-2:]):
            messages, self._offsets[index] = _unframe(data, self._offsets[index])
            for message in messages:
                if message.source != self.rank:  # this rank's own broadcasts
                    self._deliver(message)
        return heard

    def leave(self, failed: bool = False) -> None:
        """This rank leaves the job (``failed``: after a failure): its watchers count it as
        heard from now on (it ended, it is not lost). Best effort, within about LEAVE_S: the
        store may be gone."""
        self._left = True
        if not self._lock.acquire(timeout=LEAVE_S):
            return
        try:
            with quiet_c10d():
                self._store.set_timeout(timedelta(seconds=LEAVE_S))
                self._store.set(f"{_ROOT}/beat/{self.rank}", LEFT)
        except (RuntimeError, OSError):
            pass
        finally:
            self._lock.release()

    def send(self, dest: int, kind: str, payload: bytes = b"") -> None:
        self._call(self._store.append, f"{_ROOT}/box/{dest}", _frame(self.rank, kind, payload))

    def broadcast(self, kind: str, payload: bytes = b"") -> None:
        self._call(self._store.append, self._all, _frame(self.rank, kind, payload))

    def post(self, name: str, value: bytes) -> None:
        self._call(self._store.set, f"{_ROOT}/post/{self.rank}/{name}", value)

    def read_many(self, ranks, name, timeout_s=None):
        keys = {rank: f"{_ROOT}/post/{rank}/{name}" for rank in ranks}
        there = [rank for rank, key in keys.items() if self._call(self._store.check, [key])]
        values = self._call(self._store.multi_get, [keys[rank] for rank in there]) \
            if there else []
        found = dict(zip(there, values, strict=True))
        return {rank: found.get(rank) for rank in ranks}

    def close(self) -> None:
        """Let go of the store; its host, rank 0, waits up to CLOSE_S for every rank to do
        so: a store gone under a client's call is an error there, logged with a C++ stack."""
        closed = f"{_ROOT}/closed"
        try:
            self._call(self._store.add, closed, 1)
            deadline = time.monotonic() + CLOSE_S
            while self.rank == 0 and time.monotonic() < deadline and \
                    self._call(self._store.add, closed, 0) < self.world_size:
                time.sleep(0.01)
        except ChannelGone:
            pass
