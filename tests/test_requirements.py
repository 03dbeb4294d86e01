"""The rule of tests/fixtures/requirements.py, run through pytest itself: a missing tool skips
with its reason for a developer and fails, naming it, under CI=true."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures.mpi import REPO_ROOT

NEEDS_A_TOOL = """\
from tests.fixtures.requirements import missing

def test_needs_a_tool():
    missing("frobnicate is not installed: apt-get install frobnicate")
"""


@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 failed")])
def test_missing_tool_skips_or_fails_in_ci(tmp_path, ci, outcome):
    (tmp_path / "test_tool.py").write_text(NEEDS_A_TOOL)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-rsf", "-p", "no:cacheprovider",
                             str(tmp_path / "test_tool.py")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert outcome in result.stdout, result.stdout
    assert "frobnicate is not installed" in result.stdout, result.stdout
    assert result.returncode == (1 if ci else 0), result.stdout
