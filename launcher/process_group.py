"""Process group set-up and tear-down: the second stage after the environment.

``process_group(env, backend)`` picks the backend, binds this rank's GPU, rendezvouses and
always destroys the group again, also when the body raises. Backend names the user may give:

- ``auto``: ``nccl`` when CUDA is usable, else ``gloo``; ``gloo`` too when ranks on one host
  share a GPU (one GPU, several ranks), which NCCL refuses;
- ``nccl``, ``gloo``: PyTorch's own, rendezvous over TCP at ``MASTER_ADDR:MASTER_PORT``;
- ``mpi``: PyTorch's native MPI backend when the wheel has one, else the mpi4py backend of
  ``launcher.mpi_backend`` (stock PyPI wheels have none). Neither needs an address or a port:
  MPI itself is the rendezvous.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from launcher import mpi_library
from launcher.env import JobEnv, local_device_index
from launcher.errors import LaunchError, PeerLost

BACKEND_CHOICES = ("auto", "nccl", "gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class DistContext:
    """What the training code receives once the process group is up."""

    env: JobEnv
    #: the torch backend actually used: "nccl", "gloo", "mpi" (native) or "mpi4py"
    backend: str
    #: this rank's device: ``cuda:<local_rank>`` when CUDA is used, else ``cpu``
    device: torch.device


def select_backend(requested: str, cuda_available: bool, native_mpi: bool) -> str:
    """Map the user's ``--backend`` to the torch backend name to initialise."""
    if requested not in BACKEND_CHOICES:
        raise LaunchError(
            f"unknown backend {requested!r}",
            hint=f"use one of: {', '.join(BACKEND_CHOICES)}",
        )
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise LaunchError(
            "--backend nccl needs CUDA, and no usable GPU was found on this rank",
            hint="use --backend gloo or mpi on CPU nodes, or run with GPUs (--nv for apptainer, "
            "--gpus all for docker)",
        )
    if requested == "mpi" and not native_mpi:
        from launcher import mpi_backend

        return mpi_backend.register()
    return requested


