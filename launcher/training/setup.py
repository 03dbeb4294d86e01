"""Setting up a training run: data, the checked model, optimizer, schedule and the trainer,
resumed from a checkpoint when ``--resume`` names one (``launcher.training.resume``)."""

from __future__ import annotations

import torch
from torch import nn

from launcher.api.job import Job
from launcher.core.curves import Curves
from launcher.core.errors import LaunchError
from launcher.core.logging_utils import RankLog
from launcher.faults.agreement import agree
from launcher.placement.env import JobEnv
from launcher.training.batches import GlobalBatchSampler
from launcher.training.config import TrainConfig
from launcher.training.data import Dataset, load_dataset
from launcher.training.gradient_sync import reads_buffers_in_training, wrap_for_sync
from launcher.training.host_tuning import use_cores_fairly, use_deterministic_kernels
from launcher.training.loop import Trainer
from launcher.training.models import ModelSpec, build_model, check_output
from launcher.training.resume import load_weights, resume_state


def build_trainer(config: TrainConfig, job: Job) -> Trainer:
    """Data, model, optimizer and schedule on every rank alike, resumed from the checkpoint
    ``--resume`` names: the trainer ``fit`` runs."""
    env, device = job.env, job.device
    with agree():
        # the job's curves are RUN_DIR/tensorboard: launcher.train's status_dir is RUN_DIR
        log = _open_log(env, config, job.curves if config.tensorboard else None)
        binding = use_cores_fairly(config.threads, env, device, config.bind)
    if binding.how != "unbound":  # one line for the job: rank 0's; the others alike
        log.info(f"cores: {binding.how} (rank 0: {binding.describe()})")
    if config.deterministic:
        use_deterministic_kernels()
    # user errors below are agreed: each rank raises the same one, so exit-status keeps it
    with agree():
        if config.precision == "fp16" and device.type != "cuda":
            raise LaunchError("--precision fp16 needs a GPU (GradScaler); this rank runs "
                              "on CPU", hint="use --precision bf16 on CPU, or run on GPUs")
    data = load_dataset(config.dataset, config.data_dir, env.local_rank)
    spec = _build_checked_model(config, data, env)
    spec.module.to(device)
    # a checkpoint of another world size says first why its batch may not divide into this one
    state = resume_state(config, job, log)
    with agree():
        micro_batch = config.per_rank_batch(env.world_size)
    log.info(f"training {config.model} on {config.dataset}: {env.world_size} rank(s), "
             f"backend {job.backend}, device {device.type}, global batch "
             f"{config.global_batch_size} = {env.world_size} x {config.grad_accum} x "
             f"{micro_batch}, sync {config.sync}, precision {config.precision}")
    if state is not None:
        load_weights(spec.module, state)
    if device.type == "cuda" and env.is_distributed:
        spec = ModelSpec(nn.SyncBatchNorm.convert_sync_batchnorm(spec.module), spec.task)
    optimizer = torch.optim.SGD(spec.module.parameters(), lr=config.lr, momentum=0.9)
    with agree():
        sampler = GlobalBatchSampler(len(data.train), config.global_batch_size, env.rank,
                                     env.world_size, seed=config.seed)
    steps = config.epochs * sampler.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    trainer = Trainer(config, job, log, data, spec, spec.module, optimizer, scheduler, scaler,
                      sampler, micro_batch,
                      buffers_every_step=reads_buffers_in_training(spec.module))
    if env.is_distributed:
        trainer.model = wrap_for_sync(spec.module, config.sync, device, trainer.comm_seconds,
                                      trainer.buffers_every_step)
    trainer.start(state)
    return trainer


def _open_log(env: JobEnv, config: TrainConfig, curves: Curves | None) -> RankLog:
    """Rank 0's log and metrics file; a run directory it cannot write is a user error."""
    try:
        return RankLog(env.is_main, config.metrics_path, curves=curves)
    except OSError as exc:
        raise LaunchError(f"cannot write the metrics file {config.metrics_path}: {exc.strerror}",
                          hint="pass a --run-dir (or --metrics) that is a writable directory or "
                          "can be created as one") from None


def _build_checked_model(config: TrainConfig, data: Dataset, env: JobEnv) -> ModelSpec:
    """The model, built the same way on every rank; a bad one is an error on all ranks."""
    with agree():
        torch.manual_seed(config.seed)
        spec = build_model(config.model, data.num_classes, config.dropout, data.float_targets)
        check_output(spec, data.train.inputs[:2], data.train.targets[:2], data.num_classes,
                     config.model)
    return spec
