"""How a global batch splits into ranks and micro-batches: the one rule, without torch, so that
``launcher.train --help`` and the flag checks run before torch is imported."""

from __future__ import annotations

from launcher.core.errors import LaunchError


def per_rank_batch(global_batch_size: int, world_size: int, micro_batches: int = 1,
                   resumed: str = "") -> int:
    """Samples per micro-batch on each rank: the one rule for how a global batch splits. A
    LaunchError naming the world sizes that fit when it does not split evenly; ``resumed``
    (the checkpoint the batch comes from) says why the batch cannot change instead."""
    parts = world_size * micro_batches
    if global_batch_size % parts == 0:
        return global_batch_size // parts
    fits = ", ".join(str(n) for n in range(1, global_batch_size + 1)
                     if global_batch_size % (n * micro_batches) == 0)
    split = f"does not divide into {world_size} ranks x {micro_batches} micro-batches"
    if resumed:
        raise LaunchError(f"{resumed}, which {split}",
                          hint=f"resume it on a number of ranks that divides the batch: {fits}")
    raise LaunchError(f"a global batch of {global_batch_size} samples {split}",
                      hint=f"run on {fits} ranks, or choose a global batch that is a multiple "
                      f"of {parts}")
