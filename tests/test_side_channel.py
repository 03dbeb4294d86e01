"""The side channel over a real TCPStore (``launcher.faults.side_store``): simulated ranks as
threads, each with its own channel, as the ranks of a job open theirs. What the hang
diagnosis and the fail-fast watchdog rely on: messages to one rank, broadcasts to all others
exactly once, posts read on demand, beats heard only by the watchers.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import replace

import pytest
import torch.distributed as dist

from launcher.faults.side_channel import ChannelGone
from launcher.faults.side_store import StoreSideChannel
from launcher.placement.env import detect_environment

WORLD = 6


@pytest.fixture
def channels():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    opened: list[StoreSideChannel | None] = [None] * WORLD

    def open_rank(rank: int) -> None:
        env = replace(detect_environment({}, hostname="sim"), rank=rank, world_size=WORLD,
                      node_rank=rank // 2, hosts=("a", "b", "c"), master_addr="127.0.0.1",
                      master_port=server.port)
        opened[rank] = StoreSideChannel(env, server)

    threads = [threading.Thread(target=open_rank, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    yield opened
    for channel in reversed(opened):  # rank 0 last: it waits for the others to let go
        channel.close()


def _collect(channels, kind: str) -> list[list]:
    got = [[] for _ in channels]
    for rank, channel in enumerate(channels):
        channel.on(kind, got[rank].append)
    return got


def test_messages_broadcasts_and_posts_arrive(channels):
    got = _collect(channels, "t.hello")
    channels[1].send(4, "t.hello", b"to four")
    channels[2].broadcast("t.hello", b"to all")
    for channel in channels:
        channel.exchange()
    assert [(m.source, m.payload) for m in got[4]] == [(1, b"to four"), (2, b"to all")]
    assert got[2] == []  # not to itself
    assert all([(m.source, m.payload) for m in got[rank]] == [(2, b"to all")]
               for rank in (0, 1, 3, 5))
    for channel in channels:  # read again: nothing twice
        channel.exchange()
    assert len(got[4]) == 2
    channels[3].post("t.state", b"in all_reduce #4")
    assert channels[0].read(3, "t.state") == b"in all_reduce #4"
    assert channels[0].read_many([3, 5], "t.state") == {3: b"in all_reduce #4", 5: None}


def test_beats_reach_the_watchers_only(channels):
    assert [channel.nodes for channel in channels] == [["a", "a", "b", "b", "c", "c"]] * WORLD
    for channel in channels:
        channel.exchange()  # the first read sees every counter as new
    for rank, channel in enumerate(channels):
        if rank != 3:
            channel.exchange()
    for rank, channel in enumerate(channels):
        if rank != 3:
            assert channel.exchange() == set(channel.watch.watched) - {3}, rank
        assert len(channel.watch.watched) == 2


def test_a_rank_that_left_stays_heard_and_one_that_stopped_does_not(channels):
    """Rank 3 leaves the job (it ends: a lost peer reported, a script done) and beats no more;
    rank 5 just stops beating (killed). Their watchers keep hearing rank 3, not rank 5: a
    survivor names the killed rank alone, not the ranks that ended after it."""
    for channel in channels:
        channel.exchange()
    channels[3].leave()
    channels[3].exchange()  # a beat under way as it leaves does not undo it
    for _ in range(2):
        for rank, channel in enumerate(channels):
            if rank not in (3, 5):
                channel.exchange()
    watchers = [rank for rank, channel in enumerate(channels) if 3 in channel.watch.watched]
    assert watchers and all(3 in channels[rank].exchange() for rank in watchers if rank != 5)
    assert all(5 not in channel.exchange() for rank, channel in enumerate(channels)
               if rank not in (3, 5))


def test_a_store_gone_is_channel_gone_and_a_handlers_bug_is_not():
    """Callers catch ChannelGone by name (the heartbeat, the hang watch, fail-fast): the store's
    host ending must raise it from every call, and nothing else may."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = replace(detect_environment({}, hostname="sim"), rank=1, world_size=2, node_rank=1,
                  hosts=("a", "b"), master_addr="127.0.0.1", master_port=server.port)
    opened = []
    other = threading.Thread(target=lambda: opened.append(StoreSideChannel(env, None)))
    other.start()  # rank 1 waits for the nodes that rank 0 gathers
    channel = StoreSideChannel(replace(env, rank=0, node_rank=0), None)
    other.join()
    channel.on("t.bug", lambda message: 1 / 0)
    opened[0].send(0, "t.bug")
    with pytest.raises(ZeroDivisionError):
        channel.exchange()
    del server  # its host ends
    gc.collect()
    for call in (channel.exchange, lambda: channel.send(1, "t.x"),
                 lambda: channel.broadcast("t.x"), lambda: channel.post("t.x", b"")):
        with pytest.raises(ChannelGone):
            call()
    channel.close()  # says nothing: there is nobody left to wait for
