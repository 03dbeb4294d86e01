"""README.md's own-script snippet, taken from the README itself (not a copy), completed only
with a model and data as a user would (``my_project``), run as a file under mpiexec with 2
ranks, SIGUSR1'd on one rank, and run again: it must continue from the saved weights, not
from an untrained model at the saved step.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.mpi import REPO_ROOT, clean_environ, mpiexec_path
from tests.test_examples import rank_pids

TIMEOUT_S = 300

#: the model and the data the snippet asks for; Net records the digest of the weights it
#: first computes with, so the test sees what the resumed run trains from
MY_PROJECT = '''
import hashlib, os, time
import torch
from torch import nn

RULE = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
        self.probed = False

    def forward(self, points):
        if not self.probed:
            self.probed = True
            data = b"".join(t.detach().cpu().numpy().tobytes()
                            for t in self.state_dict().values())
            with open(f"{os.environ['PROBE']}-{os.getpid()}", "w") as file:
                file.write(hashlib.sha256(data).hexdigest())
        return self.net(points)


def batch(step, rank, world):
    time.sleep(0.002)  # a data loader's pace: the run lasts long enough to be interrupted
    points = torch.randn(32, 20, generator=torch.Generator().manual_seed(step * world + rank))
    return points, (points @ RULE).argmax(1)
'''


def readme_snippet() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    found = re.search(r"<!-- doc-test: snippet -->\n```python\n(.*?)```", text, re.S)
    assert found, "README.md has no snippet marked <!-- doc-test: snippet -->"
    return found.group(1)


def digest(state: dict) -> str:
    import hashlib

    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()


def losses(output: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$", output, re.M)]


def command(script: Path) -> list[str]:
    return [str(mpiexec_path()), "-n", "2", sys.executable, str(script)]


@pytest.mark.mpi
def test_the_readme_snippet_resumes_its_weights_after_sigusr1(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_snippet())
    (tmp_path / "my_project.py").write_text(MY_PROJECT)
    env = clean_environ({"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}",
                         "PROBE": str(tmp_path / "first")})
    process = subprocess.Popen(command(script), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=tmp_path)
    cut = ""
    try:
        for line in process.stdout:
            cut += line
            if line.startswith("step 200 "):
                break
        pids = rank_pids(script)
        assert len(pids) == 2, (pids, cut)
        os.kill(pids[-1], signal.SIGUSR1)  # one rank, as `kill -USR1 PID` would
        out, stderr = process.communicate(timeout=TIMEOUT_S)
        cut += out
    finally:
        process.kill()
    assert process.returncode == 75, stderr
    saved = re.search(r"preempted, (\S+ckpt-(\d+)\.pt) saved: exit 75", stderr)
    assert saved, stderr
    weights = torch.load(tmp_path / saved.group(1), weights_only=True)["model"]

    env["PROBE"] = str(tmp_path / "again")
    again = subprocess.run(command(script), capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stderr
    probes = {p.read_text() for p in tmp_path.glob("again-*")}
    assert probes == {digest(weights)}, "the resumed run did not start from the saved weights"
    before, after = losses(cut), losses(again.stdout)
    assert after[0][0] > int(saved.group(2)) >= before[-1][0], (cut, again.stdout)
    # continued, not restarted: the first loss after the resume is a trained model's
    assert after[0][1] < 0.5 * math.log(4), (cut, again.stdout)
    assert after[-1][0] == 1000, again.stdout


def test_docs_api_opens_with_the_same_snippet():
    text = (REPO_ROOT / "docs" / "api.md").read_text()
    assert f"<!-- doc-test: snippet -->\n```python\n{readme_snippet()}```" in text