def bind_device(env: JobEnv, cuda_available: bool) -> torch.device:
    """One GPU per local rank; CPU when there is no GPU."""
    if not cuda_available:
        return torch.device("cpu")
    index = local_device_index(env, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@contextmanager
def process_group(
    env: JobEnv, backend: str = "auto", timeout_s: float = 300.0
) -> Iterator[DistContext]:
    """Initialise torch.distributed for ``env``; tear it down on exit whatever happens.

    A communication failure inside the body (a peer died, the network was cut, a collective
    timed out) comes out as ``PeerLost`` naming the ranks and hosts that stopped answering.
    """
    if backend == "mpi":
        mpi_library.start(env)
    else:
        mpi_library.load(env)
    cuda_available = torch.cuda.is_available()
    name = select_backend(backend, cuda_available, dist.is_mpi_available())
    device = bind_device(env, cuda_available)
    timeout = timedelta(seconds=timeout_s)
    store = None
    if name in ("gloo", "nccl"):
        env, store = _rendezvous(env, name, timeout)
        if name == "nccl" and env.is_distributed:
            name = _nccl_unless_gpus_are_shared(env, store, device, explicit=backend == "nccl")
    _init(env, name, store, timeout)
    healthy = True
    failure: BaseException | None = None
    try:
        yield DistContext(env=env, backend=name, device=device)
    except PeerLost:
        healthy = False
        raise
    except BaseException as exc:
        if not _is_communication_failure(exc):
            failure = exc
            raise
        healthy = False
        raise _peer_lost(env, name, store, exc) from None
    finally:
        # tearing down a group with a lost peer can block on that peer: the caller exits
        # the process instead (launcher.errors.report_and_exit)
        if healthy and dist.is_initialized():
            _release_users_of_the_group(failure)
            dist.destroy_process_group()


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


def _rendezvous(env: JobEnv, backend: str, timeout: timedelta) -> tuple[JobEnv, dist.Store]:
    """The TCP store hosted by rank 0: torch's rendezvous, and after a failure the roll call
    (it outlives a broken group and tells which ranks still answer)."""
    from launcher.rendezvous import resolve_rendezvous

    env = resolve_rendezvous(env)
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0, timeout=timeout, multi_tenant=True)
        store.set(f"{_HOST_KEY}/{env.rank}", env.hostname)
    except (RuntimeError, ValueError) as exc:
        raise _rendezvous_error(env, backend, exc) from None
    return env, store


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
    try:
        dist.init_process_group(
            name, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    except (RuntimeError, ValueError) as exc:
        raise _rendezvous_error(env, name, exc) from None


def _nccl_unless_gpus_are_shared(env: JobEnv, store: dist.Store, device: torch.device,
                                 explicit: bool) -> str:
    """``nccl``, or ``gloo`` for ``--backend auto`` when ranks share a GPU (NCCL stops such a
    job at its first collective with "invalid usage"). Every rank takes the same decision."""
    shared = shared_gpu(env, store, _gpu_identity(device))
    if shared is None:
        return "nccl"
    if explicit:
        raise LaunchError(
            f"NCCL cannot run several ranks on one GPU, and {shared}",
            hint=f"start one rank per GPU ({torch.cuda.device_count()} visible on "
            f"{env.hostname}; under Slurm --gpus-per-task=1), or use --backend gloo or mpi, "
            "which let ranks share a GPU",
        )
    if env.is_main:
        print(f"note: {shared}; NCCL cannot share a GPU, so --backend auto uses gloo",
              file=sys.stderr, flush=True)
    return "gloo"


def _gpu_identity(device: torch.device) -> str:
    """The GPU's UUID: the same card seen by two ranks, whatever index each sees it at."""
    return str(torch.cuda.get_device_properties(device).uuid)


_GPU_KEY = "ddp/gpu"


def shared_gpu(env: JobEnv, store: dist.Store, gpu: str) -> str | None:
    """Collective over ``store``: which ranks on one host were bound to the same GPU.

    Each rank publishes ``gpu`` (an identity such as the UUID) under its host and local rank
    and compares it with the lower local ranks of its host; then all ranks wait for each
    other. Returns the first conflict found anywhere in the job (the same text on every
    rank), or None.
    """
    store.set(f"{_GPU_KEY}/{env.hostname}/{env.local_rank}", gpu)
    for other in range(env.local_rank):
        if store.get(f"{_GPU_KEY}/{env.hostname}/{other}").decode() == gpu:
            conflict = (f"local ranks {other} and {env.local_rank} on {env.hostname} were "
                        f"given the same GPU ({gpu})")
            store.compare_set(f"{_GPU_KEY}/conflict", "", conflict)  # the first one stays
            break
    if store.add(f"{_GPU_KEY}/checked", 1) == env.world_size:
        store.set(f"{_GPU_KEY}/all-checked", "1")
    store.wait([f"{_GPU_KEY}/all-checked"])
    key = f"{_GPU_KEY}/conflict"
    return store.get(key).decode() if store.check([key]) else None


#: what torch and gloo put around the one useful clause: "[/path/pair.cc:553] " and
#: "Got the following error when running the callback: RuntimeError: " (repeated)
_NOISE = re.compile(
    r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*|Got the following error when running the callback: \w+: "
)
_HOST_KEY = "ddp/host"
_ALIVE_KEY = "ddp/alive"
_DONE_KEY = "ddp/roll-call-read"
#: how long survivors of a failure wait for each other to answer the roll call
ROLL_CALL_S = 10.0
_COMMUNICATION_WORDS = re.compile(
    r"gloo|nccl|timed out|timeout|connection|socket|peer|broken pipe", re.IGNORECASE
)


def _is_communication_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMMUNICATION_WORDS.search(str(exc)))


def _peer_lost(env: JobEnv, backend: str, store: dist.Store | None,
               exc: BaseException) -> PeerLost:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first_line = _NOISE.sub("", first_line).split(". This is typically")[0]
    who = _roll_call(env, store) if store is not None else None
    return PeerLost(
        f"rank {env.rank} on {env.hostname} lost contact in the {backend} process group"
        + (f": {who}" if who else "") + f" ({first_line})",
        hint="look at the named node (died, out of memory, cut off the network); then run the "
        "same command again: --resume auto continues from the last checkpoint",
    )


