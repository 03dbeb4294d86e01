"""``python -m launcher.train`` for real: mpiexec, several ranks, real signals, real files.

Every run has a timeout (run_mpi kills all ranks), so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launcher.api import checkpoint
from launcher.core.errors import EXIT_PREEMPTED, EXIT_USER_ERROR
from tests.fixtures.gpu import GPUS, nccl_ranks, needs_gpu
from tests.fixtures.mpi import clean_environ, json_objects, mpiexec_path, run_mpi

pytestmark = pytest.mark.mpi

BACKENDS = ["gloo", "mpi"]
HASH = re.compile(r"param-sha256 rank=(\d+) ([0-9a-f]{64})")
#: 1438 training digits, 16 per step: 89 steps per epoch at 2 ranks, dropout on (RNG matters)
RESUME_FLAGS = ["--global-batch-size", "16", "--epochs", "2", "--log-every", "1",
                "--checkpoint-every", "0"]
STEPS_PER_EPOCH = 89


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """One digits cache for the module (preparing it is part of every first run anyway)."""
    return tmp_path_factory.mktemp("data")


def train(ranks: int, run_dir: Path, data_dir: Path, *flags: str, backend: str = "gloo",
          timeout: float = 240, env: dict[str, str] | None = None):
    args = ["-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir", str(data_dir),
            "--backend", backend, *flags]
    return run_mpi(ranks, args, timeout=timeout, env=env)


def hashes(result) -> dict[int, str]:
    return {int(rank): digest for rank, digest in HASH.findall(result.stdout)}


def the_hash(result, ranks: int = 2) -> str:
    """The one parameter hash all ranks printed; fails unless every rank printed the same."""
    found = hashes(result)
    assert sorted(found) == list(range(ranks)), result.output
    assert len(set(found.values())) == 1, found
    return found[0]


def metrics(run_dir: Path, event: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in json_objects(path.read_text()) if r.get("event") == event]


def saved_state(run_dir: Path, step: int) -> dict:
    """The run's checkpoint at ``step``, whole."""
    return checkpoint.load(run_dir / "checkpoints" / checkpoint.checkpoint_name(step))


def saved_model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model state of the run's checkpoint at ``step``."""
    return saved_state(run_dir, step)["model"]


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per entry of two state dicts."""
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}


def resumed_and_whole(ranks: int, tmp_path: Path, data_dir: Path, flags: list[str],
                      stop_at: int, backend: str = "gloo"):
    """An uninterrupted run, and the same run stopped at ``stop_at`` steps then resumed with
    ``--resume auto``; both checked to have succeeded and the second part to have resumed."""
    whole = train(ranks, tmp_path / "whole", data_dir, *flags, backend=backend)
    first = train(ranks, tmp_path / "resumed", data_dir, *flags, "--max-steps", str(stop_at),
                  backend=backend)
    second = train(ranks, tmp_path / "resumed", data_dir, *flags, backend=backend)
    for result in (whole, first, second):
        assert result.returncode == 0, result.output
    assert "resuming from" in second.stdout, second.output
    return second, whole


_references: dict[str, str] = {}


def reference_hash(backend: str, data_dir: Path, tmp_path_factory) -> str:
    """The parameters after an uninterrupted run with RESUME_FLAGS (computed once per backend
    and worker: the tests that read it share an xdist group, so once in all)."""
    if backend not in _references:
        run_dir = tmp_path_factory.mktemp(f"reference-{backend}")
        result = train(2, run_dir, data_dir, *RESUME_FLAGS, backend=backend)
        assert result.returncode == 0, result.output
        _references[backend] = the_hash(result)
    return _references[backend]


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_run_reaches_the_documented_accuracy(tmp_path, data_dir, backend):
    result = train(2, tmp_path, data_dir, backend=backend)
    assert result.returncode == 0, result.output
    the_hash(result)
    evals = metrics(tmp_path, "eval")
    assert len(evals) == 10
    assert evals[-1]["test_accuracy"] >= 0.95, evals[-1]  # the bar in docs/training.md
    steps = metrics(tmp_path, "step")
    assert steps[-1]["step"] == 220 and all(s["samples_per_s"] > 0 for s in steps)
    assert (tmp_path / "checkpoints" / "ckpt-00000220.pt").is_file()
    assert "Traceback" not in result.stderr


def _rank_pids(root: int) -> dict[int, int]:
    """Rank -> pid of the python processes below ``root`` (mpiexec), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    ranks, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        rank = [v for v in environ if v.startswith(b"PMI_RANK=")]
        if rank and b"launcher.train" in cmdline:
            ranks[int(rank[0].split(b"=")[1])] = pid
    return ranks


