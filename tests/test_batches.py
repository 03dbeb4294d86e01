"""GlobalBatchSampler: each step's global batch is the same samples on any number of ranks."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from launcher.core.errors import LaunchError
from launcher.training.batches import GlobalBatchSampler

SIZE, BATCH = 1438, 48  # the digits training split, the global batch


def shares(world_size: int, samples: int) -> list[list[list[int]]]:
    """Per step from ``samples`` on: every rank's share, rank by rank."""
    per_rank = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(SIZE, BATCH, rank, world_size, seed=3)
        sampler.start_at(samples)
        per_rank.append(list(sampler))
    return [list(step) for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_step_takes_the_same_samples_on_any_world_size(world_size):
    reference = [sorted(sum(step, [])) for step in shares(1, 40 * BATCH)]
    steps = shares(world_size, 40 * BATCH)  # step 40: epoch 1 (29 steps each), step 11 of it
    assert len(steps) == 29 - 11
    assert [sorted(sum(step, [])) for step in steps] == reference
    assert all(len(share) == BATCH // world_size for step in steps for share in step)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shares_are_those_of_distributed_sampler(world_size):
    for rank in range(world_size):
        sampler = GlobalBatchSampler(SIZE, BATCH, rank, world_size, seed=3)
        sampler.start_at(29 * BATCH)  # the start of epoch 1
        reference = DistributedSampler(range(SIZE), world_size, rank, shuffle=True, seed=3,
                                       drop_last=True)
        reference.set_epoch(1)
        order, share = list(reference), BATCH // world_size
        assert list(sampler) == [order[i * share:(i + 1) * share] for i in range(29)]


def test_len_counts_the_steps_left_in_the_epoch():
    sampler = GlobalBatchSampler(SIZE, BATCH, 0, 2)
    sampler.start_at(30 * BATCH)
    assert (sampler.epoch, len(sampler)) == (1, 28)


@pytest.mark.parametrize("args, message", [
    ((SIZE, 64, 0, 3), "a global batch of 64 samples does not divide into 3 ranks"),
    ((10, 16, 0, 2), "does not fit the 10 samples"),
], ids=["indivisible", "too-large"])
def test_a_batch_that_cannot_be_split_is_one_error(args, message):
    with pytest.raises(LaunchError, match=message) as info:
        GlobalBatchSampler(*args)
    assert info.value.hint


def test_a_position_inside_a_batch_is_refused():
    with pytest.raises(LaunchError, match="not a whole number of global batches"):
        GlobalBatchSampler(SIZE, BATCH, 0, 2).start_at(50)
