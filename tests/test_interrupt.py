"""Ctrl-C on a running job: every rank saves and ends with 130, or ends unsaved within the grace.

A terminal's Ctrl-C sends SIGINT to the launcher's process group; mpiexec forwards it to every
rank. Timing bounds are docs/training.md's promise, measured from the signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from launcher.api import checkpoint
from launcher.core.errors import EXIT_INTERRUPTED
from launcher.faults.preemption import INTERRUPT_GRACE_S
from tests.fixtures.training import rank_pids, start_training, wait_for_step

pytestmark = pytest.mark.mpi

#: docs/training.md, "Preemption and exit codes": after Ctrl-C every rank has ended within this
#: (the grace to reach a step boundary, then a checkpoint of the models here)
INTERRUPT_ENDS_WITHIN_S = 10


def _ctrl_c(process: subprocess.Popen, run_dir, stop_rank_1: bool = False
            ) -> tuple[str, float]:
    """Ctrl-C to the launcher's process group a few steps in (rank 1 stopped first when asked):
    its stderr and the seconds from the signal to the launcher's end."""
    try:
        wait_for_step(process, run_dir, 5, timeout=180)
        if stop_rank_1:
            os.kill(rank_pids(process.pid)[1], signal.SIGSTOP)
        sent = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        return stderr, time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_ctrl_c_saves_and_ends_every_rank_with_130(tmp_path, data_dir, backend):
    process = start_training(tmp_path, data_dir, backend)
    stderr, took = _ctrl_c(process, tmp_path)
    assert process.returncode == EXIT_INTERRUPTED, stderr
    assert took < INTERRUPT_ENDS_WITHIN_S, stderr
    saved = checkpoint.list_checkpoints(tmp_path / "checkpoints")
    assert len(saved) == 1, stderr
    checkpoint.load(saved[0])
    for rank in (0, 1):
        assert f"[rank {rank}] interrupted, {saved[0]} saved: exit 130" in stderr, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr


def test_ctrl_c_without_a_step_boundary_ends_unsaved_after_the_grace(tmp_path, data_dir):
    """Rank 1 stopped (a stuck file system): rank 0 waits in the step's collective, where no
    Python handler runs, and still ends the grace after the signal."""
    process = start_training(tmp_path, data_dir, "gloo")
    stderr, took = _ctrl_c(process, tmp_path, stop_rank_1=True)
    assert (f"[rank 0] interrupted (no step boundary within {INTERRUPT_GRACE_S:g} s of Ctrl-C), "
            f"no checkpoint saved: exit {EXIT_INTERRUPTED}") in stderr, stderr
    assert INTERRUPT_GRACE_S <= took < INTERRUPT_ENDS_WITHIN_S, stderr
    assert not list((tmp_path / "checkpoints").glob("*")), stderr
    assert "Traceback" not in stderr, stderr