def start_training(run_dir: Path, data_dir: Path, backend: str,
                    flags: list[str] = RESUME_FLAGS) -> subprocess.Popen:
    command = [str(mpiexec_path()), "-n", "2", sys.executable, "-m", "launcher.train",
               "--run-dir", str(run_dir), "--data-dir", str(data_dir), "--backend", backend,
               *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_environ(), start_new_session=True)


def _wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and any(r.get("step", 0) >= step for r in json_objects(path.read_text())):
            return
        time.sleep(0.02)
    raise AssertionError(f"training never reached step {step} (exit {process.poll()})")


def preempt_rank_1(process: subprocess.Popen, run_dir: Path, step: int) -> tuple[str, str]:
    """SIGUSR1 to rank 1 alone of a 2-rank run once it passed ``step``; its stdout and stderr
    after it ended with exit 75 (rank 0 must learn of the signal collectively)."""
    try:
        _wait_for_step(process, run_dir, step, timeout=180)
        pids = _rank_pids(process.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGUSR1)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == EXIT_PREEMPTED, stdout + stderr
    return stdout, stderr


@pytest.mark.xdist_group("train-reference")
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigusr1_to_one_rank_then_resume_is_bit_exact(tmp_path, data_dir, backend,
                                                      tmp_path_factory):
    expected = reference_hash(backend, data_dir, tmp_path_factory)
    process = start_training(tmp_path, data_dir, backend)
    # a few steps into the second epoch: the stop lands mid-epoch, before its 89 steps end
    stdout, stderr = preempt_rank_1(process, tmp_path, STEPS_PER_EPOCH + 3)
    assert not HASH.search(stdout)
    saved = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    assert len(saved) == 1
    for rank in (0, 1):
        assert f"[rank {rank}] preempted, {saved[0]} saved: exit 75" in stderr, stderr
    state = checkpoint.load(saved[0])
    assert state["epoch"] == 1 and 0 < state["batch"] < STEPS_PER_EPOCH, (state["epoch"],
                                                                          state["batch"])
    assert len(state["rng"]) == 2 and not torch.equal(state["rng"][0]["torch"],
                                                      state["rng"][1]["torch"])

    resumed = train(2, tmp_path, data_dir, *RESUME_FLAGS, "--resume", "auto", backend=backend)
    assert resumed.returncode == 0, resumed.output
    assert f"resuming from {saved[0]}" in resumed.stdout
    assert the_hash(resumed) == expected


@pytest.mark.xdist_group("train-reference")
def test_corrupt_newest_checkpoint_is_skipped_and_resume_stays_exact(tmp_path, data_dir,
                                                                     tmp_path_factory):
    expected = reference_hash("gloo", data_dir, tmp_path_factory)
    first = train(2, tmp_path, data_dir, *RESUME_FLAGS, "--max-steps", "30",
                  "--checkpoint-every", "10")
    assert first.returncode == 0, first.output
    directory = tmp_path / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(directory)] == [
        "ckpt-00000010.pt", "ckpt-00000020.pt", "ckpt-00000030.pt"]
    newest = directory / "ckpt-00000030.pt"
    newest.write_bytes(newest.read_bytes()[:-1000])  # a writer cut off by a crash, say

    resumed = train(2, tmp_path, data_dir, *RESUME_FLAGS)  # --resume auto is the default
    assert resumed.returncode == 0, resumed.output
    assert "skipping checkpoint" in resumed.stderr and "ckpt-00000030.pt" in resumed.stderr
    assert "resuming from" in resumed.stdout and "(step 20, epoch 0, batch 20)" in resumed.stdout
    assert the_hash(resumed) == expected

    again = train(2, tmp_path, data_dir, *RESUME_FLAGS)  # a requeue after the end: nothing to do
    assert again.returncode == 0, again.output
    assert "training already complete at step 178" in again.stdout
    assert the_hash(again) == expected


