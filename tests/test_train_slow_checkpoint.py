"""A timeout shorter than a checkpoint write does not end a healthy job (launcher.faults.heartbeat).

For real: 2 ranks train with ``--timeout-s 3`` while rank 0's checkpoint writes take
``WRITE_S`` (a model factory below slows ``launcher.api.checkpoint``'s write, as a slow file system
would); the other rank waits in the agreement after the write and must go on waiting, since
rank 0 still beats. Under the mpi backend (mpiexec) and gloo.
"""

from __future__ import annotations

import time

import pytest

from launcher.api import checkpoint
from launcher.training.models import mlp

WRITE_S = 10
TIMEOUT_S = 3


def slow_saving_mlp():
    """The default model, with every checkpoint write WRITE_S slower (run on each rank)."""
    write = checkpoint.write_atomic

    def slow_write(path, data):
        time.sleep(WRITE_S)
        write(path, data)

    checkpoint.write_atomic = slow_write
    return mlp()


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_slow_checkpoint_write_outlasts_the_timeout(tmp_path, mpi_runner, backend):
    started = time.monotonic()
    result = mpi_runner(2, [
        "-m", "launcher.train", "--model", "tests.test_train_slow_checkpoint:slow_saving_mlp",
        "--backend", backend, "--timeout-s", str(TIMEOUT_S), "--max-steps", "4",
        "--checkpoint-every", "2", "--global-batch-size", "32", "--threads", "1",
        "--run-dir", str(tmp_path)], timeout=240)
    assert result.returncode == 0, result.output
    assert time.monotonic() - started > 2 * WRITE_S  # the writes really were slow
    assert len(list((tmp_path / "checkpoints").glob("ckpt-*.pt"))) >= 2, result.output
