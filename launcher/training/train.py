"""``python -m launcher.train``: DDP training that scales, survives preemption, resumes bit-exact.

Read top to bottom: ``main`` is the table of contents. The environment is detected, the process
group comes up (and always goes down again), ``Trainer.build`` prepares data, model and optimizer
and resumes from a checkpoint, ``Trainer.fit`` runs the epochs. Exit status: 0 done, 2 a user
error (the same message on every rank), 75 preempted after saving a checkpoint (requeue and run
the same command again: ``--resume auto`` continues where it stopped).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from launcher.api.job import Job, distributed, exit_statuses
from launcher.core.curves import Curves
from launcher.core.errors import EXIT_INTERRUPTED, LaunchError
from launcher.core.logging_utils import RankLog, parameter_sha256
from launcher.faults.agreement import agree
from launcher.placement.env import JobEnv
from launcher.training.config import TrainConfig, parse_args
from launcher.training.data import Dataset, load_dataset
from launcher.training.evaluation import autocast, evaluate
from launcher.training.gradient_sync import (
    allreduce_gradients,
    buffers_follow_rank_0,
    reads_buffers_in_training,
    wrap_for_sync,
)
from launcher.training.host_tuning import use_cores_fairly, use_deterministic_kernels
from launcher.training.models import ModelSpec, build_model, check_output
from launcher.training.resume import load_weights, resume_state


def main(argv: list[str] | None = None) -> None:
    with exit_statuses():
        config = parse_args(argv)
        with distributed(config.backend, config.timeout_s, config.run_dir) as job:
            train(config, job)


def train(config: TrainConfig, job: Job) -> None:
    """Build, fit, print the parameter hash. The trainer (and its DDP wrapper) lives in this
    frame only, so it is gone before the process group is torn down."""
    trainer = Trainer.build(config, job)
    try:
        trainer.fit()
    finally:
        trainer.log.close()
    print(f"param-sha256 rank={job.rank} {parameter_sha256(trainer.module)}", flush=True)


@dataclass
class StepTimes:
    """Seconds spent in one optimizer step, summed over its micro-batches."""

    forward: float = 0.0
    backward: float = 0.0  # with DDP this includes the all-reduce it overlaps
    comm: float = 0.0  # inside all-reduce: exact for --sync manual, futures' lifetime for DDP
    optimizer: float = 0.0


@dataclass
class Position:
    """Where training stands: the step count and the place in the epoch's batch order."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of the current epoch already consumed


