"""Resume for ``launcher.train``: which checkpoint ``--resume`` names, and whether it fits.

``--resume auto`` takes the newest valid checkpoint (``Job.newest_checkpoint``: damaged ones
are skipped with a warning, files left by a writer killed mid-write are removed); ``none``
refuses to mix with an earlier run; a path takes that file (``Job.load``). A checkpoint of
another run (model, batch, seed, ...) is refused with the flags that differ, since the run would
not continue. One written by another number of ranks continues by global sample (the epoch's
order and each step's global batch do not depend on the world size, ``launcher.train``), as
long as its global batch divides into this run's ranks.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from launcher.api import checkpoint
from launcher.api.job import Job, resharded_note
from launcher.core.errors import LaunchError
from launcher.core.logging_utils import RankLog
from launcher.faults.agreement import agree
from launcher.training.batch_size import per_rank_batch
from launcher.training.config import TrainConfig

#: settings a resumed run must share with the checkpoint, or it would not continue the same run
RESUME_MUST_MATCH = ("model", "dataset", "global_batch_size", "grad_accum", "seed", "epochs",
                     "lr", "dropout")


def resume_state(config: TrainConfig, job: Job, log: RankLog) -> dict | None:
    """Collective: the checkpoint ``--resume`` names, on every rank's device (its RNG states
    are restored later, by the trainer, after everything that draws from them at build)."""
    if config.resume == "none":
        with agree():
            existing = checkpoint.list_checkpoints(config.checkpoint_dir) if job.is_main else []
            if existing:
                raise LaunchError(f"--resume none, but {config.checkpoint_dir} holds "
                                  f"checkpoints of an earlier run ({existing[-1].name})",
                                  hint="use a new --run-dir, delete the old checkpoints, or "
                                  "resume with --resume auto")
        return None
    if config.resume == "auto":
        path = job.newest_checkpoint(config.checkpoint_dir)
        if path is None:
            log.info(f"no checkpoint in {config.checkpoint_dir}: starting from scratch")
            return None
    else:
        path = Path(config.resume)
    state = job.load(path, restore_rng=False)
    with agree():
        _check_compatible(state, config, path, job.world_size)
    if note := resharded_note(path, state, job.world_size):  # the trainer reseeds
        log.info(note)
    log.info(f"resuming from {path} (step {state['step']}, epoch {state['epoch']}, "
             f"batch {state['batch']})")
    return state


def _check_compatible(state: dict, config: TrainConfig, path, world_size: int) -> None:
    if state.get("format") not in checkpoint.READABLE:
        raise LaunchError(f"{path} has an unknown checkpoint format {state.get('format')!r}",
                          hint="resume with the launcher version that wrote it")
    if "config" not in state:  # job.save adds no flags: a script's own, not launcher.train's
        raise LaunchError(f"{path} was not written by launcher.train (it holds no 'config': "
                          "the flags of the run)",
                          hint="resume it with the script that saved it, or give --resume a "
                          "checkpoint of launcher.train (RUN_DIR/checkpoints/ckpt-*.pt)")
    saved = state["config"]
    differ = [f"--{k.replace('_', '-')} {saved[k]} (now {getattr(config, k)})"
              for k in RESUME_MUST_MATCH if saved.get(k) != getattr(config, k)]
    if differ:
        raise LaunchError(f"{path} belongs to a run with other settings: {', '.join(differ)}",
                          hint="resume with the same flags, or start anew with another --run-dir")
    per_rank_batch(config.global_batch_size, world_size, config.grad_accum,
                   resumed=f"{path} continues a run of global batch {config.global_batch_size} "
                   f"(written by {state['world_size']} ranks)")


def load_weights(module: nn.Module, state: dict) -> None:
    # every rank loads the same file into the same model, so every rank fails alike: no collective
    try:
        module.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise LaunchError(f"the checkpoint's weights do not fit the model: "
                          f"{str(exc).splitlines()[0]}",
                          hint="resume with the model that wrote the checkpoint, or start anew "
                          "with another --run-dir") from None
