"""Global batches that do not depend on the world size, so a run resumes on any number of ranks.

Epoch ``e`` orders the samples by ``torch.randperm`` seeded with ``seed + e`` (as
``DistributedSampler`` does); step ``k`` of it is the global batch at positions ``[kG, (k+1)G)``
of that order, and rank ``r`` of ``W`` takes every ``W``-th of them (``DistributedSampler`` with
``drop_last=True`` hands out the same shares). The global batch of a step is the same set of
samples whatever ``W`` is, so the global sample position a checkpoint records (``samples``: steps
times ``G``) continues on any number of ranks that ``G`` divides into.

A leaf module: it takes the rank and the world size as numbers and needs no process group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from launcher.core.errors import LaunchError
from launcher.training.batch_size import per_rank_batch


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's share of each global batch, from a global sample position to the end of its
    epoch: ``DataLoader(dataset, batch_sampler=GlobalBatchSampler(...))``. Call
    ``start_at(step * global_batch_size)`` before each pass over the loader."""

    def __init__(self, size: int, global_batch_size: int, rank: int, world_size: int,
                 seed: int = 0):
        per_rank_batch(global_batch_size, world_size)
        if not 0 < global_batch_size <= size:
            raise LaunchError(f"a global batch of {global_batch_size} samples does not fit "
                              f"the {size} samples of the dataset",
                              hint="choose a global batch between 1 and the dataset's size")
        self.size, self.global_batch_size, self.seed = size, global_batch_size, seed
        self.rank, self.world_size = rank, world_size
        #: global batches in one epoch (the last, incomplete one is dropped)
        self.steps_per_epoch = size // global_batch_size
        self.samples = 0

    def start_at(self, samples: int) -> None:
        """Continue from the global sample position ``samples`` (a whole number of steps)."""
        if samples % self.global_batch_size:
            raise LaunchError(f"global sample position {samples} is not a whole number of "
                              f"global batches of {self.global_batch_size}",
                              hint="pass step * global_batch_size")
        self.samples = samples

    @property
    def epoch(self) -> int:
        return self.samples // self.global_batch_size // self.steps_per_epoch

    def __len__(self) -> int:
        """The steps left in the current epoch."""
        return self.steps_per_epoch - self.samples // self.global_batch_size % self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(
            self.seed + self.epoch))
        batch = self.global_batch_size
        for step in range(self.steps_per_epoch - len(self), self.steps_per_epoch):
            yield order[step * batch:(step + 1) * batch][self.rank::self.world_size].tolist()
