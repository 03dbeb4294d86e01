"""Checkpoint files: checksums catch damage, writes are atomic, the newest valid one wins."""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from launcher import atomic, checkpoint
from launcher.checkpoint import CorruptCheckpoint

STATE = {"step": 7, "model": {"w": torch.arange(6.0).view(2, 3)}, "note": "x"}


def test_round_trip(tmp_path):
    path = checkpoint.save(tmp_path, 7, STATE, keep=3)
    assert path.name == "ckpt-00000007.pt"
    loaded = checkpoint.load(path)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], STATE["model"]["w"])


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-10], "truncated"),
    (lambda b: b[:20], "truncated"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "SHA-256"),
    (lambda b: b"XXXXXXXX" + b[8:], "bad magic"),
], ids=["truncated-payload", "truncated-header", "bit-flip", "magic"])
def test_damage_is_detected(tmp_path, damage, message):
    path = checkpoint.save(tmp_path, 1, STATE, keep=3)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptCheckpoint, match=message) as info:
        checkpoint.load(path)
    assert "--resume" in info.value.hint


def test_keep_deletes_the_oldest(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save(tmp_path, step, STATE, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-00000015.pt", "ckpt-00000020.pt"]


def test_newest_valid_skips_damaged_with_a_warning(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, STATE, keep=5)
    newest = tmp_path / "ckpt-00000030.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    (tmp_path / ".ckpt-00000040.pt.abc.tmp").write_bytes(b"half")  # a killed writer's leftover
    warnings: list[str] = []
    assert checkpoint.newest_valid(tmp_path, warnings.append) == tmp_path / "ckpt-00000020.pt"
    assert len(warnings) == 1 and "ckpt-00000030.pt" in warnings[0] and "truncated" in warnings[0]


def test_newest_valid_of_nothing(tmp_path):
    assert checkpoint.newest_valid(tmp_path / "absent", print) is None


def test_writer_killed_mid_write_leaves_no_visible_file(tmp_path):
    """A real writer process is SIGKILLed after writing its data but before the rename."""
    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from launcher import checkpoint\n"
        "def stall(fd):\n"
        "    print('written', flush=True)\n"
        "    time.sleep(60)\n"
        "os.fsync = stall\n"
        "checkpoint.save(Path(sys.argv[1]), 99, {'blob': b'x' * 1_000_000}, keep=3)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "written"
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
    names = [p.name for p in tmp_path.iterdir()]
    assert len(names) == 1 and names[0].startswith(".ckpt-00000099.pt.") and names[0].endswith(
        ".tmp"), names
    assert checkpoint.list_checkpoints(tmp_path) == []
    assert checkpoint.newest_valid(tmp_path, print) is None


def test_only_a_temp_name_exists_before_the_rename(tmp_path, monkeypatch):
    seen = []
    real_replace = atomic.os.replace

    def spy(src, dst):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", spy)
    checkpoint.save(tmp_path, 3, STATE, keep=3)
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].endswith(".tmp")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000003.pt"]


def test_rng_states_round_trip_through_a_file(tmp_path):
    cpu = torch.device("cpu")
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    state = checkpoint.capture_rng(cpu)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    path = checkpoint.save(tmp_path, 1, {"rng": [state]}, keep=1)
    checkpoint.restore_rng(checkpoint.load(path)["rng"][0], cpu)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]

