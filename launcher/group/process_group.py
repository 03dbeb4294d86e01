"""Process group set-up and tear-down: the second stage after the environment.

``process_group(env, backend)`` carries out the backend plan (``launcher.group.backends.plan``): it
starts MPI only where the plan says so, binds this rank's GPU, rendezvouses, each start-up stage
within ``timeout_s`` plus a grace (``launcher.group.startup_guard``), starts the fail-fast watchdog
and always ends the group again, also when the body raises. What leaves the body decides how:

- nothing, an error raised on every rank together (``launcher.faults.agreement``), a preemption: the
  group is torn down in order;
- a communication failure (a peer died, the network was cut, a collective timed out): it comes
  out as ``PeerLost`` naming the ranks and nodes whose heartbeats stopped
  (``launcher.faults.peer_lost``);
- any other exception, raised on this rank alone: it is reported here and on every other rank
  (``launcher.faults.failfast``) and comes out as ``RankFailed``: end the process at once with
  ``launcher.faults.exits.end_process``.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.core.defaults import TIMEOUT_S
from launcher.core.errors import PeerLost, RankFailed, raised_everywhere
from launcher.faults import (
    ddp_steps,
    exits,
    failfast,
    flight_recorder,
    gpu_waits,
    hang_watch,
    heartbeat,
)
from launcher.faults.peer_lost import diagnose, is_communication_failure
from launcher.group import debug_level
from launcher.group.backends import MPI4PY, BackendFacts, BackendPlan, plan
from launcher.group.gpu_sharing import nccl_unless_gpus_are_shared
from launcher.group.rendezvous import nodes_over_mpi, rendezvous_error, start_mpi, start_store
from launcher.group.startup_guard import GRACE_S, guarded
from launcher.mpi import library as mpi_library
from launcher.placement.env import JobEnv, local_device_index
from launcher.placement.gpu_numa import pci_address


@dataclasses.dataclass(frozen=True)
class DistContext:
    """What the training code receives once the process group is up."""

    env: JobEnv
    #: the torch backend actually used: "nccl", "gloo", "mpi" (native) or "mpi4py"
    backend: str
    #: this rank's device: ``cuda:<local_rank>`` when CUDA is used, else ``cpu``
    device: torch.device
    #: for ``--backend mpi``: which implementation runs, and why (``launcher.mpi.cxx.choose``)
    implementation: str = ""


def bind_device(env: JobEnv, cuda_available: bool) -> torch.device:
    """One GPU per local rank; CPU when there is no GPU."""
    if not cuda_available:
        return torch.device("cpu")
    index = local_device_index(env, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_addresses(device: torch.device) -> list[str]:
    """The PCI addresses of the visible GPUs in CUDA's order ([] on CPU), for
    ``launcher.placement.gpu_numa``. Read from torch, not nvidia-smi or
    /proc/driver/nvidia: ``bind_device`` has created this rank's CUDA context already, and
    CUDA's own view honours CUDA_VISIBLE_DEVICES (indices, UUIDs, MIG) and CUDA_DEVICE_ORDER
    (its default, fastest first, cannot be read outside CUDA) with no second copy of those
    rules and no subprocess per rank. A torch without the PCI fields gives [] (unknown)."""
    if device.type != "cuda":
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        parts = [getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
        if not all(isinstance(part, int) for part in parts):
            return []
        found.append(pci_address(*parts))
    return found


@contextmanager
def process_group(
    env: JobEnv, backend: str = "auto", timeout_s: float = TIMEOUT_S,
    run_dir: Path | None = None
) -> Iterator[DistContext]:
    """Initialise torch.distributed for ``env``; tear it down on exit whatever happens.

    Every collective is recorded (``launcher.faults.flight_recorder``), each DDP backward's
    gradient all-reduces as one (``launcher.faults.ddp_steps``); ranks alive but not meeting
    are found and named (``launcher.faults.hang_watch``), with their stacks under ``run_dir/hang``.

    A communication failure inside the body (a peer died, the network was cut, a collective
    timed out) comes out as ``PeerLost`` naming the ranks and nodes whose heartbeats stopped.
    """
    cuda_available = torch.cuda.is_available()
    facts = BackendFacts(cuda_available, dist.is_mpi_available(),
                         mpi_library.chosen(env).bundled_mpich)
    chosen = plan(backend, env, facts)
    device = bind_device(env, cuda_available)
    timeout = timedelta(seconds=timeout_s)
    env, name, store, implementation = _start(env, chosen, device, timeout)
    watchdog = failfast.start(env, store)
    beat = watchdog.heartbeat
    flight_recorder.install()
    ddp_steps.install()
    watch = hang_watch.start(watchdog.channel, run_dir, timeout_s,
                             beat.silent if beat is not None else list, exits.end_process,
                             heartbeat.FOUND_SILENT_S)
    heartbeat.watch_waits(beat, watch)
    gpu = (gpu_waits.GpuWaits(timeout_s, env.rank, exits.lost_peer_ending(env, run_dir))
           if name == "nccl" and beat is not None else None)
    healthy = True
    failure: BaseException | None = None
    try:
        yield DistContext(env=env, backend=name, device=device, implementation=implementation)
    except BaseException as exc:
        if raised_everywhere(exc) or not isinstance(exc, Exception):
            failure = exc
            raise
        healthy = False
        if isinstance(exc, PeerLost):
            raise
        raise _ending(exc, env, name, watchdog, beat, watch) from None
    finally:
        # a lost or failed peer may hold up an orderly tear-down: the caller ends the process
        # instead (launcher.core.errors.report_and_exit, launcher.faults.exits.end_process);
        # its watchers are told it left, so that no survivor names it as a lost node
        if gpu is not None:
            gpu.stop()
        if not healthy and beat is not None:
            beat.leave(failed=True)
        if healthy:
            if watch is not None:
                watch.ended()  # for ranks that may still wait for this one
            heartbeat.watch_waits(None)
            watchdog.close()
            if dist.is_initialized():
                _release_users_of_the_group(failure)
                dist.destroy_process_group()


def _ending(exc: Exception, env: JobEnv, name: str, watchdog: failfast.Watchdog,
            beat: heartbeat.Heartbeat | None, watch: hang_watch.HangWatch | None) -> Exception:
    """What an exception raised on this rank alone ends the job with: the failure of a peer
    that the watchdog heard of (not a lost peer), a lost peer diagnosed, or this rank's own
    failure, told to the others."""
    if is_communication_failure(exc):
        if watchdog.notice is not None:
            return RankFailed(watchdog.notice.status)
        return diagnose(env, name, exc, beat, watch)
    return RankFailed(watchdog.fail(exc))


def _start(env: JobEnv, chosen: BackendPlan, device: torch.device,
           timeout: timedelta) -> tuple[JobEnv, str, dist.Store | None, str]:
    """Carry out ``chosen`` up to an initialised group: the rendezvoused ``env``, the backend's
    name, the store (None for MPI) and the mpi implementation's line (``DistContext``). Each
    stage is bounded (``launcher.group.startup_guard``)."""
    name, store, world, implementation = chosen.backend, None, None, ""
    who = f"rank {env.rank} on {env.hostname}"
    with guarded(who, timeout.total_seconds() + GRACE_S, enabled=env.is_distributed) as guard:
        if chosen.start_mpi:
            guard.stage("starting MPI")
            world = start_mpi(env)
        if name == MPI4PY:
            from launcher.mpi import cxx as mpi_cxx

            choice = mpi_cxx.choose(env.mpi_impl, env.mpi_cxx_dir)
            name, implementation = choice.name, choice.reason
        line = debug_level.settle(name)
        if line is not None and env.rank == 0:
            print(f"warning: {line}", file=sys.stderr, flush=True)
        guard.stage("the rendezvous")
        if chosen.store:
            env, store = start_store(env, name, timeout, world)
            if chosen.if_gpu_shared is not None:
                name = nccl_unless_gpus_are_shared(env, store, device, chosen.if_gpu_shared)
        else:
            env = nodes_over_mpi(env, world)  # start_store does it for gloo and nccl
        _init(env, name, store, timeout)
    return env, name, store, implementation


def _release_users_of_the_group(failure: BaseException | None) -> None:
    """Free what still uses the group (a DDP wrapper) while the group is up.

    A DDP reducer that outlives its gloo group into the interpreter's teardown aborts the
    process ("terminate called without an active exception", exit by SIGABRT) after a run
    that succeeded: 13 exits in 60 in a 2-rank test. The body's objects are either garbage
    by now (reference cycles) or held by the frames of a failure's traceback.
    """
    if failure is not None:
        traceback.clear_frames(failure.__traceback__)  # locals only: the trace still prints
    gc.collect()


def _init(env: JobEnv, name: str, store: dist.Store | None, timeout: timedelta) -> None:
    # torch.distributed.nn.functional gives ten functions the default argument
    # group=group.WORLD, which is evaluated when the module is imported: imported while a group
    # exists (DDP imports it through torch._dynamo on first use), it holds that group in their
    # defaults for good, out of the garbage collector's sight (torch 2.13). destroy_process_group
    # then leaves the group and gloo's threads alive into the interpreter's teardown, where
    # freeing them can abort a run that succeeded ("terminate called without an active
    # exception"). Imported before any group exists, the defaults are None.
    import torch.distributed.nn.functional  # noqa: F401

    if name == "mpi":
        dist.init_process_group("mpi", timeout=timeout)
        return
    if store is None:
        # the mpi4py backend rendezvouses through MPI; the store only satisfies torch's API
        store = dist.HashStore()
    if name == "nccl":
        # NCCL's watchdog ends the process at its timeout naming nobody: the waits are watched
        # at the timeout by launcher.faults.gpu_waits, NCCL's is the backstop after them
        timeout = timeout * (heartbeat.BUSY_LIMIT + 1)
    try:
        dist.init_process_group(
            name, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    except (RuntimeError, ValueError) as exc:
        raise rendezvous_error(env, name, exc) from None
