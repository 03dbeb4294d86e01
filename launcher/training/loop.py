"""The training loop: ``Trainer.fit`` runs the epochs step by step, saves checkpoints, answers
preemption at step boundaries and reports loss, throughput and evaluation. Set-up:
``launcher.training.setup``."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.api.job import Job
from launcher.core.errors import EXIT_INTERRUPTED
from launcher.core.logging_utils import RankLog
from launcher.placement.env import JobEnv
from launcher.training.batches import GlobalBatchSampler
from launcher.training.config import TrainConfig
from launcher.training.data import Dataset
from launcher.training.evaluation import autocast, evaluate
from launcher.training.gradient_sync import allreduce_gradients, buffers_follow_rank_0
from launcher.training.models import ModelSpec


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
    sampler: GlobalBatchSampler
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
        return self.sampler.steps_per_epoch

    def start(self, state: dict | None) -> None:
        """Continue from ``state`` (a checkpoint's, ``launcher.training.resume``) or start
        anew: the optimizer, schedule, RNG states and position come from the checkpoint."""
        if state is not None and state["step"] > 0:
            self._settle_ddp_buckets()  # before the RNG states are restored: it uses dropout
        # each rank its own dropout stream, derived from the one seed (init used the seed itself)
        torch.manual_seed(self.config.seed + 1 + self.env.rank)
        if state is not None:
            self._load_state(state)

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
        load_scaler(self.scaler, state["scaler"])
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
            # not --resume none: that refuses a directory holding an earlier run's checkpoints
            self.log.info(f"training already complete at step {p.step}: nothing to do (to "
                          f"train again: a new --run-dir, or remove {config.checkpoint_dir})")
            return
        start = time.perf_counter()
        while p.epoch < config.epochs:
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
        """This rank's share of each global batch of the current epoch, from its first step."""
        self.sampler.start_at(self.position.epoch * self.steps_per_epoch
                              * self.config.global_batch_size)
        return [torch.tensor(batch, dtype=torch.long) for batch in self.sampler]

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


def load_scaler(scaler: torch.amp.GradScaler, saved: dict) -> None:
    """``saved`` into ``scaler``. A run without --precision fp16 saves a disabled scaler's
    empty state, which an enabled one refuses: an fp16 resume of it starts a fresh scaler, as
    an fp16 run starts."""
    if saved:
        scaler.load_state_dict(saved)
