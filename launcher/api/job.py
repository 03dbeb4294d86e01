"""The public API: what a training script of your own needs to run under every launcher.

    import launcher

    with launcher.distributed() as job:            # mpiexec, mpirun, srun, torchrun, python
        model = job.wrap(Net())                      # DDP on this rank's device
        state = job.resume(CHECKPOINTS)             # newest valid checkpoint, or None
        first_step = 0 if state is None else state["step"]   # save stored it
        for step in range(first_step, steps):
            if job.preempted():                     # the same answer on every rank
                job.save(CHECKPOINTS, step, {"model": model.module.state_dict(), ...})
                job.exit_preempted()                # exit 75 everywhere: requeue, rerun
            ...

``distributed`` detects the launch environment, loads the right MPI, starts the process group
(``backend="auto"`` as ``launcher.train`` does, or any backend by name), binds this rank's
device, watches for the preemption signal and always tears everything down. It also ends the
process the way ``launcher.train`` does: a ``LaunchError`` prints ``error:`` and ``HINT:`` and
exits 2 on every rank; an exception on one rank ends every rank within seconds, naming it
(exit 70, ``launcher.faults.failfast``); a lost peer exits 3; ranks alive but not meeting
exit 4 with one line saying who is where (``launcher.faults.hang_watch``); ``exit_preempted``
exits 75 (130 after Ctrl-C, ``launcher.faults.preemption``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.api import checkpoint
from launcher.core import rank_output
from launcher.core.curves import Curves
from launcher.core.defaults import TIMEOUT_S
from launcher.core.errors import EXIT_PREEMPTED, LaunchError, Preempted
from launcher.core.logging_utils import print_lines
from launcher.faults import exit_status, rank_record
from launcher.faults.agreement import agree
from launcher.faults.exits import exit_statuses
from launcher.faults.preemption import PreemptionWatch, nccl_clash
from launcher.group.process_group import process_group
from launcher.placement.env import JobEnv


@dataclass(frozen=True)
class Job:
    """This rank's place in the job, and the collective helpers every training script needs."""

    env: JobEnv
    #: the torch backend in use: "nccl", "gloo", "mpi" (native), "mpi_cxx" (compiled) or "mpi4py"
    backend: str
    #: this rank's device: ``cuda:<index>`` with a GPU per local rank, else ``cpu``
    device: torch.device
    watch: PreemptionWatch
    #: how many of the newest checkpoints ``save`` keeps
    keep: int = 3
    #: rank 0's TensorBoard curves in ``status_dir/tensorboard`` (None without a status_dir)
    curves: Curves | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def num_nodes(self) -> int:
        return self.env.num_nodes

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints."""
        return self.env.is_main

    @property
    def device_ids(self) -> list[int] | None:
        """What ``DistributedDataParallel(device_ids=...)`` wants for ``device``."""
        return [self.device.index] if self.device.type == "cuda" else None

    @contextmanager
    def main_first(self, per_node: bool = True) -> Iterator[None]:
        """Collective: the body runs first on each node's local rank 0 (``per_node``: a
        download or a cache on node-local disk) or on rank 0 alone (``per_node=False``: one
        shared file system), then on every other rank, once all the first ones are done:
        never ranks writing one file at once. The body must not call collectives (the ranks
        run it at different times). The others' wait is busy, not a hang, for up to
        ``heartbeat.BUSY_LIMIT`` times ``timeout_s``; a ``LaunchError`` in a first rank's body
        is raised on every rank (``agree``)."""
        first = self.local_rank == 0 if per_node else self.is_main
        if first:
            with agree():
                yield
        else:
            with agree():
                pass
            yield

    def wrap(self, module: nn.Module, **options) -> DistributedDataParallel:
        """``module`` on this rank's device in ``DistributedDataParallel(module, device_ids=,
        **options)``. Its gradient all-reduces are in the flight recorder, as those of any DDP
        built under ``launcher.distributed()`` (``launcher.faults.ddp_steps``)."""
        return DistributedDataParallel(module.to(self.device), device_ids=self.device_ids,
                                       **options)

    def print(self, *values: object, every_rank: bool = False, sep: str = " ",
              file: TextIO | None = None) -> None:
        """``print`` on rank 0 only, flushed (job logs of many ranks stay readable); with
        ``every_rank=True`` on every rank, each line prefixed ``[rank R]`` (``print_lines``)."""
        if every_rank:
            print_lines(self.rank, sep.join(map(str, values)), file or sys.stdout)
        elif self.is_main:
            print(*values, sep=sep, file=file, flush=True)

    def log_metrics(self, step: int, **values: float) -> None:
        """Scalars at ``step`` as TensorBoard curves in ``RUN_DIR/tensorboard`` (rank 0 writes;
        any rank may call it). Steps logged again after a resume replace the earlier ones."""
        if self.curves is None:
            raise LaunchError("job.log_metrics writes to RUN_DIR/tensorboard, and no run "
                              "directory was given",
                              hint="start the job with launcher.distributed(status_dir=RUN_DIR)")
        self.curves.log(step, **values)

    # --- preemption ---------------------------------------------------------------------------

    def preempted(self) -> bool:
        """Collective, at a step boundary: True on every rank when any rank has received the
        preemption signal (SIGUSR1 or ``DDP_PREEMPT_SIGNAL``), SIGTERM or Ctrl-C."""
        return self.watch.agreed(self.device)

    def exit_preempted(self, checkpoint_path: str | Path = "") -> NoReturn:
        """End every rank with exit status 75, 130 after Ctrl-C (call it on every rank, after
        ``save``)."""
        raise Preempted(str(checkpoint_path), self.watch.stop_status or EXIT_PREEMPTED)

    # --- checkpoints --------------------------------------------------------------------------

    def save(self, directory: str | Path, step: int, state: dict, *,
             samples: int | None = None) -> Path:
        """Collective: rank 0 writes ``state`` as ``directory/ckpt-<step>.pt``, a file that
        ``torch.load(path, weights_only=True)`` reads, adding ``step``, ``samples`` (the global
        sample position: samples consumed over all ranks, when given), ``world_size`` and every
        rank's RNG states (``rng``). Atomic (a reader sees the old file or the whole new one),
        self-checking (SHA-256), and loaded back before it is written: state that resume could
        not load, or a failed write, stops every rank with the cause and writes nothing. Then
        the newest ``keep`` stay; checkpoints of later steps than ``step`` go, with a warning
        (a run resumed from an earlier checkpoint left their timeline)."""
        directory = Path(directory)
        mine = checkpoint.capture_rng(self.device)
        # to rank 0 alone, the one that writes: an all-gather would send every rank all N
        # states (~15 KB each), N^2 in all: 58 GB per checkpoint at 2,000 ranks
        rng: list[object] | None = [mine]
        if self.world_size > 1:
            rng = [None] * self.world_size if self.is_main else None
            dist.gather_object(mine, rng, dst=0)
        contents = {**state, "format": checkpoint.FORMAT, "step": step, "samples": samples,
                    "world_size": self.world_size, "rng": rng}
        with agree():
            if self.is_main:
                try:
                    checkpoint.save(directory, step, contents, self.keep, _warn)
                except OSError as exc:
                    raise LaunchError(f"cannot write a checkpoint to {directory}: {exc}",
                                      hint="check free space and permissions of the "
                                      "checkpoint directory") from None
        return directory / checkpoint.checkpoint_name(step)

    def resume(self, directory: str | Path) -> dict | None:
        """Collective: the newest valid checkpoint in ``directory``, loaded onto this rank's
        device with this rank's RNG states restored, so the run continues bit-exact; None when
        there is none (``newest_checkpoint`` and ``load`` in one call)."""
        path = self.newest_checkpoint(directory)
        return None if path is None else self.load(path)

    def newest_checkpoint(self, directory: str | Path) -> Path | None:
        """Collective: the newest checkpoint in ``directory`` that passes its checks, the same
        on every rank (rank 0 looks; damaged ones are skipped with a warning, files left by a
        writer killed mid-write are removed)."""
        directory = Path(directory)
        chosen: list[object] = [None]
        with agree():
            if self.is_main:
                for stale in directory.glob(".ckpt-*.tmp") if directory.is_dir() else ():
                    _warn(f"removing {stale}, left by a writer that was killed mid-write")
                    stale.unlink(missing_ok=True)
                newest = checkpoint.newest_valid(directory, _warn)
                chosen[0] = None if newest is None else str(newest)
        if self.world_size > 1:
            dist.broadcast_object_list(chosen, src=0)
        return None if chosen[0] is None else Path(chosen[0])

    def load(self, path: str | Path, restore_rng: bool = True) -> dict:
        """Collective: the checkpoint at ``path`` on every rank, onto this rank's device, with
        this rank's RNG states restored (or later, with ``restore_rng(state)``). Any world size
        reads it: on the one that wrote it each rank gets its own states back (bit-exact); on
        another, a line says so and each rank's streams are reseeded (``restore_rng``). With
        ``restore_rng=False`` (evaluation, or restoring later) it prints nothing."""
        with agree():
            state = checkpoint.load(path, map_location=self.device)
        if restore_rng:  # the line is about the RNG streams: said where they are reseeded
            if note := resharded_note(path, state, self.world_size):
                self.print(note)
            self.restore_rng(state)
        return state

    def restore_rng(self, state: dict) -> None:
        """Set this rank's RNG states (torch, CUDA, numpy, random) to those in ``state``; when
        it was written by another number of ranks, to new streams derived from it, this rank
        and the world size (the same for every resume on this many ranks)."""
        saved = state["rng"]
        if len(saved) == self.world_size:
            checkpoint.restore_rng(saved[self.rank], self.device)
        else:
            checkpoint.reseed_rng(saved, self.rank, self.world_size, self.device)

    #: Collective context manager: a LaunchError raised inside on some ranks is raised on every
    #: rank (the others name the rank that failed), so nobody waits in the next collective
    agree = staticmethod(agree)


def resharded_note(path: str | Path, state: dict, world_size: int) -> str | None:
    """The line for resuming on another number of ranks than wrote ``state``; else None."""
    saved = len(state.get("rng", ()))
    if not saved or saved == world_size:
        return None
    return (f"{path} was written by {saved} ranks, resuming on {world_size}: data order "
            f"continues by global sample; not bit-identical to an uninterrupted {saved}-rank run")


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


@contextmanager
def distributed(backend: str = "auto", timeout_s: float = TIMEOUT_S,
                status_dir: str | Path | None = None, env: JobEnv | None = None
                ) -> Iterator[Job]:
    """Run the body as one rank of a distributed job (see the module docstring). With
    ``status_dir`` (the run directory), an ending other than success is also written to
    ``status_dir/exit-status`` for the batch script (``launcher.faults.exit_status``), and each rank
    keeps a record there while it runs (``launcher.faults.rank_record``); a hang's post-mortem
    goes to ``status_dir/hang``. ``env``: this process's ``JobEnv`` when the caller read it
    already (``launcher.exit_statuses`` yields it), else it is read here."""
    with exit_statuses(env) as env:
        timeout_s = _checked_timeout(timeout_s)
        with _witnessed(status_dir, env), PreemptionWatch(env.preempt_signal, env.rank) as watch, \
                process_group(env, backend, timeout_s,
                              None if status_dir is None else Path(status_dir)) as ctx:
            if ctx.backend == "nccl" and env.is_main and \
                    (clash := nccl_clash(env.preempt_signal, env.nccl_dump_signal)):
                _warn(clash)
            curves = (None if status_dir is None
                      else Curves(Path(status_dir) / "tensorboard", ctx.env.is_main))
            try:
                yield Job(ctx.env, ctx.backend, ctx.device, watch, curves=curves)
            finally:
                if curves is not None:
                    curves.close()


def _witnessed(status_dir: str | Path | None, env: JobEnv) -> AbstractContextManager:
    """The run directory's files: this rank's output (``logs/rank-R.log``), and for the batch
    script this rank's record while it runs and the exit status, written before the record
    goes."""
    if status_dir is None:
        return nullcontext()
    files = ExitStack()
    files.enter_context(rank_output.teed(Path(status_dir), env.rank, env.world_size,
                                         env.node_name))
    files.enter_context(rank_record.kept(Path(status_dir), env.rank, env.node_name,
                                          touches=env.local_rank == 0))
    files.enter_context(exit_status.recorded(Path(status_dir), env.rank))
    return files


def _checked_timeout(timeout_s: object) -> float:
    """``timeout_s`` as a float; a LaunchError unless it is a positive number of seconds."""
    valid = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not valid or not 0 < timeout_s < float("inf"):
        raise LaunchError(f"launcher.distributed(timeout_s={timeout_s!r}): the timeout must be a "
                          "positive number of seconds",
                          hint="pass how long a collective may wait, e.g. "
                          "launcher.distributed(timeout_s=300)")
    return float(timeout_s)
