"""A rank that dies mid-training: the survivors exit within a minute with status 3, naming it.

Plain processes with torchrun's variables, not mpiexec: Hydra and torchrun kill every rank as
soon as one dies, which hides what the survivors would do on a real multi-node job (ssh-started
ranks, or a node whose network is cut). The compose-cluster tests repeat this across
containers.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from launcher.core.errors import EXIT_PEER_LOST, PeerLost
from launcher.faults import heartbeat
from launcher.faults.watch import Watch
from launcher.placement.env import detect_environment
from launcher.placement.ports import free_port
from tests.fixtures.mpi import REPO_ROOT, clean_environ

WORLD = 3


@pytest.mark.parametrize(("hosts", "expected"), [
    (("n0", "n1"), "n1"),  # two slurmd on one host: the node list tells them apart
    ((), "box"),  # no node list (mpiexec): the host name
])
def test_node_name_is_the_node_lists_entry_else_the_hostname(hosts, expected):
    env = dataclasses.replace(detect_environment({}, hostname="box"), node_rank=1, hosts=hosts)
    assert env.node_name == expected


class _Beats:
    """A side channel of rank 1 watching ranks 0 and 2, with beats from the ranks in ``alive``
    only; ``nodes`` as a transport gathers them."""

    nodes = ["n0", "n1", "n2"]
    watch = Watch(watchers=(0, 2), watched=(0, 2))

    def __init__(self, alive: set[int]):
        self.alive = alive
        self.at: dict[int, float] = {}

    def on(self, kind, handler) -> None:
        pass

    def broadcast(self, kind, payload) -> None:
        pass

    def exchange(self) -> None:
        self.at.update(dict.fromkeys(self.alive, time.monotonic()))

    def heard_at(self) -> dict[int, float]:
        return dict(self.at)

    def leave(self, failed: bool = False) -> None:
        pass


def test_heartbeat_names_the_silent_ranks_nodes(monkeypatch):
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.5)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    env = dataclasses.replace(detect_environment({}, hostname="box"), rank=1, world_size=3)
    beat = heartbeat.Heartbeat(env, _Beats({0, 1}))
    try:
        assert beat.silent() == []  # not silent for long yet
        lost = beat.lost("the all_reduce failed", beat.settle())
    finally:
        beat.close()
    assert isinstance(lost, PeerLost)
    assert lost.nodes == ("n2",)
    assert "no heartbeat for 0 s from rank 2 (n2)" in lost.message, lost.message


def test_a_survivor_names_every_rank_of_a_lost_node_not_the_first_found(monkeypatch):
    """Rank 1 finds its watched rank 2 silent; rank 3, on the same lost node, is told by its
    own watcher two beats later: the survivor waits for that word and names both."""
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.5)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    env = dataclasses.replace(detect_environment({}, hostname="box"), rank=1, world_size=4)
    beats = _Beats({0, 1})
    beats.nodes = ["n0", "n1", "n2", "n2"]
    beat = heartbeat.Heartbeat(env, beats)

    def told_later() -> None:
        while beat.silent() != [2]:
            time.sleep(0.01)
        time.sleep(2 * heartbeat.BEAT_S)
        beat._hear_silent(types.SimpleNamespace(payload=b"[3]"))

    teller = threading.Thread(target=told_later, daemon=True)
    teller.start()
    try:
        silent = beat.settle()
    finally:
        teller.join(timeout=5)
        beat.close()
    assert silent == [2, 3]


def test_ranks_that_beat_are_not_silent_while_this_ranks_own_beats_wait(monkeypatch):
    """The watched ranks' beats are stamped as they arrive, not when this rank's beating
    thread next runs: that thread held up (its own beat waiting to go out) for longer than
    SILENT_S does not make the ranks it hears look silent."""
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.3)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    env = dataclasses.replace(detect_environment({}, hostname="box"), rank=1, world_size=3)
    beats, held, arriving = _Beats({0, 2}), threading.Event(), threading.Event()

    def arrive() -> None:  # the transport's thread: beats from 0 and 2 keep coming
        while not arriving.wait(0.05):
            beats.at.update(dict.fromkeys(beats.alive, time.monotonic()))

    beats.exchange = lambda: held.wait(10)
    transport = threading.Thread(target=arrive, daemon=True)
    transport.start()
    beat = heartbeat.Heartbeat(env, beats)
    try:
        time.sleep(3 * heartbeat.SILENT_S)
        assert beat.silent() == []
    finally:
        held.set()
        arriving.set()
        beat.close()


def test_overdue_waits_on_peers_that_beat_and_names_silent_ones(monkeypatch):
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.5)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    env = dataclasses.replace(detect_environment({}, hostname="box"), rank=1, world_size=3)
    beats = _Beats({0, 1, 2})
    beat = heartbeat.Heartbeat(env, beats)
    heartbeat.watch_waits(beat)
    try:
        heartbeat.overdue("all_reduce", 2.0, 1.0, rank=1)  # everyone beats: go on waiting
        with pytest.raises(PeerLost, match="although every rank still beats"):
            heartbeat.overdue("all_reduce", 11.0, 1.0, rank=1)  # past BUSY_LIMIT
        beats.alive = {0, 1}
        time.sleep(0.8)
        with pytest.raises(PeerLost, match=r"no heartbeat .* from rank 2 \(n2\)"):
            heartbeat.overdue("all_reduce", 2.0, 1.0, rank=1)
    finally:
        heartbeat.watch_waits(None)
        beat.close()
    assert not heartbeat.watching()
    with pytest.raises(PeerLost, match="did not complete"):  # no heartbeat: no waiting on
        heartbeat.overdue("all_reduce", 2.0, 1.0, rank=1)


def _start_ranks(tmp_path) -> list[subprocess.Popen]:
    port = free_port()
    ranks = []
    for rank in range(WORLD):
        env = clean_environ({
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        })
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "launcher.train", "--epochs", "200", "--global-batch-size",
             "48", "--run-dir", str(tmp_path), "--timeout-s", "30", "--backend", "gloo",
             "--threads", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
        ))
    return ranks


def _wait_until_training(rank0: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = rank0.stdout.readline()
        if line.startswith("step "):
            return
        if not line and rank0.poll() is not None:
            pytest.fail(f"rank 0 ended before training: {rank0.stderr.read()}")
    pytest.fail("no training step within the time limit")


@pytest.mark.parametrize("victim", [2, 0], ids=["worker-dies", "rank0-dies"])
def test_survivors_exit_naming_the_lost_rank(tmp_path, victim):
    ranks = _start_ranks(tmp_path)
    try:
        _wait_until_training(ranks[0])
        ranks[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for rank, process in enumerate(ranks):
            if rank == victim:
                continue
            _, stderr = process.communicate(timeout=60)
            assert process.returncode == EXIT_PEER_LOST, stderr
            assert time.monotonic() - killed_at < 60
            assert f"[rank {rank}] error: rank {rank} on " in stderr
            assert "Traceback" not in stderr
            assert f"no heartbeat for 5 s from rank {victim} (" in stderr, stderr
            assert "HINT:" in stderr and "--resume auto" in stderr
        # for the batch script (launcher.faults.exit_status): one line, written by the survivors
        written = (tmp_path / "exit-status").read_text()
        assert written.startswith(f"{EXIT_PEER_LOST} ") and written.count("\n") == 1, written
        assert f"rank {victim}" in written, written
    finally:
        for process in ranks:
            process.kill()
            process.communicate()
