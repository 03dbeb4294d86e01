"""The side channel over TCP (``launcher.faults.side_socket``): simulated ranks as threads, each
with its own channel, as the ranks of a job open theirs against a real rendezvous store. What
the hang diagnosis and the fail-fast watchdog rely on: messages to one rank, broadcasts to all
others exactly once, posts read on demand, beats heard only by the watchers; and what the
transport itself promises: nothing through the store once open, a rank that ended is gone
without stopping the others, a port the ranks cannot reach is an error on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.faults import side_addresses, side_links, side_socket, side_wire
from launcher.faults.side_channel import ChannelGone, forwards, neighbours
from launcher.faults.side_socket import SocketSideChannel
from launcher.placement.env import detect_environment

WORLD = 6


def _env(rank: int, port: int, world: int = WORLD):
    return replace(detect_environment({}, hostname="sim"), rank=rank, world_size=world,
                   node_rank=rank // 2, hosts=tuple("abcdefgh"[:(world + 1) // 2]),
                   master_addr="127.0.0.1", master_port=port)


def _open(port: int, world: int = WORLD) -> list:
    """Every rank's channel, or the exception its opening raised."""
    opened: list = [None] * world

    def open_rank(rank: int) -> None:
        try:  # each rank over its own rendezvous client, as in a job
            store = dist.TCPStore("127.0.0.1", port, is_master=False)
            opened[rank] = SocketSideChannel(_env(rank, port, world), store)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            opened[rank] = exc

    threads = [threading.Thread(target=open_rank, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return opened


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def channels(server):
    opened = _open(server.port)
    yield opened
    for channel in opened:
        channel.close()


def _until(done, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _collect(channels, kind: str) -> list[list]:
    got = [[] for _ in channels]
    for rank, channel in enumerate(channels):
        channel.on(kind, got[rank].append)
    return got


def test_messages_broadcasts_and_posts_arrive(channels):
    got = _collect(channels, "t.hello")
    channels[1].send(4, "t.hello", b"to four")
    _until(lambda: got[4])
    channels[2].broadcast("t.hello", b"to all")
    _until(lambda: all(got[rank] for rank in (0, 1, 3, 5)) and len(got[4]) == 2)
    time.sleep(0.2)  # anything sent twice would be in by now
    assert [(m.source, m.payload) for m in got[4]] == [(1, b"to four"), (2, b"to all")]
    assert got[2] == []  # not to itself
    assert all([(m.source, m.payload) for m in got[rank]] == [(2, b"to all")]
               for rank in (0, 1, 3, 5))
    channels[3].post("t.state", b"in all_reduce #4")
    channels[3].post("t.empty", b"")
    assert channels[0].read(3, "t.state") == b"in all_reduce #4"
    assert channels[0].read_many([3, 5], "t.state") == {3: b"in all_reduce #4", 5: None}
    assert channels[0].read(3, "t.empty") == b""


def _heard_twice(channels, beating) -> list[set[int]]:
    """What each beating rank heard after two rounds of beats."""
    for _ in range(2):
        for rank in beating:
            channels[rank].exchange()
        time.sleep(0.3)
    return [set(channel.heard_at()) for channel in channels]


def test_beats_reach_the_watchers_only(channels):
    assert [channel.nodes for channel in channels] == [["a", "a", "b", "b", "c", "c"]] * WORLD
    beating = [0, 1, 2, 4, 5]
    heard = _heard_twice(channels, beating)
    for rank in beating:
        assert heard[rank] == set(channels[rank].watch.watched) - {3}, rank
    assert all(len(channel.watch.watched) == 2 for channel in channels)


def test_a_rank_that_left_stays_heard_and_one_that_stopped_does_not(channels):
    """Rank 3 leaves the job (it ends: a lost peer reported, a script done) and beats no more;
    rank 5 just stops beating (killed). Their watchers keep hearing rank 3, not rank 5: a
    survivor names the killed rank alone, not the ranks that ended after it."""
    channels[3].leave()
    heard = _heard_twice(channels, [0, 1, 2, 4])
    watchers = [rank for rank, channel in enumerate(channels) if 3 in channel.watch.watched]
    assert watchers == [1, 5]
    assert channels[1].heard_at()[3] == math.inf  # heard, whatever comes
    assert all(5 not in heard[rank] for rank in (0, 1, 2, 4)), heard


def test_a_beat_never_waits_behind_a_send_to_one_watcher(channels):
    """A message still going out to one watcher (its lock held, as a send into the buffer of
    a stopped rank holds it up to SEND_S) does not hold the beat to the other: the first
    beat is dropped, the second watcher hears this rank at once."""
    first, second = channels[0].watch.watchers
    with channels[0]._links.lock(first):
        beating = threading.Thread(target=channels[0].exchange, daemon=True)
        beating.start()
        beating.join(timeout=1.0)
        assert not beating.is_alive()
    _until(lambda: 0 in channels[second].heard_at())
    assert 0 in channels[second].heard_at()
    assert 0 not in channels[first].heard_at()


def test_nothing_goes_through_the_store_once_open(server):
    """The store's host (rank 0 in a job) serves the start only: with it gone, the ranks still
    beat, message, broadcast and read each other's posts."""
    opened = _open(server.port)
    try:
        del server
        gc.collect()
        got = _collect(opened, "t.after")
        opened[5].broadcast("t.after", b"x")
        _until(lambda: all(got[rank] for rank in range(5)))
        assert [len(box) for box in got] == [1, 1, 1, 1, 1, 0]
        heard = _heard_twice(opened, range(WORLD))
        assert all(heard[rank] == set(channel.watch.watched)
                   for rank, channel in enumerate(opened))
        opened[4].post("t.where", b"here")
        assert opened[1].read(4, "t.where") == b"here"  # rank 1 met rank 4 in the broadcast
    finally:
        for channel in opened:
            channel.close()


def test_ranks_not_met_are_looked_up_over_one_store_connection(server, monkeypatch):
    """A rank that reads the posts of ranks it has not met (a hang's diagnosis) looks their
    addresses up in the store over one client of its own, not one per rank: at N ranks each
    looking up a few, rank 0's store would otherwise take N times a few connections."""
    opened = _open(server.port, world=16)
    try:
        for rank, channel in enumerate(opened):
            channel.post("t.where", b"%d" % rank)
        unmet = [rank for rank in range(1, 16) if rank not in opened[0]._addresses]
        assert len(unmet) >= 5
        made = []
        real = dist.TCPStore
        monkeypatch.setattr(side_addresses.dist, "TCPStore",
                            lambda *args, **kwargs: made.append(args) or real(*args, **kwargs))
        assert opened[0].read_many(unmet, "t.where") == {rank: b"%d" % rank for rank in unmet}
        assert len(made) == 1
    finally:
        for channel in opened:
            channel.close()


def test_a_failed_look_up_drops_its_client_and_none_is_made_once_closed(monkeypatch):
    made = []

    class Flaky:  # the first client's connection resets; the next one answers
        def __init__(self, *args, **kwargs):
            made.append(self)

        def get(self, key):
            if len(made) == 1:
                raise RuntimeError("Connection reset by peer")
            return b"10.0.0.9:4000"

    monkeypatch.setattr(side_addresses.dist, "TCPStore", Flaky)
    book = side_addresses.Addresses(_env(0, 1))
    with pytest.raises(ChannelGone, match="reset"):
        book[3]
    assert book[3] == "10.0.0.9:4000" and len(made) == 2
    book.close()
    with pytest.raises(ChannelGone, match="closed"):
        book[4]
    assert len(made) == 2


def test_a_rank_that_ended_is_gone_and_the_others_go_on(channels):
    channels[2].close()
    with pytest.raises(ChannelGone):
        for _ in range(3):  # the first send may still be taken by the kernel
            channels[0].send(2, "t.x")
            time.sleep(0.05)
    for channel in channels:
        channel.exchange()  # its watched ranks' beats to it fail quietly
    got = _collect(channels, "t.still")
    channels[0].broadcast("t.still")
    _until(lambda: all(got[rank] for rank in (1, 3, 4, 5)))
    assert [len(box) for box in got] == [0, 1, 0, 1, 1, 1]


def test_a_reader_out_of_descriptors_goes_on(channels):
    """accept() failing (EMFILE: a rank of a job of thousands past its open-files limit, peers
    connecting at once) must not end the rank's reader: once descriptors are free again, its
    messages arrive."""
    got = _collect(channels, "t.hello")
    host, port = channels[1].address.rsplit(":", 1)
    connect = (f"import socket, sys; sys.stdin.read(1); s = [socket.create_connection("
               f"({host!r}, {port})) for _ in range(3)]")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    with subprocess.Popen([sys.executable, "-c", connect], stdin=subprocess.PIPE) as strangers:
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor
        try:
            strangers.stdin.write(b"go")
            strangers.stdin.flush()
            strangers.wait(timeout=30)
            time.sleep(0.3)  # the reader's accepts fail meanwhile
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    channels[2].send(1, "t.hello", b"still here")
    _until(lambda: got[1])
    assert [m.payload for m in got[1]] == [b"still here"]


def test_bytes_that_are_not_frames_are_dropped_with_their_connection(channels):
    host, port = channels[1].address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as stranger:
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        time.sleep(0.2)
    watcher = channels[1].watch.watched[0]
    channels[watcher].exchange()
    _until(lambda: watcher in channels[1].heard_at())


def test_a_watcher_out_of_reach_is_an_error_on_every_rank(server, monkeypatch):
    """Rank 2 publishes an address nobody can reach (TEST-NET-1): its watched ranks cannot
    connect, and every rank says so at the start, naming them, instead of finding everyone
    silent later."""
    real = side_socket.reachable_at
    monkeypatch.setattr(side_links, "CONNECT_S", 0.5)
    monkeypatch.setattr(side_socket, "reachable_at",
                        lambda env: "192.0.2.1" if env.rank == 2 else real(env))
    opened = _open(server.port)
    assert all(isinstance(result, LaunchError) for result in opened), opened
    message = opened[0].message
    assert "could not connect the ranks" in message and "rank 2 on b at 192.0.2.1:" in message
    assert "firewall" in opened[0].hint


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 100, 1000])
def test_a_broadcast_only_passes_through_a_ranks_log_n_neighbours(size):
    """The addresses a rank reads at the start cover every broadcast it may pass on."""
    for rank in range(size):
        near = set(neighbours(rank, size))
        assert len(near) <= 2 * max(1, (size - 1).bit_length())
        for origin in range(0, size, max(1, size // 13)):
            assert set(forwards(rank, origin, size)) <= near | {origin}, (rank, origin)


def test_frames_come_back_whole_and_strangers_bytes_do_not():
    item = (7, 3, "ddp.notice", b"line one\nline two \x00")
    data = side_wire.frame(2, side_wire.BEAT, b"") + side_wire.encode_item("10.0.0.5:4711", item)
    frames, used = side_wire.unframe(data + b"12 1")  # the start of the next frame
    assert used == len(data) and frames[0] == (2, "b", b"")
    assert side_wire.decode_item(frames[1]) == ("10.0.0.5:4711", item)
    assert side_wire.decode_item(side_wire.unframe(side_wire.encode_item(
        "", (1, None, "t", b"")))[0][0]) == ("", (1, None, "t", b""))
    for stranger in (b"GET / HTTP/1.0\r\n", b"1 1 %d\n" % (side_wire.MAX_FRAME + 1)):
        with pytest.raises(ValueError):
            side_wire.unframe(stranger)


@pytest.mark.parametrize("origin", [0, 1], ids=["passed-on", "its-own"])
def test_a_lost_nodes_rank_does_not_hold_up_a_broadcast(channels, monkeypatch, origin):
    """Rank 3's node is gone mid-job (powered off: connections to it time out, nothing refuses
    them). A broadcast that a rank passes on (from rank 0: ranks 1 and 5 pass it to rank 3)
    or sends itself (rank 1's) to rank 3 does not wait for that connection before the others
    take it, that rank included."""
    monkeypatch.setattr(side_links, "CONNECT_S", 5.0)
    hole = socket.create_server(("127.0.0.1", 0), backlog=0)  # a full backlog drops SYNs
    filler = [socket.socket() for _ in range(2)]
    for sock in filler:
        sock.settimeout(0.3)
        with contextlib.suppress(OSError):
            sock.connect(hole.getsockname())
    try:
        for channel in channels:
            if channel is not channels[3]:
                channel._addresses._known[3] = f"127.0.0.1:{hole.getsockname()[1]}"
                with channel._links.lock(3):
                    stale = channel._links._out.pop(3, None)
                if stale is not None:
                    stale.close()
        got = _collect(channels, "t.lost")
        others = [rank for rank in range(WORLD) if rank not in (origin, 3)]
        sent_at = time.monotonic()
        channels[origin].broadcast("t.lost")
        _until(lambda: all(got[rank] for rank in others), 10.0)
        assert time.monotonic() - sent_at < 2.0, [len(box) for box in got]
    finally:
        for sock in [hole, *filler]:
            sock.close()


def test_a_rank_that_ends_first_lets_its_broadcast_go_out(channels, monkeypatch):
    """A failing rank broadcasts its notice and ends: what still waits for a connection to a
    child (made on a thread of its own; slow here) goes out first (``drain``), else that
    child's subtree would miss the notice."""
    connect = socket.create_connection

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return connect(*args, **kwargs)

    monkeypatch.setattr(side_links.socket, "create_connection", slow)
    got = _collect(channels, "t.last")
    unmet = [peer for peer in forwards(1, 1, WORLD) if peer not in channels[1]._links._out]
    assert unmet, "every child of rank 1 connected already: nothing to wait for"
    channels[1].broadcast("t.last")
    channels[1].drain(5.0)
    channels[1].close()
    _until(lambda: all(got[rank] for rank in range(WORLD) if rank != 1))
    assert [len(box) for box in got] == [1, 0, 1, 1, 1, 1]
