"""Resume: rank 0 picks the checkpoint, every rank loads it onto its own device and checks it.

``--resume auto`` takes the newest valid checkpoint (damaged ones are skipped with a warning,
files left by a writer killed mid-write are removed); ``none`` refuses to mix with an earlier
run; a path takes that file. A checkpoint of another run (world size, model, batch, seed, ...)
is refused with the flags that differ, since the run would not continue bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from launcher import checkpoint
from launcher.agreement import agree
from launcher.config import TrainConfig
from launcher.env import JobEnv
from launcher.errors import LaunchError
from launcher.logging_utils import RankLog
from launcher.process_group import DistContext

#: settings a resumed run must share with the checkpoint, or it would not continue the same run
RESUME_MUST_MATCH = ("model", "dataset", "global_batch_size", "grad_accum", "seed", "epochs",
                     "lr", "dropout")



def resume_state(config: TrainConfig, ctx: DistContext, log: RankLog) -> dict | None:
    """Collective: rank 0 picks the checkpoint, every rank loads it onto its own device."""
    env = ctx.env
    path = None
    with agree():
        if env.is_main:
            path = _choose_checkpoint(config, log)
    chosen = [path]
    if env.is_distributed:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    with agree():
        state = checkpoint.load(chosen[0], map_location=ctx.device)
        _check_compatible(state, config, env, chosen[0])
    log.info(f"resuming from {chosen[0]} (step {state['step']}, epoch {state['epoch']}, "
             f"batch {state['batch']})")
    return state


def _choose_checkpoint(config: TrainConfig, log: RankLog):
    directory = config.checkpoint_dir
    for stale in directory.glob(".ckpt-*.tmp") if directory.is_dir() else ():
        log.warn(f"removing {stale}, left by a writer that was killed mid-write")
        stale.unlink(missing_ok=True)
    if config.resume == "none":
        existing = checkpoint.list_checkpoints(directory)
        if existing:
            raise LaunchError(f"--resume none, but {directory} holds checkpoints of an earlier "
                              f"run ({existing[-1].name})",
                              hint="use a new --run-dir, delete the old checkpoints, or resume "
                              "with --resume auto")
        return None
    if config.resume == "auto":
        path = checkpoint.newest_valid(directory, log.warn)
        if path is None:
            log.info(f"no checkpoint in {directory}: starting from scratch")
        return path
    path = Path(config.resume)
    checkpoint.load(path)  # a LaunchError names the problem (missing, truncated, damaged)
    return path


def _check_compatible(state: dict, config: TrainConfig, env: JobEnv, path) -> None:
    if state.get("format") != 1:
        raise LaunchError(f"{path} has an unknown checkpoint format {state.get('format')!r}",
                          hint="resume with the launcher version that wrote it")
    if state["world_size"] != env.world_size:
        raise LaunchError(
            f"{path} was written by {state['world_size']} ranks, this run has {env.world_size}",
            hint=f"resume with {state['world_size']} ranks: data order and per-rank random "
            "streams depend on the world size, so bit-exact resume needs the same number")
    saved = state["config"]
    differ = [f"--{k.replace('_', '-')} {saved[k]} (now {getattr(config, k)})"
              for k in RESUME_MUST_MATCH if saved.get(k) != getattr(config, k)]
    if differ:
        raise LaunchError(f"{path} belongs to a run with other settings: {', '.join(differ)}",
                          hint="resume with the same flags, or start anew with another --run-dir")


def load_weights(module: nn.Module, state: dict) -> None:
    # every rank loads the same file into the same model, so every rank fails alike: no collective
    try:
        module.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise LaunchError(f"the checkpoint's weights do not fit the model: "
                          f"{str(exc).splitlines()[0]}",
                          hint="resume with the model that wrote the checkpoint, or start anew "
                          "with another --run-dir") from None
