"""A rank that dies mid-training: the survivors exit within a minute with status 3, naming it.

Plain processes with torchrun's variables, not mpiexec: Hydra and torchrun kill every rank as
soon as one dies, which hides what the survivors would do on a real multi-node job (ssh-started
ranks, or a node whose network is cut). The compose-cluster tests repeat this across
containers. Also what is not a lost peer: a rank that stopped and resumed, a local error that
says "timed out".
"""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch.distributed as dist

from launcher.core.errors import EXIT_PEER_LOST, EXIT_RANK_FAILED, PeerLost
from launcher.faults import heartbeat, peer_lost
from launcher.faults.watch import Watch
from launcher.placement.env import detect_environment
from launcher.placement.ports import free_port
from tests.fixtures.by_hand import run_by_hand, write_script
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
    sends_after_failure = True

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

    def drain(self, timeout_s: float) -> None:
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


class _Oversleeps:
    """A heartbeat's stop event whose next wait lasts ``freeze_s``: its process frozen."""

    def __init__(self, freeze_s: float):
        self.freeze_s, self.stopped = freeze_s, threading.Event()

    def wait(self, timeout: float) -> bool:
        freeze_s, self.freeze_s = self.freeze_s, 0.0
        return self.stopped.wait(max(timeout, freeze_s))

    def set(self) -> None:
        self.stopped.set()


def test_a_watcher_that_was_frozen_names_nobody_before_it_reads_the_beats(monkeypatch):
    """This process frozen for longer than SILENT_S (the reader of beats too, so the beats of
    that time are still unread when it wakes): neither its waits nor its beating thread
    name the ranks it watches; their beats, read a moment later, tell they are alive."""
    monkeypatch.setattr(heartbeat, "SILENT_S", 0.3)
    monkeypatch.setattr(heartbeat, "BEAT_S", 0.05)
    monkeypatch.setattr(heartbeat, "LATE_S", 0.1)
    env = dataclasses.replace(detect_environment({}, hostname="box"), rank=1, world_size=3)
    beats, reading, ended, told = _Beats({0, 2}), threading.Event(), threading.Event(), []
    beats.exchange = lambda: None
    beats.broadcast = lambda kind, payload: told.append((kind, payload))

    def arrive() -> None:  # the transport's thread: beats read while ``reading``
        while not ended.wait(0.05):
            if reading.is_set():
                beats.at.update(dict.fromkeys(beats.alive, time.monotonic()))

    reading.set()
    transport = threading.Thread(target=arrive, daemon=True)
    transport.start()
    beat = heartbeat.Heartbeat(env, beats)
    try:
        time.sleep(0.2)
        reading.clear()  # the process freezes: nothing read, the beating thread's wait lasts
        beat._stop = _Oversleeps(3 * heartbeat.SILENT_S)
        time.sleep(2 * heartbeat.SILENT_S)
        assert beat.silent() == []  # asked as the main thread wakes, before the beating one
        time.sleep(heartbeat.SILENT_S + 2 * heartbeat.BEAT_S)  # the beating thread wakes...
        reading.set()  # ...and then the beats queued meanwhile are read
        time.sleep(heartbeat.SILENT_S)
        assert beat.silent() == []
    finally:
        ended.set()
        beat.close()
    assert [kind for kind, _ in told if kind == heartbeat.SILENT_KIND] == [], told


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


#: rank 2 of 3 stops (SIGSTOP) for longer than SILENT_S while the others idle, and resumes;
#: then rank 0 is busy in an agreement past the timeout, which is no lost peer
STOPS_AND_RESUMES = """
import os, signal, subprocess, sys, time
import torch, torch.distributed as dist
import launcher
from launcher.faults import heartbeat
# a timeout long enough for 3 interpreters to meet on a loaded machine (CI: 4 workers, 2 cores)
with launcher.distributed(backend="gloo", timeout_s=15, status_dir=sys.argv[1]) as job:
    meet = torch.tensor([time.time() + 11.0], dtype=torch.float64)
    dist.broadcast(meet, 0)
    if job.rank == 2:
        subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(max(0.0, meet.item() - time.time()))
    dist.all_reduce(torch.ones(1))
    time.sleep(2 * heartbeat.BEAT_S)  # rank 2's watchers hear it within a beat, and say so
    job.print(f"silent: {heartbeat._waits[0].silent()}", every_rank=True)
    with job.agree():
        if job.rank == 0:
            time.sleep(18)  # busy, as a checkpoint write: the others' waits pass the timeout
    dist.all_reduce(torch.ones(1))
    job.print("done", every_rank=True)
"""


def test_a_rank_that_stopped_and_resumed_is_not_named_afterwards(tmp_path):
    """Found silent and told to every rank while it was stopped, rank 2 is heard again once it
    resumes: nobody names it afterwards. Nor does rank 2 name the ranks it watches, which
    it had not heard while it was stopped itself."""
    ranks = run_by_hand([str(write_script(tmp_path, STOPS_AND_RESUMES)), str(tmp_path / "run")],
                        3)
    for rank, (status, output) in enumerate(ranks):
        assert f"[rank {rank}] silent: []" in output, output
        assert status == 0 and f"[rank {rank}] done" in output, output


@pytest.mark.parametrize(("error", "communication"), [
    (RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                  "Connection closed by peer [127.0.0.1]:39148"), True),
    (RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc"
                  ":78] Timed out waiting 3000ms for recv operation to complete"), True),
    (dist.DistBackendError("NCCL communicator was aborted"), True),
    # DDP's reducer, when the mpi backend's wait raised PeerLost under it
    (RuntimeError("Got the following error when running the callback: PeerLost: error: "
                  "all_reduce did not complete within 0:00:15"), True),
    (RuntimeError("Got the following error when running the callback: ValueError: bad"), False),
    (RuntimeError("DataLoader timed out after 5 seconds"), False),  # torch's own words
    (RuntimeError("ProcessGroupGloo::broadcast: invalid root rank: 7"), False),  # the call's
    (ValueError("socket timeout in the user's code"), False),
])
def test_only_the_transport_failing_is_a_communication_failure(error, communication):
    assert peer_lost.is_communication_failure(error) is communication


#: rank 1's own code raises the RuntimeError that torch's DataLoader(timeout=5) raises
RAISES_A_TIMEOUT = """
import torch, torch.distributed as dist
import launcher
with launcher.distributed(backend="gloo", timeout_s=30) as job:
    for step in range(5):
        if job.rank == 1 and step == 3:
            raise RuntimeError("DataLoader timed out after 5 seconds")  # the raise
        dist.all_reduce(torch.ones(1))
"""


def test_a_local_error_that_says_timed_out_is_the_ranks_own(tmp_path):
    """Not a lost peer nor a hang: rank 1 prints its traceback, every rank ends with 70, the
    other naming rank 1's error."""
    script = write_script(tmp_path, RAISES_A_TIMEOUT)
    (status_0, output_0), (status_1, output_1) = run_by_hand([str(script)], 2)
    assert status_1 == EXIT_RANK_FAILED, output_1
    assert "[rank 1] Traceback" in output_1 and "# the raise" in output_1, output_1
    assert "[rank 1] RuntimeError: DataLoader timed out after 5 seconds" in output_1, output_1
    assert status_0 == EXIT_RANK_FAILED, output_0
    assert re.search(r"\[rank 0\] error: rank 1 on \S+ failed with RuntimeError: DataLoader "
                     r"timed out after 5 seconds", output_0), output_0
    assert "hang:" not in output_0 + output_1 and "no heartbeat" not in output_0 + output_1