@pytest.mark.parametrize("flags", [
    pytest.param([], id="mlp"),
    pytest.param(["--model", "cnn", "--grad-accum", "2"], id="cnn-accum"),  # buffers, no_sync
])
def test_resume_with_three_ranks_is_bit_exact(tmp_path, data_dir, flags):
    """An all-reduce over 3 ranks rounds by bucket layout, which DDP changes after its first
    backward: the first step after a resume must reduce like the uninterrupted run's."""
    flags = ["--global-batch-size", "48", "--epochs", "1", "--log-every", "100", *flags]
    second, whole = resumed_and_whole(3, tmp_path, data_dir, flags, stop_at=5)
    assert "step 5," in second.stdout, second.output
    assert the_hash(second, ranks=3) == the_hash(whole, ranks=3)


#: an MLP without dropout, one epoch of 44 steps: synchronous SGD's runs, compared
PLAIN_FLAGS = ["--dropout", "0", "--epochs", "1", "--global-batch-size", "32"]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, data_dir) -> tuple[Path, dict[str, object]]:
    """A 2-rank DDP run, a 2-rank --sync manual run and a 1-rank run of PLAIN_FLAGS: started
    once, for every test that compares with them."""
    root = tmp_path_factory.mktemp("plain")
    return root, {
        "ddp": train(2, root / "ddp", data_dir, *PLAIN_FLAGS, "--sync", "ddp"),
        "manual": train(2, root / "manual", data_dir, *PLAIN_FLAGS, "--sync", "manual"),
        "single": train(1, root / "single", data_dir, *PLAIN_FLAGS),
    }


@pytest.mark.xdist_group("train-plain-runs")
def test_sync_modes_and_world_sizes_agree(plain_runs):
    """Synchronous SGD: DDP and the hand-written all-reduce give the same weights, and 2 ranks
    of half the batch each match 1 rank of the whole batch up to float rounding."""
    root, runs = plain_runs
    for result in runs.values():
        assert result.returncode == 0, result.output
    assert the_hash(runs["ddp"]) == the_hash(runs["manual"])

    worst = max(differences(saved_model(root / "ddp", 44),
                            saved_model(root / "single", 44)).values())
    assert worst < 1e-5, worst  # the tolerance stated in docs/training.md (measured 9e-8)


@pytest.fixture
def user_models(tmp_path) -> dict[str, str]:
    (tmp_path / "mymodels.py").write_text(
        "import torch\nimport torch.nn as nn\n"
        "def seven():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 7))\n"
        "def linear():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"
        # a buffer the training forward reads and each rank changes on its own batch
        "class Drifting(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"
        "        self.register_buffer('scale', torch.ones(()))\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            self.scale.mul_(0.9).add_(0.1 * x.mean())\n"
        "        return self.net(x) * self.scale\n"
        # token sequences and a model of their own shape: nothing about 28x28 images
        "def counting():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    start = torch.randint(20, (600, 1), generator=g)\n"
        "    step = torch.randint(1, 3, (600, 1), generator=g)\n"
        "    seq = (start + step * torch.arange(9)) % 20\n"
        "    return (seq[:512, :-1], seq[:512, 1:]), (seq[512:, :-1], seq[512:, 1:])\n"
        "class Tagger(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.mix = nn.Embedding(20, 32), nn.GRU(32, 32, batch_first=True)\n"
        "        self.head = nn.Linear(32, 20)\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.mix(self.embed(tokens))[0])\n"
        "class TaggerWithLoss(Tagger):\n"
        "    def loss(self, outputs, targets):\n"
        "        return nn.functional.cross_entropy(outputs.transpose(1, 2), targets)\n")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).resolve().parents[1]}"}


def _damaged_mnist(directory: Path) -> None:
    from tests.test_data import write_mnist

    directory.mkdir()
    write_mnist(directory)
    path = directory / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-5])


