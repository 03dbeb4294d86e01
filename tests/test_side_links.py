"""What one rank sends over the TCP side channel while a connection is being made
(``launcher.faults.side_links``): a broadcast for a peer not connected to yet waits for it on a
thread of its own, and what comes meanwhile goes out after it, once each and in order. The
sends are recorded, not made: the race is between the thread that sends and the one that
adds, so both here let the other run at random points. The real
channel: ``tests/test_side_channel.py``."""

from __future__ import annotations

import random
import sys
import time

from launcher.faults import side_links


class _Recorded(side_links.Links):
    """Links whose sends are recorded, each letting the other thread run first now and
    then."""

    def __init__(self):
        super().__init__(addresses=None)
        self.sent: list[bytes] = []

    def send(self, peer: int, data: bytes) -> None:
        if random.random() < 0.5:
            time.sleep(0)
        self.sent.append(data)


def test_what_waits_for_a_connection_goes_out_once_and_in_order():
    links, rounds = _Recorded(), 4000
    random.seed(7)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between any two bytecodes, nearly
    try:
        for n in range(rounds):
            assert links.pass_on(7, b"%d" % n)
            while random.random() < 0.5:  # let the thread empty the queue and end, then add
                time.sleep(0)
        links.drain(30)
    finally:
        sys.setswitchinterval(switch)
    assert links.sent == [b"%d" % n for n in range(rounds)]
    assert links._pending == {}


def test_a_peer_out_of_reach_is_not_waited_for():
    links = _Recorded()
    links._gone.add(3)
    assert not links.pass_on(3, b"x")
    links.drain(0)
    assert links.sent == []
