"""Process group set-up and tear-down: the second stage after the environment.

``process_group(env, backend)`` picks the backend, binds this rank's GPU, rendezvouses and
always destroys the group again, also when the body raises. Backend names the user may give:

- ``auto``: ``nccl`` when CUDA is usable, else ``gloo``;
- ``nccl``, ``gloo``: PyTorch's own, rendezvous over TCP at ``MASTER_ADDR:MASTER_PORT``;
- ``mpi``: PyTorch's native MPI backend when the wheel has one, else the mpi4py backend of
  ``launcher.mpi_backend`` (stock PyPI wheels have none). Neither needs an address or a port:
  MPI itself is the rendezvous.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from launcher.env import JobEnv, local_device_index
from launcher.errors import LaunchError

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
    """Initialise torch.distributed for ``env``; destroy it on exit whatever happens."""
    cuda_available = torch.cuda.is_available()
    name = select_backend(backend, cuda_available, dist.is_mpi_available())
    device = bind_device(env, cuda_available)
    env = _init(env, name, timedelta(seconds=timeout_s))
    try:
        yield DistContext(env=env, backend=name, device=device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init(env: JobEnv, name: str, timeout: timedelta) -> JobEnv:
    if name == "mpi":
        dist.init_process_group("mpi", timeout=timeout)
        return env
    if name != "gloo" and name != "nccl":
        # the mpi4py backend rendezvouses through MPI; the store only satisfies torch's API
        dist.init_process_group(
            name, store=dist.HashStore(), rank=env.rank, world_size=env.world_size, timeout=timeout
        )
        return env
    from launcher.rendezvous import resolve_rendezvous

    env = resolve_rendezvous(env)
    url = f"tcp://{_bracket_ipv6(env.master_addr)}:{env.master_port}"
    try:
        dist.init_process_group(
            name, init_method=url, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    except (RuntimeError, ValueError) as exc:
        raise _rendezvous_error(env, name, exc) from None
    return env


def _bracket_ipv6(addr: str | None) -> str:
    return f"[{addr}]" if addr and ":" in addr else str(addr)


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
