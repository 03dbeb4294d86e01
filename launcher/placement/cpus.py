"""Which CPUs a rank runs on: the node's NUMA layout, the rank's mask, and a binding that gives
the ranks sharing a node disjoint CPU sets.

Unbound, each rank's threads wander over every core of the node and its memory over every
NUMA domain. ``plan`` splits the CPUs this process may use into one set per local rank, in
NUMA order, so that a rank's set lies in as few NUMA nodes as possible: ``cores`` gives each
rank an equal share of CPUs, ``numa`` whole NUMA nodes (ranks sharing a node share its CPUs).
On GPU hosts ``beside_gpus`` gives each rank a share of the NUMA node its GPU is attached to
(``launcher.placement.gpu_numa``).
A mask the launcher already set (``srun --cpu-bind``, ``mpirun --bind-to``) is kept: a rank
whose allowed CPUs are fewer than its cgroup's was bound by someone who knew the node.
Read from /sys and ``sched_getaffinity`` only: O(CPUs) per rank, no communication.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from launcher.core.errors import LaunchError

MODES = ("auto", "none", "numa", "cores")
KEPT = "kept the launcher's binding"
BESIDE = "beside its GPU"
_NODES = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` (the kernel's cpulist) as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def format_cpulist(cpus) -> str:
    """A set as a cpulist: ``{0, 1, 2, 5}`` is ``0-2,5``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges) or "-"


def numa_nodes(root: Path = _NODES) -> dict[int, frozenset[int]]:
    """NUMA node -> its CPUs; one node of every CPU where /sys shows none."""
    nodes = {}
    for path in sorted(root.glob("node[0-9]*")):
        try:
            nodes[int(path.name[4:])] = parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return {n: c for n, c in nodes.items() if c} or {0: frozenset(range(os.cpu_count() or 1))}


