"""What each rank of ``launcher.check`` reports about itself (where it runs, the versions and
paths that must match on every node, its node's shared memory), how reports are gathered, and
how rank 0 compares them and prints them as one table."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.group.process_group import gpu_addresses
from launcher.mpi import library as mpi_library
from launcher.placement import cpus as cpu_binding
from launcher.placement import gpu_numa, network, shm
from launcher.placement.env import JobEnv, planned_network

#: what must be the same on every rank for the job to be trustworthy
MUST_MATCH = (
    "python_executable",
    "python_version",
    "torch",
    "mpi4py",
    "mpi_library",
    "mpi_abi",
    "libmpi_path",
    "pmi",
    "cuda",
    "nccl",
    "image",
)


@dataclass(frozen=True)
class RankReport:
    """What one rank says about itself."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    launcher: str
    device: str
    python_executable: str
    python_version: str
    torch: str
    mpi4py: str
    mpi_library: str
    mpi_abi: str  # the mpi4py extension loaded: "mpich" (libmpi.so.12) or "openmpi" (.so.40)
    libmpi_path: str
    pmi: str  # what the launcher offered: "pmix", "pmi" (PMI-1/PMI-2) or "none"
    mpi_choice: str  # why this libmpi (launcher.mpi.library)
    cuda: str
    nccl: str
    image: str
    interface: str  # the interface and address this rank uses, and why (launcher.placement.network)
    shm_mib: int  # /dev/shm of this rank's node
    memlock: str  # its locked-memory limit: "unlimited" or KiB
    warnings: tuple[str, ...]  # this node's limits below what its ranks need
    cpus: str = "-"  # the CPUs this rank may run on (a cpulist) and their NUMA nodes
    numa: str = "-"
    gpu_numa: str = "-"  # the NUMA node this rank's GPU is attached to; "?" where sysfs says -1


def collect_report(env: JobEnv, device: torch.device) -> RankReport:
    choice = mpi_library.load(env)
    mpi_library_version, mpi_abi, libmpi_path = _mpi_identity()
    import mpi4py

    cuda = torch.version.cuda or "-"
    nccl = "-"
    # what torch was built with, GPU or not: a CPU-only node reports the cuda image's versions
    if torch.version.cuda and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    memory = shm.read_node_memory()
    binding = cpu_binding.current()
    return RankReport(
        rank=env.rank,
        local_rank=env.local_rank,
        node_rank=env.node_rank,
        host=env.hostname,
        launcher=env.launcher,
        device=str(device),
        python_executable=sys.executable,
        python_version=platform.python_version(),
        torch=torch.__version__,
        mpi4py=mpi4py.__version__,
        mpi_library=mpi_library_version,
        mpi_abi=mpi_abi,
        libmpi_path=libmpi_path,
        pmi=env.pmi,
        mpi_choice=choice.reason,
        cuda=cuda,
        nccl=nccl,
        image=env.image or "-",
        interface=_interface(env),
        shm_mib=memory.shm_size // shm.MIB,
        memlock="unlimited" if memory.memlock == shm.UNLIMITED else str(memory.memlock // 1024),
        warnings=tuple(shm.warnings(env.local_world_size, memory, network.has_rdma())),
        cpus=cpu_binding.format_cpulist(binding.cpus),
        numa=",".join(map(str, binding.numa)) or "-",
        gpu_numa=_gpu_numa(device),
    )


def _gpu_numa(device: torch.device) -> str:
    addresses = gpu_addresses(device)
    if device.type != "cuda" or device.index is None or device.index >= len(addresses):
        return "-"
    node = gpu_numa.numa_node(addresses[device.index])
    return "?" if node is None else str(node)


def _interface(env: JobEnv) -> str:
    """The interface this rank talks to the others through: the one the store's rendezvous
    chose, or the route to a known rendezvous host; else the mpi backend, which needs no
    rendezvous host, leaves the choice to the MPI library (shared memory within a node)."""
    try:
        choice = planned_network(env)
    except LaunchError as error:
        return f"none: {error.message}"
    return choice.describe() if choice else "MPI's own choice"


def _mpi_identity() -> tuple[str, str, str]:
    """MPI library version line, mpi4py's ABI and the path of the libmpi this process loaded."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        # MPI_Get_library_version may be called before MPI_Init; don't start MPI for it
        # (under torchrun or gloo there may be no MPI launcher around)
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    version = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    abi = MPI.__file__.rsplit("/", 1)[-1].split(".")[1]  # MPI.<abi>.cpython-...so
    return version, abi, ",".join(sorted(paths)) or "-"


def find_differences(reports: list[RankReport]) -> list[str]:
    """One line per field that differs between ranks, naming the ranks on each side."""
    lines = []
    for field in MUST_MATCH:
        by_value: dict[str, list[int]] = {}
        for report in reports:
            by_value.setdefault(getattr(report, field), []).append(report.rank)
        if len(by_value) > 1:
            sides = "; ".join(
                f"rank {_ranges(ranks)}: {value}" for value, ranks in sorted(by_value.items())
            )
            lines.append(f"DIFFERENT {field}: {sides}")
    return lines


def _ranges(ranks: list[int]) -> str:
    spans: list[str] = []
    start = prev = ranks[0]
    for rank in ranks[1:] + [None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(spans)


def format_table(reports: list[RankReport]) -> str:
    columns = ("rank", "local_rank", "node_rank", "host", "launcher", "device", "cpus", "numa",
               "gpu_numa", "interface",
               "shm_mib", "memlock", "pmi", "mpi_abi", "python_version", "torch", "mpi4py",
               "mpi_library")
    rows = [[str(getattr(r, c)) for c in columns] for r in reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    header = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]
    shared = reports[0]
    footer = [f"{field}: {getattr(shared, field)}" for field in (*MUST_MATCH, "mpi_choice")]
    return "\n".join([header, *body, "", *footer, *node_warnings(reports)])


def node_warnings(reports: list[RankReport]) -> list[str]:
    """``WARNING host: ...`` once per node and limit, and per node whose ranks share CPUs."""
    lines = {f"WARNING {r.host}: {w}": None for r in reports for w in r.warnings}
    return [*lines, *cpu_overlaps(reports)]


def cpu_overlaps(reports: list[RankReport]) -> list[str]:
    """One line per node where ranks' CPU sets overlap, naming those ranks and CPUs."""
    by_cpu: dict[tuple[str, int], list[int]] = {}
    for report in reports:
        if report.cpus != "-":
            for cpu in cpu_binding.parse_cpulist(report.cpus):
                by_cpu.setdefault((report.host, cpu), []).append(report.rank)
    shared: dict[str, tuple[set[int], set[int]]] = {}
    for (host, cpu), ranks in by_cpu.items():
        if len(ranks) > 1:
            ranks_on, cpus_on = shared.setdefault(host, (set(), set()))
            ranks_on.update(ranks)
            cpus_on.add(cpu)
    return [f"WARNING {host}: ranks {_ranges(sorted(ranks))} share CPUs "
            f"{cpu_binding.format_cpulist(cpus)}: their threads contend (launcher.train "
            "--bind auto gives each its own; or srun --cpu-bind=cores, mpirun --bind-to core)"
            for host, (ranks, cpus) in sorted(shared.items())]


def gather(obj: object) -> list:
    if dist.get_world_size() == 1:
        return [obj]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