@dataclass
class Trainer:
    config: TrainConfig
    job: Job
    log: RankLog
    data: Dataset
    spec: ModelSpec
    model: nn.Module  # what the step calls: the DDP wrapper, or the module itself (manual sync)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: DistributedSampler
    micro_batch: int
    #: whether buffers follow rank 0 before every forward (gradient_sync.reads_buffers_in_training)
    buffers_every_step: bool = True
    position: Position = field(default_factory=Position)
    comm_seconds: list[float] = field(default_factory=lambda: [0.0])
    last_saved: int = -1
    #: steps and seconds since the last report, for an honest average throughput
    interval: list[float] = field(default_factory=lambda: [0, 0.0])

    @property
    def module(self) -> nn.Module:
        return self.spec.module

    @property
    def env(self) -> JobEnv:
        return self.job.env

    @property
    def device(self) -> torch.device:
        return self.job.device

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sampler) // (self.micro_batch * self.config.grad_accum)

    # --- set-up -----------------------------------------------------------------------------

    @classmethod
    def build(cls, config: TrainConfig, job: Job) -> Trainer:
        env, device = job.env, job.device
        with agree():
            # the job's curves are RUN_DIR/tensorboard: launcher.train's status_dir is RUN_DIR
            log = _open_log(env, config, job.curves if config.tensorboard else None)
            binding = use_cores_fairly(config.threads, env, device, config.bind)
        if binding.how != "unbound":  # one line for the job: rank 0's; the others alike
            log.info(f"cores: {binding.how} (rank 0: {binding.describe()})")
        if config.deterministic:
            use_deterministic_kernels()
        if config.precision == "fp16" and device.type != "cuda":
            raise LaunchError("--precision fp16 needs a GPU (GradScaler); this rank runs on CPU",
                              hint="use --precision bf16 on CPU, or run on GPUs")
        data = load_dataset(config.dataset, config.data_dir, env.local_rank)
        spec = _build_checked_model(config, data, env)
        spec.module.to(device)
        # a checkpoint of another world size says first why its batch may not divide into this one
        state = resume_state(config, job, log)
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
        sampler = DistributedSampler(data.train, num_replicas=env.world_size, rank=env.rank,
                                     shuffle=True, seed=config.seed, drop_last=True)
        steps = config.epochs * (len(sampler) // (micro_batch * config.grad_accum))
        if steps == 0:
            raise LaunchError(f"--global-batch-size {config.global_batch_size} is larger than "
                              f"the {len(data.train)} training samples", hint="use a smaller one")
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
        trainer = cls(config, job, log, data, spec, spec.module, optimizer, scheduler,
                      scaler, sampler, micro_batch,
                      buffers_every_step=reads_buffers_in_training(spec.module))
        if env.is_distributed:
            trainer.model = wrap_for_sync(spec.module, config.sync, device, trainer.comm_seconds,
                                          trainer.buffers_every_step)
        if state is not None and state["step"] > 0:
            trainer._settle_ddp_buckets()  # before the RNG states are restored: it uses dropout
        # each rank its own dropout stream, derived from the one seed (init used the seed itself)
        torch.manual_seed(config.seed + 1 + env.rank)
        if state is not None:
            trainer._load_state(state)
        return trainer

    def _settle_ddp_buckets(self) -> None:
        """Collective: one discarded forward and backward, so resumed steps reduce like the rest.

        DDP reduces its first backward in one bucket of all parameters, then rebuilds its
        buckets in the order the gradients arrived. An all-reduce over 3 or more ranks adds in
        an order that depends on where a value sits in its bucket, so the first step after a
        resume, reduced in the first-iteration layout, would round differently from the same
        step of an uninterrupted run (2 ranks add a + b either way). This backward records the
        gradient order; the next forward rebuilds the buckets as the uninterrupted run did.
        Weights, buffers (batch-norm statistics) and gradients are left as they were.
        """
        if not isinstance(self.model, DistributedDataParallel):
            return
        buffers = [b.detach().clone() for b in self.module.buffers()]
        self._loss(torch.arange(self.micro_batch)).backward()
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        self.module.zero_grad(set_to_none=True)
        self.comm_seconds[0] = 0.0

    # --- checkpoints ------------------------------------------------------------------------

    def _state(self) -> dict:
        """The checkpoint contents (``Job.save`` adds the world size and every rank's RNG
        states). ``batch`` counts global batches: the same position on any number of ranks."""
        p = self.position
        return {
            "step": p.step, "epoch": p.epoch, "batch": p.batch, "config": self.config.to_dict(),
            "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
        }

    def _load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.job.restore_rng(state)
        self.position = Position(state["step"], state["epoch"], state["batch"])
        self.last_saved = state["step"]

    def save(self) -> Path:
        """Collective: rank 0 writes the checkpoint; every rank learns whether that worked."""
        step = self.position.step
        path = self.job.save(self.config.checkpoint_dir, step, self._state(),
                             samples=step * self.config.global_batch_size)
        self.last_saved = step
        return path

    # --- the loop ---------------------------------------------------------------------------

    def fit(self) -> None:
        config, p = self.config, self.position
        total = config.epochs * self.steps_per_epoch
        if p.epoch >= config.epochs:
            self.log.info(f"training already complete at step {p.step}: nothing to do "
                          f"(use a new --run-dir or --resume none to train again)")
            return
        start = time.perf_counter()
        while p.epoch < config.epochs:
            self.sampler.set_epoch(p.epoch)
            batches = self._epoch_batches()
            while p.batch < len(batches):
                t0 = time.perf_counter()
                if self.job.preempted():
                    self._preempt()
                if config.max_steps and p.step >= config.max_steps:
                    self._stop_early()
                    return
                loss, times, seconds = self._step(batches[p.batch])
                # throughput counts the step-boundary agreement too: it is a cost of every step
                self.interval[0] += 1
                self.interval[1] += time.perf_counter() - t0
                p.step += 1
                p.batch += 1
                if p.step % config.log_every == 0 or p.batch == len(batches):
                    self._report_step(loss, times, seconds, total)
                if config.checkpoint_every and p.step % config.checkpoint_every == 0:
                    self.save()
            self._report_eval(self.evaluate())
            p.epoch += 1
            p.batch = 0
        # saved even when this step already was: the final checkpoint records the run as done
        path = self.save()
        self.log.info(f"saved {path}")
        self.log.info(f"done: {p.step} steps in {time.perf_counter() - start:.1f} s")

    def _epoch_batches(self) -> list[torch.Tensor]:
        per_step = self.micro_batch * self.config.grad_accum
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        return [order[i * per_step:(i + 1) * per_step] for i in range(self.steps_per_epoch)]

    def _step(self, indices: torch.Tensor) -> tuple[float, StepTimes, float]:
        """One optimizer step over ``indices`` (this rank's share of the global batch)."""
        times, started = StepTimes(), time.perf_counter()
        self.comm_seconds[0] = 0.0
        micro = indices.split(self.micro_batch)
        total_loss = 0.0
        for i, idx in enumerate(micro):
            last = i == len(micro) - 1
            skip_sync = isinstance(self.model, DistributedDataParallel) and not last
            with self.model.no_sync() if skip_sync else nullcontext():
                t0 = time.perf_counter()
                loss = self._loss(idx) / len(micro)
                t1 = time.perf_counter()
                self.scaler.scale(loss).backward()
                times.forward += t1 - t0
                times.backward += time.perf_counter() - t1
            total_loss += loss.item()
        if self.config.sync == "manual" and self.env.is_distributed:
            t0 = time.perf_counter()
            allreduce_gradients(self.module)
            self.comm_seconds[0] += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run asynchronously: wait to time them
        times.optimizer = time.perf_counter() - t0
        times.comm = self.comm_seconds[0]
        return total_loss, times, time.perf_counter() - started

    def _loss(self, idx: torch.Tensor) -> torch.Tensor:
        inputs = self.data.train.inputs[idx].to(self.device, non_blocking=True)
        targets = self.data.train.targets[idx].to(self.device, non_blocking=True)
        if self.config.sync == "manual" and self.env.is_distributed and self.buffers_every_step:
            buffers_follow_rank_0(self.module)  # what DDP's broadcast_buffers does
        with self._autocast():
            return self.spec.loss(self.model(inputs), inputs, targets)

    def _autocast(self):
        return autocast(self.device, self.config.precision)

    def evaluate(self) -> dict[str, float]:
        """Collective: loss (and accuracy) on the held-out split, over all ranks."""
        return evaluate(self.spec, self.data.test, self.env, self.device, self.config.precision)

    # --- stopping ---------------------------------------------------------------------------

    def _preempt(self) -> None:
        path = self.save()
        status = self.job.watch.stop_status
        self.log.info(f"{'Ctrl-C' if status == EXIT_INTERRUPTED else 'preemption signal'} "
                      f"received: saved {path} at step {self.position.step}; exiting with "
                      f"{status} (run the same command again to resume)")
        self.job.exit_preempted(path)

    def _stop_early(self) -> None:
        if self.last_saved != self.position.step:
            path = self.save()
            self.log.info(f"saved {path}")
        self.log.info(f"stopped at --max-steps {self.config.max_steps}")

    # --- reporting --------------------------------------------------------------------------

    def _report_step(self, loss: float, times: StepTimes, seconds: float, total: int) -> None:
        """Collective: the loss averaged over ranks; rank 0 logs it and writes a metrics line."""
        if self.env.is_distributed:
            mean = torch.tensor([loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(mean)
            loss = mean.item() / self.env.world_size
        p = self.position
        steps, elapsed = self.interval
        rate = steps * self.config.global_batch_size / elapsed
        self.interval[:] = [0, 0.0]
        self.log.metrics({
            "event": "step", "step": p.step, "epoch": p.epoch, "loss": loss,
            "lr": self.scheduler.get_last_lr()[0], "samples_per_s": rate, "t_step": seconds,
            "t_forward": times.forward, "t_backward": times.backward, "t_comm": times.comm,
            "t_optimizer": times.optimizer, "t_compute": max(seconds - times.comm, 0.0),
        })
        self.log.progress(p.step, total, f"epoch {p.epoch} loss {loss:.4f} {rate:.0f} samples/s")

    def _report_eval(self, result: dict[str, float]) -> None:
        p = self.position
        self.log.metrics({"event": "eval", "step": p.step, "epoch": p.epoch, **result})
        text = " ".join(f"{key} {value:.4f}" for key, value in result.items())
        self.log.info(f"epoch {p.epoch} step {p.step}: {text}")


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


