"""The three designs of the heartbeats that ``benchmarks.control_plane`` puts side by side:
one class per design, each a simulated rank with ``exchange()`` (one beat) and the counts of
the store calls and keys a beat costs."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from launcher.faults.side_socket import SocketSideChannel
from launcher.placement.env import detect_environment

RANKS_PER_NODE = 8
NOTICE = "bench.notice"


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))


class _StoreBeats:
    """A rank that beats through the store: each beat one set of its counter and one
    multi_get of the keys it reads, on a client of its own."""

    store_calls = 2

    def __init__(self, port: int, key: str, keys: list[str]):
        self._client = _client(port)
        self._key, self._keys = key, keys
        self._count = 0

    def exchange(self) -> None:
        self._count += 1
        self._client.set(self._key, str(self._count))
        self._client.multi_get(self._keys)


class AllToAll(_StoreBeats):
    """Every rank sets its counter and reads every rank's, each beat; the fail-fast watcher
    holds a third connection."""

    def __init__(self, rank: int, size: int, port: int):
        super().__init__(port, f"hb/{rank}", [f"hb/{other}" for other in range(size)])
        self._client.set(self._key, "0")
        self._client.wait(self._keys, timedelta(seconds=300))
        self.store_keys = size + 1
        self.watcher = _client(port)
        self.rendezvous = _client(port)


class StoreWatch(_StoreBeats):
    """The two watched ranks' counters, the mailbox and the broadcast key, each beat, on one
    client beside the rendezvous'."""

    def __init__(self, rank: int, size: int, port: int):
        super().__init__(port, f"hb/{rank}", [f"hb/{(rank - 1) % size}",
                                              f"hb/{(rank - 2) % size}", f"box/{rank}", "all"])
        self._client.multi_set([self._key, f"box/{rank}", "all"], ["0", "", ""])
        self.store_keys = 1 + len(self._keys)
        self.rendezvous = _client(port)


class PeerToPeer:
    """The side channel as a rank opens it (``launcher.faults.side_socket``)."""

    store_calls = store_keys = 0

    def __init__(self, rank: int, size: int, port: int):
        hosts = tuple(f"node{n}" for n in range(-(-size // RANKS_PER_NODE)))
        env = replace(detect_environment({}, hostname="sim"), rank=rank, world_size=size,
                      node_rank=rank // RANKS_PER_NODE, hosts=hosts, master_addr="127.0.0.1",
                      master_port=port)
        self.rendezvous = _client(port)
        self.channel = SocketSideChannel(env, self.rendezvous)
        self.notice_at: float | None = None
        self.channel.on(NOTICE, self._noticed)

    def _noticed(self, _message) -> None:
        self.notice_at = time.monotonic()

    def exchange(self) -> None:
        self.channel.exchange()

    def threads_cpu(self) -> float:
        """CPU seconds of the channel's own threads (reading, handling)."""
        return sum(thread_cpu(thread.native_id) for thread in self.channel.threads)


DESIGNS = {"all-to-all": AllToAll, "store watch": StoreWatch, "peer to peer": PeerToPeer}


def thread_cpu(native_id: int) -> float:
    path = Path(f"/proc/self/task/{native_id}/schedstat")
    return int(path.read_text().split()[0]) / 1e9 if path.exists() else 0.0
