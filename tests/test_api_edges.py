"""The public API's edges, as a script of a user's own meets them: checkpoints read by plain
``torch.load`` and by ``job.load`` in one process, a save that resume could not load refused on
every rank, ``timeout_s`` checked, ``job.print`` on every rank in whole lines, ``dir(launcher)``,
and torchrun without a TCPStore bind error."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launcher
from launcher.api import checkpoint
from launcher.api import job as job_module
from launcher.core.errors import EXIT_USER_ERROR
from launcher.faults.peer_lost import diagnose
from launcher.group.backends import select_backend
from launcher.placement.env import detect_environment
from tests.fixtures.mpi import REPO_ROOT, clean_environ, run_mpi

SAVE = """\
import sys, torch, launcher
from torch import nn
with launcher.distributed("gloo") as job:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    job.print(job.save(sys.argv[1], 5, state, samples=40))
"""

LOAD = """\
import sys, torch, launcher
from torch import nn
with launcher.distributed() as job:
    model = nn.Linear(3, 2)
    state = job.load(sys.argv[1])
    model.load_state_dict(state["model"])
    print("loaded step", state["step"], "samples", state["samples"], "on", job.world_size)
"""

UNLOADABLE = """\
import argparse, sys, torch, launcher
with launcher.distributed("gloo") as job:
    job.save(sys.argv[1], 1, {"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)})
"""

TIMEOUT = """\
import sys, launcher
with launcher.distributed(timeout_s=eval(sys.argv[1])) as job:
    print("started")
"""

PRINT = """\
import launcher
with launcher.distributed("gloo") as job:
    for i in range(1000):
        job.print(f"first {i}\\nsecond {i}", every_rank=True)
    job.print("rank 0 alone")
"""


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=clean_environ(), cwd=REPO_ROOT)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args)


@pytest.mark.mpi
def test_a_two_rank_checkpoint_loads_with_torch_load_and_in_one_process(tmp_path):
    saved = run_mpi(2, [script(tmp_path, "save", SAVE), str(tmp_path / "ckpts")], timeout=120)
    assert saved.returncode == 0, saved.output
    path = tmp_path / "ckpts" / "ckpt-00000005.pt"
    assert saved.stdout.strip() == str(path), saved.output

    plain = torch.load(path, weights_only=True)
    assert plain["step"] == 5 and plain["samples"] == 40 and plain["world_size"] == 2
    assert len(plain["rng"]) == 2 and set(plain["model"]) == {"weight", "bias"}
    assert plain["optimizer"]["state"][0]["momentum_buffer"].shape == (2, 3)

    loaded = python(script(tmp_path, "load", LOAD), str(path))  # a str, in one process
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert "loaded step 5 samples 40 on 1" in loaded.stdout
    assert (f"{path} was written by 2 ranks, resuming on 1: data order continues by global "
            "sample; not bit-identical to an uninterrupted 2-rank run") in loaded.stdout

    # to evaluate: no RNG restored, nothing resumed, nothing to say, however often it loads
    quiet = python(script(tmp_path, "quiet", LOAD.replace(
        "state = job.load(sys.argv[1])",
        "state = job.load(sys.argv[1], restore_rng=False)\n"
        "    state = job.load(sys.argv[1], restore_rng=False)")), str(path))
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert quiet.stdout == "loaded step 5 samples 40 on 1\n", quiet.stdout


@pytest.mark.mpi
def test_a_save_that_resume_could_not_load_is_refused_on_every_rank(tmp_path):
    directory = tmp_path / "ckpts"
    result = run_mpi(2, [script(tmp_path, "bad", UNLOADABLE), str(directory)], timeout=120)
    assert result.returncode == EXIT_USER_ERROR, result.output
    cause = ("job.save: state['args'] (argparse.Namespace) cannot be loaded back with "
             "torch.load(weights_only=True), so resume would fail")
    assert f"[rank 0] error: {cause}" in result.stderr, result.output
    assert f"[rank 1] error: rank 0 failed: {cause}" in result.stderr, result.output
    for rank in (0, 1):
        assert f"[rank {rank}] HINT: save tensors, numbers" in result.stderr, result.output
    assert "Traceback" not in result.stderr
    assert not directory.exists() or not list(directory.iterdir())


FIRST = """\
import sys, time, launcher
from launcher.core.errors import LaunchError
with launcher.distributed("gloo") as job:
    for turn in ("pass", "fail"):
        with job.main_first():
            with open(sys.argv[1], "a") as log:
                log.write(f"{turn} {job.rank} in\\n")
            if job.local_rank == 0:
                time.sleep(1)
                if turn == "fail":
                    raise LaunchError("no dataset here", "download it first")
            with open(sys.argv[1], "a") as log:
                log.write(f"{turn} {job.rank} out\\n")
"""


@pytest.mark.mpi
def test_main_first_runs_local_rank_0_first_and_its_error_stops_every_rank(tmp_path):
    log = tmp_path / "log"
    result = run_mpi(2, [script(tmp_path, "first", FIRST), str(log)], timeout=120)
    lines = log.read_text().splitlines()
    # rank 0 goes on to its next turn at once: only rank 1 waits
    assert sorted(lines) == ["fail 0 in", "pass 0 in", "pass 0 out", "pass 1 in", "pass 1 out"]
    assert lines.index("pass 0 out") < lines.index("pass 1 in"), lines
    assert result.returncode == EXIT_USER_ERROR, result.output
    assert "[rank 0] error: no dataset here" in result.stderr, result.output
    assert "[rank 1] error: rank 0 failed: no dataset here" in result.stderr, result.output


@pytest.mark.parametrize(("per_node", "first"), [(True, True), (False, False)])
def test_main_first_takes_local_rank_0_per_node_else_rank_0(monkeypatch, per_node, first):
    """Rank 1 as a second node's local rank 0: first per node, not first across nodes (the
    body inside the agreement, or after it)."""
    events = []

    @contextlib.contextmanager
    def agree():
        events.append("agree")
        yield
        events.append("agreed")

    monkeypatch.setattr(job_module, "agree", agree)
    env = dataclasses.replace(detect_environment({}, hostname="n1"), rank=1, local_rank=0,
                              world_size=2)
    job = job_module.Job(env, "gloo", torch.device("cpu"), watch=None)
    with job.main_first(per_node=per_node):
        events.append("body")
    assert events == (["agree", "body", "agreed"] if first else ["agree", "agreed", "body"])


COUNTED = """
import sys
from launcher.placement import env as placement_env
read = placement_env.detect_environment
calls = []
placement_env.detect_environment = lambda *a, **k: calls.append(1) or read(*a, **k)
"""


@pytest.mark.parametrize("entry", [
    "import launcher\nwith launcher.exit_statuses() as env:\n"
    "    with launcher.distributed('gloo', env=env) as job:\n        pass\n",
    "from launcher.diagnostics import check\ntry:\n    check.main(['--backend', 'gloo'])\n"
    "finally:\n    print('reads', len(calls))\n",
])
def test_the_environment_is_read_once_per_process(tmp_path, entry):
    text = COUNTED + entry + "print('reads', len(calls))\n"
    result = python(script(tmp_path, "counted", text))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reads 1" in result.stdout.splitlines(), result.stdout


@pytest.mark.parametrize("value", ["0", "-5", "'10'", "True", "float('nan')", "None"])
def test_timeout_s_must_be_a_positive_number(tmp_path, value):
    result = python(script(tmp_path, "timeout", TIMEOUT), value)
    assert result.returncode == EXIT_USER_ERROR, result.stdout + result.stderr
    shown = repr(eval(value))
    assert (f"[rank 0] error: launcher.distributed(timeout_s={shown}): the timeout must be a "
            "positive number of seconds") in result.stderr, result.stderr
    assert "[rank 0] HINT: pass how long a collective may wait" in result.stderr
    assert "Traceback" not in result.stderr and "started" not in result.stdout


@pytest.mark.mpi
def test_print_on_every_rank_gives_whole_prefixed_lines(tmp_path):
    result = run_mpi(2, [script(tmp_path, "print", PRINT)], timeout=120)
    assert result.returncode == 0, result.output
    lines = result.stdout.splitlines()
    for rank in (0, 1):
        for i in range(1000):
            assert f"[rank {rank}] first {i}" in lines and f"[rank {rank}] second {i}" in lines
    assert lines.count("rank 0 alone") == 1
    assert all(re.fullmatch(r"\[rank [01]\] (first|second) \d+|rank 0 alone", line)
               for line in lines), result.stdout


def test_dir_lists_the_public_names():
    assert {"distributed", "Job", "exit_statuses", "LaunchError"} <= set(dir(launcher))


def test_torchrun_prints_no_store_bind_error(tmp_path):
    result = torchrun(script(tmp_path, "print", PRINT))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TCPStore" not in result.stderr and "failed to bind" not in result.stderr, (
        result.stderr)
    assert result.stdout.count("[rank 1] second 999") == 1


def test_hints_a_script_can_meet_speak_of_the_api_too():
    with pytest.raises(launcher.LaunchError) as nccl:
        select_backend("nccl", cuda_available=False, native_mpi=False)
    assert 'launcher.distributed(backend="gloo")' in nccl.value.hint
    lost = diagnose(detect_environment({}), "gloo", RuntimeError("Connection reset"))
    assert "job.resume" in lost.hint and "--resume auto" in lost.hint
    with pytest.raises(launcher.LaunchError) as damaged:
        checkpoint.decode(b"not a checkpoint", "ckpt-00000001.pt")
    assert "--resume" not in damaged.value.hint
