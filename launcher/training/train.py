"""``python -m launcher.train``: DDP training that scales, survives preemption, resumes bit-exact.

Read top to bottom: ``main`` is the table of contents. The environment is detected, the process
group comes up (and always goes down again), ``build_trainer`` (``launcher.training.setup``)
prepares data, model and optimizer and resumes from a checkpoint, ``Trainer.fit``
(``launcher.training.loop``) runs the epochs. Exit status: 0 done, 2 a user error (the same
message on every rank), 75 preempted after saving a checkpoint (requeue and run the same command
again: ``--resume auto`` continues where it stopped).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from launcher.faults.exits import exit_statuses
from launcher.training.config import TrainConfig, parse_args

if TYPE_CHECKING:
    from launcher.api.job import Job


def main(argv: list[str] | None = None) -> None:
    with exit_statuses() as env:
        config = parse_args(argv)
        # torch only from here on: a bad flag above ends every rank in a tenth of a second,
        # not after the second or more that importing torch costs each of them
        from launcher.api.job import distributed

        with distributed(config.backend, config.timeout_s, config.run_dir, env) as job:
            train(config, job)


def train(config: TrainConfig, job: Job) -> None:
    """Build, fit, print the parameter hash. The trainer (and its DDP wrapper) lives in this
    frame only, so it is gone before the process group is torn down."""
    from launcher.core.logging_utils import parameter_sha256
    from launcher.training.setup import build_trainer

    # Job.keep is the API's default, for scripts of their own; --keep is this run's
    trainer = build_trainer(config, dataclasses.replace(job, keep=config.keep))
    try:
        trainer.fit()
    finally:
        trainer.log.close()
    print(f"param-sha256 rank={job.rank} {parameter_sha256(trainer.module)}", flush=True)
