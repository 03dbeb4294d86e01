"""A checkpoint outlives the job's shape: written by 2 ranks, resumed on 3, and back.

Under mpiexec and torchrun, for real: the resumed run continues from the step and global sample
it stopped at, with the same global batch and learning-rate schedule; every rank ends with the
same parameters; two resumes on the same number of ranks end alike; and the accuracy is that of
an uninterrupted run, within noise. The 2 -> 3 case under mpiexec is the issue's: SIGUSR1 to one
rank of a running 2-rank job, then ``mpiexec -n 3 ... --resume auto``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.api import checkpoint
from tests.fixtures.mpi import REPO_ROOT, MpiResult, clean_environ, run_mpi
from tests.fixtures.training import metrics, preempt_rank_1, start_training, the_hash

#: 1438 training digits, 48 per step (divides by 2 and 3): 29 steps per epoch, 290 in all
FLAGS = ["--global-batch-size", "48", "--log-every", "1", "--checkpoint-every", "0",
         "--backend", "gloo"]
TOTAL_STEPS = 290
#: accuracy of a resumed run against an uninterrupted one: 7 of the 359 test digits
NOISE = 0.02
TIMEOUT_S = 300


def train(launcher: str, ranks: int, run_dir: Path, data_dir: Path, *flags: str) -> MpiResult:
    args = ["-m", "launcher.train", "--run-dir", str(run_dir), "--data-dir", str(data_dir),
            *FLAGS, *flags]
    if launcher == "mpiexec":
        result = run_mpi(ranks, args, timeout=TIMEOUT_S)
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(ranks), *args], capture_output=True,
                              text=True, timeout=TIMEOUT_S, env=clean_environ(), cwd=REPO_ROOT)
        result = MpiResult(done.returncode, done.stdout, done.stderr)
    assert result.returncode == 0 and not result.timed_out, result.output
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir) -> Path:
    """The run directory of an uninterrupted 2-rank run."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train("mpiexec", 2, run_dir, data_dir)
    return run_dir


@pytest.mark.parametrize("launcher, before, after", [
    pytest.param("mpiexec", 2, 3, marks=pytest.mark.mpi, id="mpiexec-2-to-3-preempted"),
    pytest.param("mpiexec", 3, 2, marks=pytest.mark.mpi, id="mpiexec-3-to-2"),
    # the checkpoint's resharding does not know the launcher: torchrun once, one way
    pytest.param("torchrun", 2, 3, id="torchrun-2-to-3"),
])
def test_resume_on_another_world_size(tmp_path, data_dir, uninterrupted, launcher, before,
                                      after):
    first = tmp_path / "first"
    if (launcher, before) == ("mpiexec", 2):
        preempt_rank_1(start_training(first, data_dir, "gloo", FLAGS), first, 40)
    else:
        train(launcher, before, first, data_dir, "--max-steps", "40")
    [saved] = checkpoint.list_checkpoints(first / "checkpoints")
    state = checkpoint.load(saved)
    stopped = state["step"]
    assert stopped >= 40 and state["samples"] == stopped * 48, (stopped, state["samples"])
    assert state["world_size"] == before and len(state["rng"]) == before

    digests = []
    for copy in ("a", "b"):  # two resumes of the same checkpoint on the same number of ranks
        run_dir = tmp_path / copy
        shutil.copytree(first, run_dir)
        resumed = train(launcher, after, run_dir, data_dir, "--resume", "auto")
        moved = str(saved).replace(str(first), str(run_dir))
        assert (f"{moved} was written by {before} ranks, resuming on {after}: data order "
                "continues by global sample; not bit-identical to an uninterrupted "
                f"{before}-rank run") in resumed.stdout, resumed.output
        assert f"resuming from {moved} (step {stopped}," in resumed.stdout, resumed.output
        digests.append(the_hash(resumed, after))
        steps = {r["step"]: r for r in metrics(run_dir, "step")}
        whole = {r["step"]: r for r in metrics(uninterrupted, "step")}
        # one record per step, before and after the resume: it continued at the next step
        assert sorted(steps) == list(range(1, TOTAL_STEPS + 1))
        # the learning-rate schedule is the step's alone, whatever the world size
        assert all(steps[s]["lr"] == whole[s]["lr"] for s in steps)
        accuracy = metrics(run_dir, "eval")[-1]["test_accuracy"]
        reference = metrics(uninterrupted, "eval")[-1]["test_accuracy"]
        assert accuracy >= 0.95 and abs(accuracy - reference) <= NOISE, (accuracy, reference)
    assert digests[0] == digests[1]


@pytest.mark.mpi
def test_the_example_resumes_on_another_world_size(tmp_path):
    """examples/tokens_transformer.py (GlobalBatchSampler): 40 steps on 2 ranks, then on to 80
    on 3, twice from the same checkpoint: every rank alike, both resumes alike."""
    script = str(REPO_ROOT / "examples" / "tokens_transformer.py")
    flags = ["--global-batch-size", "48", "--backend", "gloo", "--checkpoint-every", "1000"]
    first = run_mpi(2, [script, "--run-dir", str(tmp_path / "a"), "--steps", "40", *flags],
                    timeout=TIMEOUT_S)
    assert first.returncode == 0, first.output
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    digests = []
    for copy in ("a", "b"):
        resumed = run_mpi(3, [script, "--run-dir", str(tmp_path / copy), "--steps", "80",
                              *flags], timeout=TIMEOUT_S)
        assert resumed.returncode == 0, resumed.output
        assert "was written by 2 ranks, resuming on 3" in resumed.stdout, resumed.output
        assert "resumed at step 40" in resumed.stdout, resumed.output
        found = set(re.findall(r"param-sha256 rank=[0-2] ([0-9a-f]{16})", resumed.stdout))
        assert len(re.findall(r"param-sha256", resumed.stdout)) == 3 and len(found) == 1
        digests.append(found.pop())
    assert digests[0] == digests[1]
