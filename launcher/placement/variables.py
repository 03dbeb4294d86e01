"""What a launcher's variables say about this process (``Placement``), read strictly: the
building blocks of the detectors (``launcher.placement.detectors``) and their interface
(``Detector``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.core.errors import LaunchError

Environ = Mapping[str, str]

_INTEGER = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class Placement:
    """What a detector read: this process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None = None  # None = decided at start-up: rank 0's, broadcast over MPI
    master_port: int | None = None  # None = decided at start-up: a free port picked by rank 0
    hosts: tuple[str, ...] = ()  # node list: Slurm's, else DDP_HOSTS (invoke run --hosts)
    job_id: str | None = None
    #: torchrun's restart count (``restart_count``); None under the other launchers, whose
    #: rendezvous store serves one attempt only
    attempt: int | None = None

    @property
    def store_prefix(self) -> str:
        """Where this attempt's keys go in the rendezvous store, the launcher's and torch's
        ("": at its root): torchrun's agent serves one store to every attempt of its workers,
        and a restarted attempt met the keys of the one before, a dead rank's ports among
        them."""
        return "" if self.attempt is None else f"ddp/attempt_{self.attempt}"


def restart_count(environ: Environ) -> int:
    """How often torchrun's agent restarted the workers (``--max-restarts``): its
    TORCHELASTIC_RESTART_COUNT, 0 without it (ranks started by hand with RANK)."""
    if "TORCHELASTIC_RESTART_COUNT" not in environ:
        return 0
    return read_int(environ, "TORCHELASTIC_RESTART_COUNT", "torchrun")


def read_int(environ: Environ, name: str, launcher: str, minimum: int = 0) -> int:
    """``environ[name]`` as an integer >= ``minimum``, or a LaunchError naming both."""
    value = environ[name]
    # not int(): it also takes "1_000" and other forms no launcher writes
    number = int(value) if _INTEGER.fullmatch(value.strip()) else None
    if number is None or number < minimum:
        kind = "a positive integer" if minimum > 0 else "a non-negative integer"
        raise LaunchError(
            f"{name}={value!r} is not {kind} (read as the {launcher} launch environment)",
            hint=f"{name} is set by the launcher; if you exported it yourself, unset it or fix it",
        )
    return number


def require(environ: Environ, name: str, launcher: str, because: str, minimum: int = 0) -> int:
    """Like ``read_int``, for a variable that must come with ``because``."""
    if name not in environ:
        raise LaunchError(
            f"{because} is set but {name} is not: the {launcher} launch environment is incomplete",
            hint=f"set {name} too, or unset {because} if you exported it yourself",
        )
    return read_int(environ, name, launcher, minimum)


def block_placement(rank: int, size: int, local_rank: int, local_size: int) -> Placement:
    """Placement for launchers that give no node index: nodes assumed equally filled."""
    return Placement(
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_world_size=local_size,
        node_rank=min(rank // local_size, -(-size // local_size) - 1),
        num_nodes=-(-size // local_size),
    )


class Detector:
    """One launcher: ``detect`` says whether it started us, ``read`` where it put us."""

    name = ""
    #: whether the PMI variables this process sees (``JobEnv.pmi``) are this launcher's for it;
    #: False where they are an outer launcher's, for the process that started this one
    serves_pmi = True

    def detect(self, environ: Environ) -> bool:
        raise NotImplementedError

    def read(self, environ: Environ) -> Placement:
        raise NotImplementedError
