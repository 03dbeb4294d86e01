"""The linters the project promises, run by the test suite so that CI enforces them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.fixtures.requirements import missing

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        missing("ruff is not installed in this venv: pip install -e '.[dev]'")
    result = subprocess.run([str(ruff), "check", str(ROOT)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_are_shellcheck_clean():
    if not shutil.which("shellcheck"):
        missing("shellcheck is not installed (Debian: apt-get install shellcheck)")
    scripts = [*ROOT.glob("scripts/*.sh"), *ROOT.glob("docker/**/*.sh"), ROOT / ".ci" / "run"]
    assert len(scripts) >= 4
    result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
