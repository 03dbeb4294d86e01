"""A model that raises (or spins) on one rank at one point: the fail-fast (and hang) tests'
fault-injection hook.

    FAULT_AT=build|step:K|spin:K|eval|checkpoint FAULT_RANK=R \
        python -m launcher.train --model tests.faulty_model:factory

- ``build``: the factory raises (model build, inside the process group);
- ``step:K``: the K-th training forward raises (a training step, mid-job);
- ``spin:K``: the K-th training forward loops for good (a hang: ``tests/test_hang.py``);
- ``eval``: the first evaluation forward after training started raises;
- ``checkpoint``: the first checkpoint written after training started fails while it is being
  encoded (rank 0 writes checkpoints, so use it with ``FAULT_RANK=0``).
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist
from torch import nn

MESSAGE = "injected fault"


def _fault(exc: Exception) -> Exception:
    """``exc``, after saying when (the tests measure how long the other ranks take to end) and
    which files of /dev/shm this rank maps (none may be left once the job has ended)."""
    print(f"fault injected at {time.time()}", file=sys.stderr, flush=True)
    with open("/proc/self/maps") as maps:
        shm = {line.split(maxsplit=5)[5].removesuffix(" (deleted)").strip()
               for line in maps if " /dev/shm/" in line}
    print(f"fault rank maps /dev/shm: {' '.join(sorted(shm))}", file=sys.stderr, flush=True)
    return exc


class _Unpicklable:
    """Fails the checkpoint's encoding, the way a broken object in a state dict would."""

    def __reduce__(self):
        raise _fault(RuntimeError(f"{MESSAGE} at checkpoint write"))


class FaultyModel(nn.Module):
    def __init__(self, at: str, armed: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
        self.at = at if armed else ""
        self.train_forwards = 0

    def forward(self, images):
        if self.training:
            self.train_forwards += 1
            if self.at == f"step:{self.train_forwards}":
                raise _fault(ValueError(f"{MESSAGE} at step {self.train_forwards}"))
            if self.at == f"spin:{self.train_forwards}":
                print(f"spinning since {time.monotonic()}", file=sys.stderr, flush=True)
                while True:
                    time.sleep(0.001)  # the spin
        elif self.at == "eval" and self.train_forwards:
            raise _fault(ValueError(f"{MESSAGE} at evaluation"))
        return self.net(images)

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        if self.at == "checkpoint" and self.train_forwards:
            state["unpicklable"] = _Unpicklable()
        return state


def factory() -> nn.Module:
    at, rank = os.environ["FAULT_AT"], int(os.environ.get("FAULT_RANK", "1"))
    armed = dist.get_rank() == rank
    if armed and at == "build":
        raise _fault(RuntimeError(f"{MESSAGE} at model build"))
    return FaultyModel(at, armed)
