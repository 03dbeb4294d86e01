"""Checkpoint files: plain torch files, checksums catch damage, unloadable state is refused
before anything is written, writes are atomic, the newest valid one wins."""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch

from launcher.api import checkpoint
from launcher.api.checkpoint import CorruptCheckpoint, UnloadableState
from launcher.core import atomic

STATE = {"step": 7, "model": {"w": torch.arange(6.0).view(2, 3)}, "note": "x"}


def test_round_trip(tmp_path):
    path = checkpoint.save(tmp_path, 7, STATE, keep=3)
    assert path.name == "ckpt-00000007.pt"
    loaded = checkpoint.load(str(path))  # a str as well as a Path
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], STATE["model"]["w"])


def test_a_checkpoint_is_a_plain_torch_file(tmp_path):
    path = checkpoint.save(tmp_path, 7, STATE, keep=3)
    plain = torch.load(path, weights_only=True)
    assert plain["note"] == "x" and torch.equal(plain["model"]["w"], STATE["model"]["w"])
    assert plain[checkpoint.DIGEST_KEY] == checkpoint.content_digest(STATE)


def _flip_in_tensor(data: bytes) -> bytes:
    """One bit of the saved tensor's data changed (torch.load alone would not notice)."""
    at = data.find(STATE["model"]["w"].numpy().tobytes())
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-10], "truncated, damaged or not a checkpoint"),
    (lambda b: b[:20], "truncated, damaged or not a checkpoint"),
    (_flip_in_tensor, "SHA-256"),
    (lambda b: b"XXXXXXXX" + b[8:], "truncated, damaged or not a checkpoint"),
], ids=["truncated-end", "truncated-start", "bit-flip", "overwritten-start"])
def test_damage_is_detected(tmp_path, damage, message):
    path = checkpoint.save(tmp_path, 1, STATE, keep=3)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptCheckpoint, match=message) as info:
        checkpoint.load(path)
    assert "older checkpoint" in info.value.hint


def test_a_torch_file_without_a_digest_is_not_a_checkpoint(tmp_path):
    torch.save({"model": {}}, tmp_path / "ckpt-00000001.pt")
    with pytest.raises(CorruptCheckpoint, match="not a launcher checkpoint"):
        checkpoint.load(tmp_path / "ckpt-00000001.pt")


@pytest.mark.parametrize("state, where, kind", [
    ({"args": argparse.Namespace(lr=0.1)}, "state['args']", "argparse.Namespace"),
    ({"opt": {"m": [1, np.zeros(3)]}}, "state['opt']['m'][1]", "numpy.ndarray"),
    ({"loss": np.float64(0.5)}, "state['loss']", "numpy.float64"),
], ids=["namespace", "nested-array", "numpy-scalar"])
def test_state_resume_could_not_load_is_refused_and_nothing_written(tmp_path, state, where,
                                                                    kind):
    with pytest.raises(UnloadableState) as info:
        checkpoint.save(tmp_path, 1, state, keep=3)
    assert f"{where} ({kind}) cannot be loaded back" in info.value.message
    assert "vars(args)" in info.value.hint and "torch.from_numpy" in info.value.hint
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("state, where, kind", [
    ({"sync": {"lock": threading.Lock()}}, "state['sync']['lock']", "_thread.lock"),
    ({"schedule": lambda step: 0.1 * step}, "state['schedule']", "builtins.function"),
], ids=["lock", "lambda"])
def test_state_pickle_cannot_save_is_refused_and_nothing_written(tmp_path, state, where, kind):
    with pytest.raises(UnloadableState) as info:
        checkpoint.save(tmp_path, 1, state, keep=3)
    assert f"{where} ({kind}) cannot be saved by torch.save (" in info.value.message
    assert info.value.hint.startswith("save tensors, numbers, strings")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's, on the damaged bytes
def test_no_single_byte_change_gets_past_decode_as_another_error():
    """torch.load raises more than its documented errors when one byte of the pickle changes
    (AssertionError, AttributeError, struct.error): each must be a CorruptCheckpoint, which
    --resume auto skips, not a crash. Every byte of the pickle (data.pkl, stored verbatim) set
    to each opcode that raised one of them (J K M Q)."""
    data = checkpoint.encode({"w": torch.zeros(3)})
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    start = data.index(pickled)
    for at in range(start, start + len(pickled)):
        for value in b"JKMQ":
            with contextlib.suppress(CorruptCheckpoint):
                checkpoint.decode(data[:at] + bytes([value]) + data[at + 1:], f"byte {at}")


