"""How the watchers' word that a rank is silent travels (``launcher.faults.heartbeat``): a
watcher's last word as it leaves outlasts the lapse of ordinary tells, and a tell that waits to
go out does not hold up the watcher's own beats. Fakes of the side channel (``_Beats``); the
16-rank jobs of ``tests/test_control_plane.py`` run it for real."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

from launcher.faults import heartbeat
from launcher.placement.env import detect_environment
from tests.test_peer_lost import _Beats


def _env(rank: int = 1, world_size: int = 3):
    return dataclasses.replace(detect_environment({}, hostname="box"), rank=rank,
                               world_size=world_size)


def _told(ranks: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(payload=ranks.encode())


def test_a_leaving_watchers_last_word_holds_past_the_lapse_until_heard_again(monkeypatch):
    """Rank 0 found rank 2 silent and exited after its own diagnosis: nobody renews that tell
    now. Rank 1, whose collective fails later, still names rank 2; an ordinary tell lapses."""
    monkeypatch.setattr(heartbeat, "TELL_S", 0.2)
    beats = _Beats({0, 2})
    beats.nodes = ["n0", "n1", "n2", "n3"]
    beat = heartbeat.Heartbeat(_env(world_size=4), beats)
    try:
        beat._hear_last(_told("[2]"))
        beat._hear_silent(_told("[3]"))
        assert beat.silent() == [2, 3]
        time.sleep(3 * heartbeat.TELL_S)
        assert beat.silent() == [2]
        beat._hear_back(_told("[2]"))  # its other watcher hears it again
        assert beat.silent() == []
    finally:
        beat.close()


def test_a_watcher_that_leaves_tells_the_ranks_it_found_silent_for_good(monkeypatch):
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.3)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    beats, told = _Beats({0}), []
    beats.broadcast = lambda kind, payload: told.append((kind, payload))
    beat = heartbeat.Heartbeat(_env(), beats)
    try:
        deadline = time.monotonic() + 10
        while (heartbeat.SILENT_KIND, b"[2]") not in told and time.monotonic() < deadline:
            time.sleep(0.01)
        beat.leave(failed=True)
    finally:
        beat.close()
    assert told[0] == (heartbeat.SILENT_KIND, b"[2]"), told
    assert told[-1] == (heartbeat.LAST_KIND, b"[2]"), told


def test_a_tell_waiting_to_go_out_does_not_hold_up_the_beats(monkeypatch):
    """A broadcast that waits (a connection to a lost node's rank, up to its connect timeout)
    while this rank's watchers keep hearing its beats: else they would find it silent too."""
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.2)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    beats, held, exchanges = _Beats({0}), threading.Event(), []
    beats.broadcast = lambda kind, payload: held.wait(10)
    beats.exchange = lambda: exchanges.append(time.monotonic())
    beat = heartbeat.Heartbeat(_env(), beats)
    try:
        deadline = time.monotonic() + 10
        while beat.silent() != [2] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(heartbeat.BEAT_S)  # its tell is out, waiting
        before = len(exchanges)
        time.sleep(20 * heartbeat.BEAT_S)
        assert len(exchanges) - before >= 10, exchanges
    finally:
        held.set()
        beat.close()


def test_a_rank_this_rank_hears_is_not_silent_whatever_it_was_told(monkeypatch):
    """A watcher that left said rank 2 was silent (wrongly: its own reading was starved).
    Rank 1, which watches rank 2 too and hears it, does not name it; a rank it does not
    watch, told the same way, it does."""
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    beats = _Beats({0, 2})
    beats.nodes = ["n0", "n1", "n2", "n3"]
    beat = heartbeat.Heartbeat(_env(world_size=4), beats)
    try:
        deadline = time.monotonic() + 10
        while 2 not in beats.heard_at() and time.monotonic() < deadline:
            time.sleep(0.01)
        beat._hear_last(_told("[2, 3]"))
        assert beat.silent() == [3]
    finally:
        beat.close()


def test_no_last_word_after_a_failure_over_a_transport_that_must_not_send(monkeypatch):
    """Over MPI a message to a dead peer's endpoint can crash the library: a rank that failed
    sends nothing more (``sends_after_failure``), its last word included."""
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.3)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    beats, told = _Beats({0}), []
    beats.sends_after_failure = False
    beats.broadcast = lambda kind, payload: told.append((kind, payload))
    beat = heartbeat.Heartbeat(_env(), beats)
    try:
        deadline = time.monotonic() + 10
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        beat.leave(failed=True)
        beat.leave(failed=True)  # once is enough: the second does nothing
    finally:
        beat.close()
    assert [kind for kind, _ in told] == [heartbeat.SILENT_KIND], told
