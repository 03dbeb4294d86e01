"""The examples as a user runs them: copied out of the repository, changed, launched.

Under mpiexec -n 2, srun --mpi=pmi2 -n 2 and torchrun --nproc-per-node 2, each script trains
with equal parameters on every rank; SIGUSR1 to one rank mid-run ends every rank with 75 and
the same command then finishes with the parameters of an uninterrupted run, bit for bit; an
exception in the user's loop on one rank ends every rank within seconds, naming it.
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

from launcher.core.errors import EXIT_RANK_FAILED
from tests.fixtures.mpi import REPO_ROOT, clean_environ, mpiexec_path
from tests.fixtures.rank_exits import FAILURE_ENDS_WITHIN_S
from tests.fixtures.scheduling import uses

EXAMPLES = REPO_ROOT / "examples"
TIMEOUT_S = 300
#: cut at step 12, before the first periodic checkpoint: the resume starts from the preemption's
SHORT = ["--steps", "48", "--log-every", "4", "--checkpoint-every", "16"]


def my_train(tmp_path: Path, raise_at_step: int | None = None) -> Path:
    """examples/tokens_transformer.py copied out and changed as a user would: another width."""
    text = (EXAMPLES / "tokens_transformer.py").read_text()
    text = text.replace("return TinyTransformer(vocab, length)",
                        "return TinyTransformer(vocab, length, width=32, heads=2)")
    if raise_at_step is not None:
        text = text.replace("                loss.backward()\n", f"""\
                if job.rank == 1 and step == {raise_at_step}:
                    print(f"raised at {{__import__('time').time()}}",
                          file=__import__("sys").stderr, flush=True)
                    raise ValueError("my loss went wrong")
                loss.backward()
""")
    script = tmp_path / "my_train.py"
    script.write_text(text)
    return script


def command(launcher: str, script: Path, args: list[str]) -> list[str]:
    python = [sys.executable, str(script), *args]
    if launcher == "mpiexec":
        return [str(mpiexec_path()), "-n", "2", *python]
    if launcher == "srun":
        return ["srun", "-n", "2", "--mpi=pmi2", *python]
    if launcher == "python":
        return python
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", *python[1:]]


def environment(request, launcher: str) -> dict[str, str]:
    # the copied script imports `launcher` from wherever it is installed: here, the repository
    env = clean_environ()
    if launcher == "srun":
        env.update(request.getfixturevalue("slurm_cluster").env)
        env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def run(launcher, script, args, env) -> subprocess.CompletedProcess:
    return subprocess.run(command(launcher, script, args), capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=script.parent)


def hashes(output: str) -> dict[int, str]:
    return {int(r): h for r, h in re.findall(r"param-sha256 rank=(\d) ([0-9a-f]{16})", output)}


def rank_pids(script: Path) -> list[int]:
    """The rank processes (python SCRIPT), not the launcher that has SCRIPT in its line too."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if (len(args) >= 2 and Path(args[0]).name.startswith("python")
                and str(script) in args[1:3] and "torch.distributed.run" not in args):
            pids.append(int(entry.name))
    return pids


LAUNCHERS = [pytest.param("mpiexec", marks=pytest.mark.mpi),
             pytest.param("srun", marks=[pytest.mark.slurm, uses("slurm_cluster")]),
             "torchrun"]


@pytest.mark.parametrize("launcher", [*LAUNCHERS, "python"])
def test_preempted_and_resumed_equals_uninterrupted(request, tmp_path, launcher):
    script = my_train(tmp_path)
    env = environment(request, launcher)
    ranks = 1 if launcher == "python" else 2
    whole = run(launcher, script, [*SHORT, "--run-dir", "whole"], env)
    assert whole.returncode == 0, whole.stderr
    expected = hashes(whole.stdout)
    assert len(expected) == ranks and len(set(expected.values())) == 1, whole.stdout

    process = subprocess.Popen(command(launcher, script, [*SHORT, "--run-dir", "cut"]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=tmp_path)
    try:
        for line in process.stdout:
            if line.startswith("step 12 "):
                break
        pids = rank_pids(script)
        assert len(pids) == ranks, pids
        os.kill(pids[-1], signal.SIGUSR1)  # one rank only: the others learn it at the next step
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        process.kill()
    for rank in range(ranks):
        assert re.search(rf"\[rank {rank}\] preempted, \S+ckpt-\d+\.pt saved: exit 75", stderr), \
            stderr
    if launcher != "torchrun":  # torchrun's agent turns any non-zero status into 1
        assert process.returncode == 75, stderr
    resumed = run(launcher, script, [*SHORT, "--run-dir", "cut"], env)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step" in resumed.stdout, resumed.stdout
    assert hashes(resumed.stdout) == expected, (resumed.stdout, whole.stdout)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_an_exception_in_the_users_loop_ends_every_rank(request, tmp_path, launcher):
    script = my_train(tmp_path, raise_at_step=7)
    result = run(launcher, script, [*SHORT, "--run-dir", "run"], environment(request, launcher))
    ended = time.time()
    raised = re.search(r"raised at ([\d.]+)", result.stderr)
    assert raised, result.stderr
    assert ended - float(raised.group(1)) < FAILURE_ENDS_WITHIN_S, result.stderr
    assert result.returncode != 0
    if launcher == "mpiexec":
        assert result.returncode == EXIT_RANK_FAILED, result.stderr
    assert "[rank 1] ValueError: my loss went wrong" in result.stderr, result.stderr
    assert 'my_train.py", line' in result.stderr, result.stderr
    assert re.search(r"\[rank 0\] error: rank 1 on \S+ failed with ValueError: my loss went "
                     r"wrong", result.stderr), result.stderr


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_classic_loop_runs_unchanged(request, tmp_path, launcher):
    script = tmp_path / "classic_loop.py"
    shutil.copy(EXAMPLES / "classic_loop.py", script)
    result = run(launcher, script, ["--run-dir", "run", "--epochs", "1", "--backend", "mpi"
                                    if launcher != "torchrun" else "gloo"],
                 environment(request, launcher))
    assert result.returncode == 0, result.stderr
    found = hashes(result.stdout)
    assert len(found) == 2 and len(set(found.values())) == 1, result.stdout


def test_the_classic_loop_runs_and_resumes_in_plain_python(tmp_path):
    """examples/classic_loop.py, one process, twice: the second run finds it done."""
    script = tmp_path / "classic_loop.py"
    shutil.copy(EXAMPLES / "classic_loop.py", script)
    first = run("python", script, ["--run-dir", "run", "--epochs", "2"], clean_environ())
    assert first.returncode == 0, first.stderr
    assert "epoch 1 loss" in first.stdout and "param-sha256 rank=0" in first.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "ckpt-00000128.pt", "ckpt-00000256.pt"]
    again = run("python", script, ["--run-dir", "run", "--epochs", "2"], clean_environ())
    assert hashes(again.stdout) == hashes(first.stdout), again.stdout