def test_keep_deletes_the_oldest(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save(tmp_path, step, STATE, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-00000015.pt", "ckpt-00000020.pt"]


def test_a_save_drops_later_steps_and_never_the_file_it_wrote(tmp_path):
    """Resumed from step 2 into a directory holding a later timeline (6, 7, 8): the save of
    step 3 removes that timeline, saying so, and keeps itself and the newest before it."""
    for step in (1, 2, 6, 7, 8):
        checkpoint.save(tmp_path, step, STATE, keep=5)
    said: list[str] = []
    checkpoint.save(tmp_path, 3, STATE, keep=2, warn=said.append)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-00000002.pt", "ckpt-00000003.pt"]
    assert len(said) == 1 and "later steps (6, 7, 8)" in said[0], said
    assert "step 3 was just saved" in said[0] and "resuming from an earlier step" in said[0]
    checkpoint.save(tmp_path, 3, STATE, keep=1, warn=said.append)  # nothing later: no line
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000003.pt"]
    assert len(said) == 1


def test_steps_past_eight_digits_are_listed_in_order(tmp_path):
    for step in (99_999_999, 10**8):
        checkpoint.save(tmp_path, step, STATE, keep=3)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-99999999.pt", "ckpt-100000000.pt"]
    assert checkpoint.newest_valid(tmp_path, print) == tmp_path / "ckpt-100000000.pt"


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
        "from launcher.api import checkpoint\n"
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


def test_files_follow_the_umask_as_torch_save_does(tmp_path):
    """Under umask 022 a checkpoint, exit-status and slow-nodes are 0644, like torch.save's
    file: a teammate on the shared file system reads them (in a process of its own: the umask
    is per process)."""
    code = (
        "import os, sys, torch\n"
        "from pathlib import Path\n"
        "from launcher.api import checkpoint\n"
        "from launcher.faults import exit_status\n"
        "from launcher.core.atomic import write_atomic\n"
        "os.umask(0o022)\n"
        "d = Path(sys.argv[1])\n"
        "checkpoint.save(d, 1, {'w': torch.ones(2)}, keep=3)\n"
        "exit_status._write(d, 75, 'preempted')\n"
        "write_atomic(d / 'slow-nodes', b'')\n"
        "torch.save({}, d / 'torch-save.pt')\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(
        ["ckpt-00000001.pt", "exit-status", "slow-nodes", "torch-save.pt"], 0o644), modes


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



def test_python_random_state_is_one_tensor_and_the_format_2_tuple_still_restores():
    cpu = torch.device("cpu")
    random.seed(3)
    state = checkpoint.capture_rng(cpu)
    version, internal, gauss = state["python"]
    assert internal.dtype == torch.int64 and internal.shape == (625,)
    expected = random.random()
    for python in (state["python"], (version, tuple(internal.tolist()), gauss)):
        random.seed(9)
        checkpoint.restore_rng({**state, "python": python}, cpu)
        assert random.random() == expected


def test_rng_of_another_world_size_is_reseeded_per_rank_and_reproducibly():
    cpu = torch.device("cpu")
    saved = [checkpoint.capture_rng(cpu), checkpoint.capture_rng(cpu)]

    def draws(rank: int, world_size: int) -> tuple:
        checkpoint.reseed_rng(saved, rank, world_size, cpu)
        return torch.rand(2).tolist(), np.random.rand(), random.random()

    assert draws(2, 3) == draws(2, 3)
    assert len({str(draws(rank, 3)) for rank in range(3)} | {str(draws(0, 1))}) == 4


@pytest.mark.parametrize(("code", "written"), [(errno.EINVAL, True), (errno.EIO, False)])
def test_a_file_system_that_cannot_sync_a_directory_still_gets_the_file(tmp_path, monkeypatch,
                                                                        code, written):
    """fsync(2) of a directory fails with EINVAL on some network and FUSE file systems: the file
    is whole and renamed, so the write stands; a real I/O error still fails it."""
    real = atomic.os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    target = tmp_path / "ckpt-00000001.pt"
    if written:
        atomic.write_atomic(target, b"whole")
    else:
        with pytest.raises(OSError):
            atomic.write_atomic(target, b"whole")
    assert target.read_bytes() == b"whole"  # renamed before the directory's sync either way
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
