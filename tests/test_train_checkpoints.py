"""``launcher.train``'s checkpoints for real, on one rank and on two: ``--keep``, a resume from an
earlier checkpoint, an fp16 resume of an fp32 run's scaler, a script's own checkpoint given to
``--resume``, and every rank's RNG states gathered to rank 0 alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.api import checkpoint
from launcher.core.errors import EXIT_USER_ERROR
from launcher.mpi import cxx as mpi_cxx
from launcher.training.loop import load_scaler
from tests.fixtures.mpi import REPO_ROOT, clean_environ, json_objects, run_mpi

#: a short run: synthetic data (no files to prepare), 16 samples a step, one thread
FLAGS = ["--dataset", "synthetic", "--global-batch-size", "16", "--threads", "1",
         "--log-every", "100"]

SAVE = """\
import sys, torch, launcher
with launcher.distributed("gloo") as job:
    job.save(sys.argv[1], 4, {"model": {"w": torch.ones(2)}})
"""

GATHER = """\
import json, sys, torch, launcher
from launcher.faults import flight_recorder
with launcher.distributed(sys.argv[2]) as job:
    torch.manual_seed(job.rank)  # each rank's own torch state, told apart in the file
    before = len(flight_recorder.snapshot())
    job.save(sys.argv[1], 1, {"w": torch.ones(2)})
    ops = [entry["op"] for entry in flight_recorder.snapshot()[before:]]
    print(json.dumps({"rank": job.rank, "ops": ops}), flush=True)
"""


def python(*args: str) -> subprocess.CompletedProcess:
    """One process, no launcher: a job of one rank."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=clean_environ(), cwd=REPO_ROOT)


def train(run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    result = python("-m", "launcher.train", "--run-dir", str(run_dir), *FLAGS, *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def steps(run_dir: Path) -> list[int]:
    return [int(p.name[5:-3]) for p in checkpoint.list_checkpoints(run_dir / "checkpoints")]


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory) -> Path:
    """A run of 8 steps, a checkpoint every step, ``--keep 7``, fp32 (a disabled scaler)."""
    run_dir = tmp_path_factory.mktemp("eight-steps")
    train(run_dir, "--checkpoint-every", "1", "--keep", "7", "--max-steps", "8")
    return run_dir


def test_keep_is_the_number_of_checkpoints_left(eight_steps):
    assert steps(eight_steps) == list(range(2, 9))


def test_an_fp16_resume_of_an_fp32_checkpoint_starts_a_fresh_scaler(eight_steps):
    """An fp32 run saves its disabled GradScaler's empty state, which an enabled one refuses
    ("The source state dict is empty"); an fp16 scaler's own state still comes back. On CPU:
    launcher.train takes fp16 on GPUs only, and the scaler is the same."""
    saved = checkpoint.load(eight_steps / "checkpoints" / checkpoint.checkpoint_name(8))["scaler"]
    assert saved == {}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    load_scaler(scaler, saved)
    assert scaler.get_scale() == 2.0**16
    load_scaler(scaler, torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    assert scaler.get_scale() == 8.0


def test_a_resume_from_an_earlier_step_removes_the_timeline_it_left(eight_steps, tmp_path):
    """Resumed from a copy of step 2 into the run directory of steps 2 to 8, the save of step
    3 removes 4 to 8 (the timeline left behind: the next --resume auto would take it)."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "ckpt-00000002.pt"
    shutil.copytree(eight_steps, run_dir)
    shutil.move(run_dir / "checkpoints" / elsewhere.name, elsewhere)
    resumed = train(run_dir, "--checkpoint-every", "1", "--keep", "3", "--max-steps", "3",
                    "--resume", str(elsewhere))
    assert f"resuming from {elsewhere} (step 2" in resumed.stdout, resumed.stdout
    assert steps(run_dir) == [3]
    assert "removed the checkpoints of later steps (4, 5, 6, 7, 8)" in resumed.stderr
    assert checkpoint.newest_valid(run_dir / "checkpoints", print).name == "ckpt-00000003.pt"


def test_a_scripts_own_checkpoint_given_to_resume_is_a_user_error(tmp_path):
    (tmp_path / "save.py").write_text(SAVE)
    saved = python(str(tmp_path / "save.py"), str(tmp_path / "own"))
    assert saved.returncode == 0, saved.stderr
    path = tmp_path / "own" / checkpoint.checkpoint_name(4)
    result = python("-m", "launcher.train", "--run-dir", str(tmp_path / "run"), *FLAGS,
                    "--resume", str(path))
    assert result.returncode == EXIT_USER_ERROR, result.stdout + result.stderr
    assert f"error: {path} was not written by launcher.train" in result.stderr, result.stderr
    assert "HINT: resume it with the script that saved it" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("backend, impl", [("gloo", None), ("mpi", "python"), ("mpi", "cxx")])
def test_rng_states_are_gathered_to_rank_0_alone(tmp_path, backend, impl):
    """Only rank 0 writes: the RNG states go to it with gather_object (all N states to one
    rank), not all_gather_object (all N to every rank: N^2 in all), and arrive whole."""
    if impl == "cxx" and not mpi_cxx.built_path().exists():
        pytest.skip("the compiled mpi backend is not built (python -m launcher.mpi.cxx)")
    (tmp_path / "gather.py").write_text(GATHER)
    result = run_mpi(2, [str(tmp_path / "gather.py"), str(tmp_path / "ckpt"), backend],
                     env=None if impl is None else {"DDP_MPI_IMPL": impl})
    assert result.returncode == 0, result.output
    ops = {line["rank"]: line["ops"] for line in json_objects(result.stdout)}
    assert sorted(ops) == [0, 1] and all(o[0] == "gather_object" for o in ops.values()), ops
    rng = checkpoint.load(tmp_path / "ckpt" / checkpoint.checkpoint_name(1))["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])
