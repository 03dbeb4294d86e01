"""The training configuration: one dataclass, its validation, and the command line built from it.

Each field's docstring is its ``--help`` text, so the flags and their documentation cannot drift
apart. Validation that needs no process group lives in ``__post_init__``; it runs identically on
every rank, so every rank stops with the same error and nobody waits in a collective.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from launcher.core.defaults import TIMEOUT_S
from launcher.core.errors import LaunchError
from launcher.core.field_docs import field_docs
from launcher.group.backends import BACKEND_CHOICES
from launcher.placement import cpus
from launcher.training.batch_size import per_rank_batch

#: the built-in data sets and models (``launcher.training.data``, ``.models``): named here, a
#: leaf without torch, so that ``--help`` and flag checks need no torch import
DATASETS = ("digits", "mnist", "synthetic")
BUILTIN = ("mlp", "autoencoder", "cnn")

PRECISIONS = ("fp32", "bf16", "fp16")
SYNC_MODES = ("ddp", "manual")


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``python -m launcher.train`` can be told; the defaults are a short useful run."""

    model: str = "mlp"
    """mlp (classifier), autoencoder (MLP auto-encoder; try --lr 1), cnn (small CNN with batch
    norm: SyncBatchNorm across GPUs; on CPU, where PyTorch has no SyncBatchNorm, each rank
    normalises its own batch, and evaluations and checkpoints use rank 0's running statistics),
    or package.module:factory for your own model: factory() returns an nn.Module that takes the
    dataset's inputs; it is trained on its own loss(outputs, targets) method if it has one, else
    on cross-entropy over the output's last dimension for integer targets (logits [B, ...,
    classes] for targets [B, ...], with accuracy), or MSE for float targets"""

    dataset: str = "digits"
    """digits: scikit-learn's 1797 8x8 digits resized to 28x28, fixed 80/20 split (no download);
    mnist: the four MNIST IDX files (raw or .gz) in --data-dir; synthetic: random images for
    benchmarks; or package.module:factory for your own: factory() returns ((train_inputs,
    train_targets), (test_inputs, test_targets)), tensors of any shape, samples first"""

    data_dir: Path = Path("data")
    """where MNIST's IDX files are and where the prepared cache (DATA_DIR/cache) is written; may
    be node-local: local rank 0 of each node prepares it"""

    run_dir: Path = Path("runs/train")
    """checkpoints (RUN_DIR/checkpoints) and metrics (RUN_DIR/metrics.jsonl) go here; must be on
    a file system every rank can read when resuming on several nodes"""

    epochs: int = 10
    """passes over the training split"""

    global_batch_size: int = 64
    """samples per optimizer step summed over all ranks; must divide by world size x grad-accum"""

    grad_accum: int = 1
    """micro-batches per optimizer step on each rank (gradients are only synchronised on the
    last, through DDP no_sync)"""

    lr: float = 0.1
    """peak learning rate of SGD with momentum 0.9, cosine-annealed to 0 over all steps"""

    dropout: float = 0.1
    """dropout probability of the built-in models (0 turns dropout off)"""

    seed: int = 0
    """one seed for everything: model initialisation (the same on every rank), data order, and
    each rank's dropout stream (derived from seed and rank)"""

    precision: str = "fp32"
    """fp32; bf16 (torch.autocast on CPU and GPU); fp16 (autocast plus GradScaler, GPU only)"""

    deterministic: bool = False
    """deterministic GPU kernels (torch.use_deterministic_algorithms, cuDNN without autotuning,
    CUBLAS_WORKSPACE_CONFIG=:4096:8): without it convolutions on GPU round differently from run
    to run, so a resumed CNN run drifts from an uninterrupted one; slower. CPU runs are
    deterministic anyway"""

    sync: str = "ddp"
    """ddp (DistributedDataParallel, all-reduce overlapped with backward) or manual (the classic
    synchronous SGD: weights broadcast from rank 0, gradients all-reduced and averaged after
    backward); both give the same weights"""

    backend: str = "auto"
    """torch.distributed backend: auto (nccl with GPUs; on CPU mpi under Hydra's mpiexec or
    srun --mpi=pmi2 with the image's MPICH, else gloo), gloo, nccl, mpi (native, or the mpi4py
    backend when torch has none)"""

    checkpoint_every: int = 50
    """save a checkpoint every N optimizer steps (0: only at the end and on preemption)"""

    keep: int = 3
    """how many of the newest checkpoints to keep"""

    resume: str = "auto"
    """auto: continue from the newest valid checkpoint in RUN_DIR/checkpoints if there is one
    (damaged ones are skipped with a warning); none: start from scratch, refused when
    RUN_DIR/checkpoints holds checkpoints already (two runs must not mix); or a checkpoint path"""

    max_steps: int = 0
    """stop (with a checkpoint) after this many optimizer steps in total, 0 for no limit; the
    learning-rate schedule still spans --epochs, so a later resume continues it exactly"""

    metrics: Path | None = None
    """JSON-lines metrics file, appended to by rank 0 (default RUN_DIR/metrics.jsonl)"""

    log_every: int = 10
    """log (and record metrics) every N optimizer steps"""

    tensorboard: bool = False
    """also write the metrics as TensorBoard curves to RUN_DIR/tensorboard (rank 0; each step
    once across requeues and resumes): tensorboard --logdir RUN_DIR/tensorboard"""

    threads: int = 0
    """torch threads per rank on CPU; 0: the cores this process may use divided by the ranks on
    its node (more threads than free cores make every step far slower on a busy machine)"""

    bind: str = "auto"
    """CPU binding of the ranks sharing a node: cores (disjoint CPU sets in NUMA order), numa
    (whole NUMA nodes), none, or auto (cores when a CPU node has several ranks and a CPU for
    each); on GPU hosts auto and numa give each rank CPUs of its GPU's NUMA node where sysfs
    names it; a mask the launcher set (srun --cpu-bind, mpirun --bind-to) is always kept"""

    timeout_s: float = TIMEOUT_S
    """seconds a collective, and each start-up stage (+10 s), may wait on a peer that no
    longer beats before the job ends with exit 3; waits on live peers (a checkpoint write, an
    agreement) may run up to 10 times as long"""

    def __post_init__(self) -> None:
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--sync", self.sync, SYNC_MODES)
        _choice("--bind", self.bind, cpus.MODES)
        _choice("--backend", self.backend, BACKEND_CHOICES)
        if ":" not in self.dataset:
            _choice("--dataset", self.dataset, DATASETS)
        if self.model not in BUILTIN and ":" not in self.model:
            raise LaunchError(f"unknown model {self.model!r}",
                              hint=f"use --model {'|'.join(BUILTIN)} or package.module:factory")
        for flag, value in (("--epochs", self.epochs), ("--global-batch-size",
                            self.global_batch_size), ("--grad-accum", self.grad_accum),
                            ("--keep", self.keep), ("--log-every", self.log_every)):
            if value < 1:
                raise LaunchError(f"{flag} must be at least 1, got {value}",
                                  hint=f"pass {flag} 1 or more")
        for flag, value in (("--checkpoint-every", self.checkpoint_every),
                            ("--max-steps", self.max_steps), ("--threads", self.threads)):
            if value < 0:
                raise LaunchError(f"{flag} must be 0 or more, got {value}",
                                  hint=f"pass {flag} 0 to turn it off")
        if not self.lr > 0:
            raise LaunchError(f"--lr must be positive, got {self.lr}", hint="e.g. --lr 0.05")
        if not 0 <= self.dropout < 1:
            raise LaunchError(f"--dropout must be in [0, 1), got {self.dropout}",
                              hint="e.g. --dropout 0.1, or 0 for none")
        if not self.timeout_s > 0:
            raise LaunchError(f"--timeout-s must be positive, got {self.timeout_s}",
                              hint="e.g. --timeout-s 300")

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.metrics if self.metrics is not None else self.run_dir / "metrics.jsonl"

    def per_rank_batch(self, world_size: int) -> int:
        """Samples per micro-batch on each rank; a LaunchError when the split is not even."""
        return per_rank_batch(self.global_batch_size, world_size, self.grad_accum)

    def to_dict(self) -> dict[str, object]:
        """Plain values only (for the checkpoint, which is loaded with weights_only)."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v)
                for f in dataclasses.fields(self)}


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LaunchError(f"{flag} {value!r} is not one of {', '.join(choices)}",
                          hint=f"pass {flag} {'|'.join(choices)}")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a LaunchError like every other user error."""

    def error(self, message: str):
        raise LaunchError(message, hint="see python -m launcher.train --help")


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, but not None: that field's doc says what it means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m launcher.train",
                     description="DDP training of a small model on 28x28 digits. Survives "
                     "preemption (SIGUSR1/SIGTERM: checkpoint, exit 75) and resumes bit-exact.",
                     formatter_class=_DefaultsShown)
    docs = field_docs(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(field.default, bool):
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=field.default, help=docs[field.name])
            continue
        kind = {int: int, float: float}.get(type(field.default), str)
        parser.add_argument(flag, dest=field.name, type=kind, default=field.default,
                            help=docs[field.name])
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a validated ``TrainConfig``; a LaunchError when it is not valid."""
    values = vars(build_parser().parse_args(argv))
    for name in ("data_dir", "run_dir", "metrics"):
        if values[name] is not None:
            values[name] = Path(values[name])
    return TrainConfig(**values)