def cgroup_cpus() -> frozenset[int] | None:
    """The CPUs of this process's cpuset cgroup (v2 or v1), None where it cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates = [Path("/sys/fs/cgroup") / path.lstrip("/") / "cpuset.cpus.effective"]
        elif "cpuset" in controllers.split(","):
            base = Path("/sys/fs/cgroup/cpuset") / path.lstrip("/")
            candidates = [base / "cpuset.effective_cpus", base / "cpuset.cpus"]
        else:
            continue
        for candidate in candidates:
            try:
                return parse_cpulist(candidate.read_text())
            except (OSError, ValueError):
                continue
    return None


@dataclass(frozen=True)
class Binding:
    """What a rank runs on, and why."""

    #: the CPUs this rank may use now
    cpus: frozenset[int]
    #: the NUMA nodes those CPUs lie in
    numa: tuple[int, ...]
    #: "bound by --bind MODE" (+ " beside its GPU"), "kept the launcher's binding", "unbound"
    how: str
    #: how many of the node's ranks run on these CPUs (their threads share them)
    share: int = 1

    @property
    def threads(self) -> int:
        """Threads for this rank: its share of its CPUs."""
        return max(1, len(self.cpus) // self.share)

    def describe(self) -> str:
        return f"CPUs {format_cpulist(self.cpus)}, NUMA node(s) {','.join(map(str, self.numa))}"


def numa_of(cpus, nodes: dict[int, frozenset[int]]) -> tuple[int, ...]:
    return tuple(n for n, members in sorted(nodes.items()) if members & set(cpus))


def plan(mode: str, allowed: frozenset[int], nodes: dict[int, frozenset[int]],
         local_rank: int, local_size: int) -> tuple[frozenset[int], int]:
    """This local rank's CPU set under ``mode`` ("cores" or "numa"), out of ``allowed``, and
    how many local ranks share it. The sets of ``cores`` are disjoint and as even as can be;
    ``numa`` hands whole NUMA nodes out (several ranks per node when there are fewer nodes)."""
    ordered = [cpu for n in sorted(nodes) for cpu in sorted(nodes[n] & allowed)]
    ordered += sorted(allowed - set(ordered))  # CPUs /sys put in no node: last
    if mode == "numa":
        groups = [sorted(nodes[n] & allowed) for n in sorted(nodes) if nodes[n] & allowed]
        groups = groups or [ordered]
        def span(rank: int) -> tuple[int, int]:
            first = rank * len(groups) // local_size
            return first, max(first + 1, (rank + 1) * len(groups) // local_size)
        share = sum(span(rank) == span(local_rank) for rank in range(local_size))
        first, last = span(local_rank)
        return frozenset(cpu for group in groups[first:last] for cpu in group), share
    start = local_rank * len(ordered) // local_size
    end = (local_rank + 1) * len(ordered) // local_size
    return frozenset(ordered[start:end]), 1


def beside_gpus(allowed: frozenset[int], nodes: dict[int, frozenset[int]],
                gpus: tuple[int | None, ...], local_rank: int) -> frozenset[int] | None:
    """This local rank's CPUs beside its GPU (pure): the allowed CPUs of the NUMA node its GPU
    is attached to (``gpus``: each local rank's GPU's node), split evenly and disjointly
    between the local ranks whose GPUs sit on that node, in local-rank order. None where that
    cannot be: a GPU's node unknown, or with fewer allowed CPUs than ranks beside it."""
    if local_rank >= len(gpus) or any(node is None for node in gpus):
        return None
    mine = gpus[local_rank]
    peers = [rank for rank, node in enumerate(gpus) if node == mine]
    cpus = sorted(nodes.get(mine, frozenset()) & allowed)
    if len(cpus) < len(peers):
        return None
    index = peers.index(local_rank)
    return frozenset(cpus[index * len(cpus) // len(peers):
                          (index + 1) * len(cpus) // len(peers)])


def decide(mode: str, allowed: frozenset[int], group: frozenset[int] | None,
           nodes: dict[int, frozenset[int]], local_rank: int, local_size: int,
           gpus: tuple[int | None, ...] | None = None) -> Binding:
    """The binding to apply (pure): a mask narrower than the cgroup's (``group``) is kept.
    On a GPU host (``gpus``: the NUMA node of each local rank's GPU, () or None entries where
    unknown), ``auto`` and ``numa`` bind each rank beside its GPU (``beside_gpus``); where
    that cannot be, ``auto`` leaves GPU ranks unbound (cores far from the GPU would cost more
    than they gain). Without GPUs ``auto`` binds by cores when the node has several ranks and
    a CPU for each of them."""
    if group is not None and allowed < group:
        return Binding(allowed, numa_of(allowed, nodes), KEPT)
    if gpus is not None and mode in ("auto", "numa"):
        near = beside_gpus(allowed, nodes, gpus, local_rank)
        if near is not None:
            return Binding(near, numa_of(near, nodes), f"bound by --bind {mode} {BESIDE}")
    gpu = gpus is not None
    if mode == "none" or (mode == "auto" and (gpu or not 1 < local_size <= len(allowed))):
        return Binding(allowed, numa_of(allowed, nodes), "unbound", local_size)
    if local_size > len(allowed) and mode == "cores":
        raise LaunchError(f"--bind cores: {local_size} ranks on this node and {len(allowed)} "
                          "CPUs to bind them to", hint="use --bind auto or none, or fewer ranks")
    cpus, share = plan("cores" if mode == "auto" else mode, allowed, nodes, local_rank,
                       local_size)
    return Binding(cpus, numa_of(cpus, nodes), f"bound by --bind {mode}", share)


def current() -> Binding:
    """This process's CPUs as they are (for reports)."""
    allowed = frozenset(os.sched_getaffinity(0))
    group = cgroup_cpus()
    kept = group is not None and allowed < group
    return Binding(allowed, numa_of(allowed, numa_nodes()), KEPT if kept else "unbound")


def bind(mode: str, local_rank: int, local_size: int,
         gpus: tuple[int | None, ...] | None = None) -> Binding:
    """Decide (``gpus`` as for ``decide``) and apply to every thread of this process
    (``sched_setaffinity`` of one thread reaches only the threads it starts later; MPI's, the
    heartbeat's exist already)."""
    allowed = frozenset(os.sched_getaffinity(0))
    binding = decide(mode, allowed, cgroup_cpus(), numa_nodes(), local_rank, local_size, gpus)
    if binding.how.startswith("bound") and binding.cpus != allowed:
        for task in Path("/proc/self/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), binding.cpus)
            except (OSError, ValueError):  # a thread that ended meanwhile
                continue
    return binding
