"""docker/cluster/ssh-launch.sh, the ssh Hydra's mpiexec starts its proxies with, run on the
host with a stand-in ``ssh``: a lost session is named on mpiexec's own stderr, even when
mpiexec has stopped reading the script's (as it does when a node dies), and ssh's status is
passed on. The cluster-wide behaviour is tested for real in tests/test_faults.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.mpi import REPO_ROOT

SSH_LAUNCH = REPO_ROOT / "docker" / "cluster" / "ssh-launch.sh"


@pytest.fixture
def fake_ssh(tmp_path: Path):
    """Put an ``ssh`` on PATH that says something on stderr, waits, and exits with STATUS."""
    def make(status: int, seconds: float = 1.0) -> dict:
        ssh = tmp_path / "ssh"
        ssh.write_text(f"#!/bin/sh\necho \"ssh: $*\" >&2\nsleep {seconds}\nexit {status}\n")
        ssh.chmod(0o755)
        return {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                "DDP_SSH_LOST_GRACE_S": "0"}
    return make


def run_as_launcher(script: str, env: dict) -> subprocess.CompletedProcess:
    """Run SCRIPT as the stand-in for mpiexec; $0 is ssh-launch.sh. Returns once every holder
    of the stand-in's stdout and stderr has closed them, as ``docker exec`` would."""
    return subprocess.run(["sh", "-c", script, str(SSH_LAUNCH)], env=env, capture_output=True,
                          text=True, timeout=30)


def test_a_lost_session_is_named_after_mpiexec_stopped_reading(fake_ssh):
    # the script's own stderr is closed (nobody reads it any more), and the stand-in for
    # mpiexec ends before ssh does: the message must still reach mpiexec's stderr
    result = run_as_launcher('"$0" -x node2 hydra_pmi_proxy 2>&- & sleep 0.3; exit 7',
                             fake_ssh(255))
    assert result.returncode == 7
    assert "ssh-launch: lost the ssh session to node2 (ssh exit 255)" in result.stderr


def test_ssh_status_and_output_pass_through(fake_ssh):
    result = run_as_launcher('"$0" node1 hydra_pmi_proxy; echo "status $?"',
                             fake_ssh(3, seconds=0))
    assert result.stdout == "status 3\n"
    # ssh's own stderr goes where Hydra reads it, and a session that ended is not "lost"
    assert result.stderr == "ssh: node1 hydra_pmi_proxy\n"
