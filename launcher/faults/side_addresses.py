"""Where each rank's TCP side channel (``launcher.faults.side_socket``) listens, through the
rendezvous store: every rank's address and node published and gathered at the start (O(N) at
rank 0 once, O(1) calls per rank), the few a rank sends to read at once, more learnt from the
messages that arrive, and, rarely, one looked up mid-job over the one client of the store a
rank keeps for that.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

from launcher.faults.c10d_log import quiet_c10d
from launcher.faults.side_channel import ChannelGone
from launcher.faults.side_wire import expand, runs
from launcher.placement.env import JobEnv

_ROOT = "ddp/side"
#: how long the ranks wait for each other at the start (the rendezvous is done by then)
START_S = 300.0
#: a look-up mid-job not answered by then fails: rank 0's node is gone
LOOKUP_S = 10.0
#: how many of the ranks that could not reach a watcher the start-up error names
NAMED = 3


class Addresses:
    """This rank's view of where the others listen. The collective steps take the rendezvous
    store and keep no reference to it: once the channel is open, nothing goes through it."""

    def __init__(self, env: JobEnv):
        self._env = env
        self._known: dict[int, str] = {}
        self._client: dist.Store | None = None
        self._client_lock = threading.Lock()
        self._closed = False

    def publish(self, store: dist.Store, address: str) -> list[str]:
        """Collective: this rank's address and node into ``store``; every rank's node."""
        rank = self._env.rank
        _call(store.multi_set, [f"{_ROOT}/addr/{rank}", f"{_ROOT}/node/{rank}"],
              [address, self._env.node_name])
        return expand(self._gathered(store, "node", "nodes", runs))

    def fetch(self, store: dist.Store, peers: Iterable[int]) -> None:
        """Read ``peers``' addresses now, in one call."""
        peers = list(peers)
        values = _call(store.multi_get, [f"{_ROOT}/addr/{peer}" for peer in peers])
        self._known.update(zip(peers, (value.decode() for value in values), strict=True))

    def unreached(self, store: dist.Store, problem: str) -> list[str]:
        """Collective: what kept this rank from its watchers ("" for nothing) in; the first
        ``NAMED`` of every rank's problems out."""
        _call(store.set, f"{_ROOT}/reach/{self._env.rank}", problem)
        return json.loads(self._gathered(store, "reach", "reached", _named_problems))

    def learn(self, peer: int, address: str) -> None:
        """``peer``'s address, as a message that passed through it carried."""
        self._known.setdefault(peer, address)

    def known(self, peer: int) -> str:
        """``peer``'s address if this rank has it, else "" (nothing is looked up)."""
        return self._known.get(peer, "")

    def __contains__(self, peer: int) -> bool:
        return peer in self._known

    def __getitem__(self, peer: int) -> str:
        """``peer``'s address: known, else read from the store (which must still be there)."""
        if peer not in self._known:
            client = self._lookup_client()
            try:
                self._known[peer] = _call(client.get, f"{_ROOT}/addr/{peer}").decode()
            except ChannelGone:
                with self._client_lock:  # the next look-up tries a client of its own
                    if self._client is client:
                        self._client = None
                raise
        return self._known[peer]

    def close(self) -> None:
        with self._client_lock:
            self._client, self._closed = None, True

    def _lookup_client(self) -> dist.Store:
        """A client of the rendezvous store of its own (the rendezvous' may be held by NCCL by
        then): one per rank, made at the first look-up, so that a hang that has every rank
        look up a few peers opens N connections to rank 0, not N times a few. It reads this
        attempt's keys (``JobEnv.store_prefix``), not those a torchrun attempt before left."""
        with self._client_lock:
            if self._closed:
                raise ChannelGone("the side channel is closed")
            if self._client is None:
                env = self._env
                try:
                    with quiet_c10d():
                        self._client = dist.TCPStore(env.master_addr, env.master_port,
                                                     is_master=False,
                                                     timeout=timedelta(seconds=LOOKUP_S))
                    if env.store_prefix:
                        self._client = dist.PrefixStore(env.store_prefix, self._client)
                except (RuntimeError, OSError) as exc:
                    raise ChannelGone(str(exc)) from exc
            return self._client

    def _gathered(self, store: dist.Store, each: str, into: str, combine) -> bytes:
        """Rank 0 reads every rank's ``each`` key and writes ``combine`` of them under
        ``into``, which every rank reads: O(N) at rank 0 once, O(1) calls per rank."""
        if self._env.rank == 0:
            keys = [f"{_ROOT}/{each}/{other}" for other in range(self._env.world_size)]
            _call(store.wait, keys, timedelta(seconds=START_S))
            values = [value.decode() for value in _call(store.multi_get, keys)]
            _call(store.set, f"{_ROOT}/{into}", combine(values))
        _call(store.wait, [f"{_ROOT}/{into}"], timedelta(seconds=START_S))
        return _call(store.get, f"{_ROOT}/{into}")


def _call(method, *args):
    try:
        with quiet_c10d():
            return method(*args)
    except (RuntimeError, OSError) as exc:  # torch's DistError; older releases' plain ones
        raise ChannelGone(str(exc)) from exc


def _named_problems(problems: list[str]) -> str:
    found = [problem for problem in problems if problem]
    named = found[:NAMED]
    if len(found) > NAMED:
        named.append(f"and {len(found) - NAMED} more ranks")
    return json.dumps(named)