BAD_INPUTS = {
    "batch-does-not-divide": (["--global-batch-size", "63"], "does not divide into 2 ranks"),
    "unknown-model": (["--model", "resnet"], "unknown model 'resnet'"),
    "model-import-fails": (["--model", "nosuchpkg.models:make"], "cannot import 'nosuchpkg"),
    "model-wrong-classes": (["--model", "mymodels:seven"], "returns [2, 7]"),
    "mnist-missing": (["--dataset", "mnist", "--data-dir", "{tmp}/empty"],
                      "train-images-idx3-ubyte[.gz] not found"),
    "mnist-truncated": (["--dataset", "mnist", "--data-dir", "{tmp}/mnist"], "promises"),
    "fp16-on-cpu": (["--precision", "fp16"], "fp16 needs a GPU"),
    "resume-path-missing": (["--resume", "{tmp}/nope.pt"], "cannot read checkpoint"),
    "bad-flag": (["--epochs", "0"], "--epochs must be at least 1"),
    # every rank writes its own log there first: each one fails on its own, none waits
    "run-dir-under-a-file": (["--run-dir", "{tmp}/a-file/run"], "cannot write this rank's log"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_stops_every_rank_with_a_hint(tmp_path, data_dir, user_models, case):
    flags, message = BAD_INPUTS[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("")
    _damaged_mnist(tmp_path / "mnist")
    flags = [f.format(tmp=tmp_path) for f in flags]
    run_dir = tmp_path / "run"
    args = ["-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir", str(data_dir),
            *flags]
    result = run_mpi(2, args, timeout=120, env=user_models)
    assert not result.timed_out, result.output
    assert result.returncode == EXIT_USER_ERROR, result.output
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.stderr, result.output
        assert f"[rank {rank}] HINT:" in result.stderr, result.output
    assert message in result.stderr, result.output
    assert "Traceback" not in result.stderr, result.output
    if case.startswith("mnist"):
        # only local rank 0 reads the files: rank 1 learns of the failure, it does not wait
        assert "[rank 1] error: rank 0 failed: " in result.stderr, result.output
    assert not list(run_dir.glob("checkpoints/*"))


def test_resume_with_other_settings_or_a_batch_that_cannot_divide_is_refused(tmp_path,
                                                                             data_dir):
    first = train(1, tmp_path, data_dir, "--max-steps", "2", "--epochs", "1")
    assert first.returncode == 0, first.output
    second = train(3, tmp_path, data_dir, "--epochs", "1")  # 64 samples do not split in 3
    assert second.returncode == EXIT_USER_ERROR, second.output
    for rank in (0, 1, 2):
        assert f"[rank {rank}] error: " in second.stderr, second.output
        assert f"[rank {rank}] HINT: " in second.stderr, second.output
    assert ("continues a run of global batch 64 (written by 1 ranks), which does not divide "
            "into 3 ranks x 1 micro-batches") in second.stderr, second.output
    assert "HINT: resume it on a number of ranks that divides the batch: 1, 2, 4, 8" in (
        second.stderr)
    third = train(1, tmp_path, data_dir, "--epochs", "1", "--lr", "0.2")
    assert third.returncode == EXIT_USER_ERROR, third.output
    assert "belongs to a run with other settings: --lr 0.1 (now 0.2)" in third.stderr
    assert "HINT: resume with the same flags" in third.stderr


def test_user_model_trains(tmp_path, data_dir, user_models):
    result = train(2, tmp_path / "run", data_dir, "--model", "mymodels:linear", "--epochs", "1",
                   env=user_models)
    assert result.returncode == 0, result.output
    the_hash(result)
    (evaluation,) = metrics(tmp_path / "run", "eval")
    assert evaluation["test_accuracy"] > 0.5


@pytest.mark.parametrize("model, backend", [("Tagger", "mpi"), ("TaggerWithLoss", "gloo")])
def test_a_dataset_and_model_of_any_shape_train(tmp_path, data_dir, user_models, model,
                                                 backend):
    """--dataset and --model factories of the user's own: token sequences [B, 8] in, logits
    [B, 8, 20] out; cross-entropy over the last dimension by default, or the model's loss."""
    result = train(2, tmp_path / "run", data_dir, "--dataset", "mymodels:counting", "--model",
                   f"mymodels:{model}", "--epochs", "2", "--lr", "0.5",
                   "--global-batch-size", "32", backend=backend, env=user_models)
    assert result.returncode == 0, result.output
    the_hash(result)
    first, last = metrics(tmp_path / "run", "eval")
    assert last["test_loss"] < first["test_loss"], (first, last)
    assert ("test_accuracy" in last) is (model == "Tagger")


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory, data_dir) -> tuple[Path, dict[str, object]]:
    """The CNN (batch norm, dropout) with gradient accumulation, one epoch of 44 steps on 2
    ranks, once under each --sync mode: started once, for every test that reads them."""
    root = tmp_path_factory.mktemp("cnn")
    flags = ["--model", "cnn", "--epochs", "1", "--global-batch-size", "32", "--grad-accum", "2"]
    return root, {sync: train(2, root / sync, data_dir, *flags, "--sync", sync)
                  for sync in ("ddp", "manual")}


@pytest.mark.xdist_group("train-cnn-runs")
def test_ddp_equals_manual_for_cnn_with_batch_norm_dropout_and_accumulation(cnn_runs):
    _, runs = cnn_runs
    ddp, manual = runs["ddp"], runs["manual"]
    assert ddp.returncode == 0 and manual.returncode == 0, ddp.output + manual.output
    assert the_hash(ddp) == the_hash(manual)


@pytest.mark.xdist_group("train-cnn-runs")
@pytest.mark.parametrize("sync", ["ddp", "manual"])
def test_every_rank_evaluates_with_rank_0s_batch_norm_statistics(cnn_runs, data_dir, sync):
    """On CPU each rank's batch norm updates its own running statistics while training (nothing
    reads them there, so no collective per step); before evaluating every rank takes rank 0's,
    the ones the checkpoint holds. So the 2-rank evaluation is that of the saved model."""
    from launcher.training.data import load_dataset
    from launcher.training.models import cnn

    root, runs = cnn_runs
    run_dir = root / sync
    assert runs[sync].returncode == 0, runs[sync].output
    (reported,) = metrics(run_dir, "eval")
    model = cnn()
    model.load_state_dict(saved_model(run_dir, 44))
    test = load_dataset("digits", data_dir, local_rank=0).test
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model.eval()(test.inputs), test.targets)
    # each rank using its own statistics moves the loss by ~1e-3; rounding alone, by ~1e-7
    assert reported["test_loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_buffers_read_in_training_follow_rank_0_in_both_sync_modes(tmp_path, data_dir,
                                                                     user_models):
    """A buffer the training forward reads is broadcast before every forward: by DDP, and by
    hand under --sync manual; skipping it in either would give the two different weights."""
    flags = ["--model", "mymodels:Drifting", "--epochs", "1", "--max-steps", "10"]
    runs = [train(2, tmp_path / sync, data_dir, *flags, "--sync", sync, env=user_models)
            for sync in ("ddp", "manual")]
    for result in runs:
        assert result.returncode == 0, result.output
    assert the_hash(runs[0]) == the_hash(runs[1])


@pytest.mark.xdist_group("train-plain-runs")
def test_gradient_accumulation_matches_one_big_batch(tmp_path, data_dir, plain_runs):
    """Four micro-batches of 4 per rank, the whole epoch, against plain_runs' DDP run (one
    micro-batch of 16)."""
    root, runs = plain_runs
    assert runs["ddp"].returncode == 0, runs["ddp"].output
    four = train(2, tmp_path, data_dir, *PLAIN_FLAGS, "--grad-accum", "4")
    assert four.returncode == 0, four.output

    one = saved_model(root / "ddp", 44)
    assert max(differences(one, saved_model(tmp_path, 44)).values()) < 1e-5


@pytest.mark.parametrize("flags, key", [
    (["--model", "autoencoder", "--lr", "1"], "test_loss"),  # SGD needs a larger step here
    (["--precision", "bf16"], "test_accuracy"),
    (["--model", "cnn", "--deterministic"], "test_accuracy"),  # the flag is harmless on CPU
])
def test_other_models_and_precisions_train(tmp_path, data_dir, flags, key):
    result = train(2, tmp_path, data_dir, *flags, "--epochs", "2")
    assert result.returncode == 0, result.output
    the_hash(result)
    first, last = metrics(tmp_path, "eval")
    assert ("test_accuracy" in last) == (key == "test_accuracy")
    assert last["test_loss"] < first["test_loss"]


# --- GPU (skipped without one; `pytest -m gpu` on a GPU machine) ---------------------------------
#: every backend on CUDA tensors; two ranks share one GPU when there is only one (gloo and the
#: mpi4py backend allow that, NCCL does not)
GPU_RUNS = [("nccl", nccl_ranks()), ("gloo", 2), ("mpi", 2)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend, ranks", GPU_RUNS)
def test_default_run_on_gpu_reaches_the_documented_accuracy(tmp_path, data_dir, backend, ranks):
    result = train(ranks, tmp_path, data_dir, backend=backend)
    assert result.returncode == 0, result.output
    assert "device cuda" in result.stdout, result.output
    the_hash(result, ranks)
    assert metrics(tmp_path, "eval")[-1]["test_accuracy"] >= 0.95


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resume_on_gpu_is_bit_exact(tmp_path, data_dir, precision):
    """Dropout draws from each rank's CUDA generator and fp16 steps depend on the GradScaler's
    scale: both must come back from the checkpoint for the resumed run to match."""
    flags = [*RESUME_FLAGS, "--precision", precision]
    second, whole = resumed_and_whole(2, tmp_path, data_dir, flags, stop_at=100, backend="mpi")
    assert the_hash(second) == the_hash(whole)
    state = saved_state(tmp_path / "resumed", 100)
    assert all("cuda" in rng for rng in state["rng"]), state["rng"]
    assert not torch.equal(state["rng"][0]["cuda"], state["rng"][1]["cuda"])
    assert ("scale" in state["scaler"]) == (precision == "fp16"), state["scaler"]


@pytest.mark.gpu
@needs_gpu
def test_deterministic_cnn_resume_on_gpu_is_bit_exact(tmp_path, data_dir):
    """Convolutions on GPU are bit-reproducible only with --deterministic (without it, two
    identical runs differed by 2 % relative after 20 steps on an H100)."""
    flags = ["--model", "cnn", "--deterministic", "--global-batch-size", "32", "--epochs", "1",
             "--checkpoint-every", "0", "--max-steps", "30"]
    second, whole = resumed_and_whole(2, tmp_path, data_dir, flags, stop_at=12, backend="mpi")
    assert the_hash(second) == the_hash(whole)


@pytest.mark.gpu
@needs_gpu
def test_sync_batch_norm_on_gpu_makes_two_ranks_match_one(tmp_path, data_dir):
    """With SyncBatchNorm two ranks of half the batch normalise over the whole batch, as one
    rank does. Compared after one step: later steps amplify rounding differences (measured:
    6e-6 after one step; each rank normalising its own half instead, as on CPU: 1e-3)."""
    flags = ["--model", "cnn", "--deterministic", "--dropout", "0", "--epochs", "1",
             "--global-batch-size", "32", "--max-steps", "1", "--checkpoint-every", "0"]
    backend = "nccl" if GPUS >= 2 else "mpi"
    two = train(2, tmp_path / "two", data_dir, *flags, backend=backend)
    one = train(1, tmp_path / "one", data_dir, *flags, backend="nccl")
    for result in (two, one):
        assert result.returncode == 0, result.output
    a, b = saved_model(tmp_path / "two", 1), saved_model(tmp_path / "one", 1)
    assert any("running_mean" in k for k in a), sorted(a)
    worst = differences(a, b)
    assert max(worst.values()) < 1e-4, worst


def test_the_already_complete_hint_followed_literally_trains_again(tmp_path, data_dir):
    def once(run_dir: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir",
             str(data_dir), "--epochs", "1"],
            capture_output=True, text=True, env=clean_environ(), cwd=tmp_path, timeout=240)

    assert once(tmp_path / "run").returncode == 0
    again = once(tmp_path / "run")
    assert again.returncode == 0, again.stderr
    said = re.search(r"training already complete at step \d+: nothing to do \(to train again: "
                     r"a new --run-dir, or remove (\S+)\)", again.stdout)
    assert said, again.stdout
    shutil.rmtree(tmp_path / said.group(1))  # relative to where it ran
    for run_dir in (tmp_path / "run", tmp_path / "new"):
        trained = once(run_dir)
        assert trained.returncode == 0, trained.stderr
        assert "starting from scratch" in trained.stdout and "param-sha256" in trained.stdout