def _roll_call(env: JobEnv, store: dist.Store) -> str:
    """Which ranks still answer through the rendezvous store (hosted by rank 0)."""
    try:
        silent = _silent_ranks(env, store)
        hosts = [_host_of(store, rank) for rank in silent]
        store.set(f"{_DONE_KEY}/{env.rank}", "1")
        if env.is_main:
            # the store lives in this process, which exits next: stay until the survivors
            # have read what they need
            answered = [r for r in range(env.world_size) if r not in silent]
            _wait_for(store, [f"{_DONE_KEY}/{r}" for r in answered])
    except Exception:  # any failure means the same: the store is gone
        return (f"rank 0's rendezvous store at {env.master_addr}:{env.master_port} does not "
                f"answer either: rank 0's node is lost, or {env.hostname} is cut off")
    if not silent:
        return "every rank still answers the rendezvous store"
    names = ", ".join(f"rank {rank} ({host})" for rank, host in zip(silent, hosts, strict=True))
    return f"no answer within {ROLL_CALL_S:.0f} s from {names}"


def _silent_ranks(env: JobEnv, store: dist.Store) -> list[int]:
    store.set(f"{_ALIVE_KEY}/{env.rank}", env.hostname)
    return _wait_for(store, [f"{_ALIVE_KEY}/{rank}" for rank in range(env.world_size)],
                     missing_as=range(env.world_size))


def _wait_for(store: dist.Store, keys: list[str], missing_as=None) -> list:
    """Wait up to ROLL_CALL_S for ``keys``; the entries of ``missing_as`` (default: the keys)
    whose key did not appear."""
    labels = list(missing_as) if missing_as is not None else keys
    deadline = time.monotonic() + ROLL_CALL_S
    missing = []
    for key, label in zip(keys, labels, strict=True):
        remaining = timedelta(seconds=max(0.1, deadline - time.monotonic()))
        try:
            store.wait([key], remaining)
        except dist.DistStoreError:  # the wait timed out: nobody set that key
            missing.append(label)
    return missing


def _host_of(store: dist.Store, rank: int) -> str:
    key = f"{_HOST_KEY}/{rank}"
    return store.get(key).decode() if store.check([key]) else "?"


def _rendezvous_error(env: JobEnv, backend: str, exc: Exception) -> LaunchError:
    where = f"{env.master_addr}:{env.master_port}"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        hint = (
            f"another job on {env.master_addr} uses port {env.master_port}: set MASTER_PORT to a "
            "free port (under Slurm the port is derived from the job id)"
        )
    else:
        hint = (
            f"check that every node can reach {where} (firewall, hostname resolution); on "
            "machines with several interfaces set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; or "
            "use --backend mpi, which needs no address"
        )
    return LaunchError(
        f"rank {env.rank} could not join the {backend} process group at {where} "
        f"(launcher {env.launcher}): {text}",
        hint=hint,
    )


def raise_if_any_rank_failed(error: BaseException | None) -> None:
    """Collective: every rank calls it; if any rank brings an error, every rank raises.

    An error seen by one rank only (a corrupt file on node-local storage, say) would otherwise
    leave the other ranks waiting in the next collective until the timeout.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise _as_launch_error(error)
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    messages: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else _describe(error))
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if error is not None:
        raise _as_launch_error(error)
    ranks = ", ".join(str(rank) for rank, _ in failed)
    first_message, first_hint = failed[0][1]
    raise LaunchError(f"rank {ranks} failed: {first_message}", hint=first_hint)


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe(error: BaseException) -> tuple[str, str | None]:
    if isinstance(error, LaunchError):
        return error.message, error.hint
    return f"{type(error).__name__}: {error}", None


def _as_launch_error(error: BaseException) -> LaunchError:
    if isinstance(error, LaunchError):
        return error
    message, hint = _describe(error)
    return LaunchError(message, hint)
