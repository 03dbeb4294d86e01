"""``python -m launcher.check``: the cluster smoke test of the classic set-up guides, as a tool.

Every rank reports where it runs and the versions and paths that must be identical on every
node; rank 0 prints one table. Any difference between ranks is a failure (one line each). Each
rank also reports its network interface (``launcher.network``), its node's /dev/shm and memlock
limit; limits below what the node's ranks need are warnings (``launcher.shm``), one per node.
Then, for each backend asked for, a ping-pong between rank 0 and every other rank and an
all_reduce whose result every rank checks.

``--preflight`` measures instead how fast each node is (``launcher.preflight``).

Exit status: 0 all good, 1 the cluster is inconsistent or a collective gave a wrong result,
2 bad input or environment (with a HINT).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import mpi_library, shm
from launcher.backends import BACKEND_CHOICES
from launcher.env import JobEnv, detect_environment
from launcher.errors import LaunchError
from launcher.job import exit_statuses
from launcher.process_group import DistContext, process_group

EXIT_CHECK_FAILED = 1

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
    mpi_choice: str  # why this libmpi (launcher.mpi_library)
    cuda: str
    nccl: str
    image: str
    interface: str  # the interface and address this rank uses, and why (launcher.network)
    shm_mib: int  # /dev/shm of this rank's node
    memlock: str  # its locked-memory limit: "unlimited" or KiB
    warnings: tuple[str, ...]  # this node's limits below what its ranks need


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
        interface=env.network.describe() if env.network else "-",
        shm_mib=memory.shm_size // shm.MIB,
        memlock="unlimited" if memory.memlock == shm.UNLIMITED else str(memory.memlock // 1024),
        warnings=tuple(shm.warnings(env.local_world_size, memory)),
    )


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
    columns = ("rank", "local_rank", "node_rank", "host", "launcher", "device", "interface",
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
    """``WARNING host: ...`` once per node and limit."""
    lines = {f"WARNING {r.host}: {w}": None for r in reports for w in r.warnings}
    return list(lines)


@dataclass(frozen=True)
class CollectiveResult:
    backend: str
    ping_pong_us: dict[int, float]
    errors: tuple[str, ...]


def check_collectives(ctx: DistContext) -> CollectiveResult:
    """Ping-pong rank 0 <-> every rank, then all_reduce SUM and MAX checked on every rank."""
    world, rank = ctx.env.world_size, ctx.env.rank
    errors: list[str] = []
    latencies: dict[int, float] = {}
    # gloo sends and receives host memory only (a CUDA tensor makes it abort the process)
    p2p_device = torch.device("cpu") if ctx.backend == "gloo" else ctx.device
    payload = torch.arange(1024, dtype=torch.float32, device=p2p_device)
    for peer in range(1, world):
        if rank == 0:
            start = time.perf_counter()
            dist.send(payload, dst=peer)
            echoed = torch.empty_like(payload)
            dist.recv(echoed, src=peer)
            latencies[peer] = (time.perf_counter() - start) / 2 * 1e6
            if not torch.equal(echoed, payload):
                errors.append(f"ping-pong with rank {peer} returned different data")
        elif rank == peer:
            received = torch.empty_like(payload)
            dist.recv(received, src=0)
            dist.send(received, dst=0)

    total = torch.full((4096,), float(rank + 1), device=ctx.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    expected = world * (world + 1) / 2
    if not torch.all(total == expected):
        errors.append(f"all_reduce SUM on rank {rank} gave {total[0].item()}, not {expected}")
    highest = torch.tensor([rank], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if highest.item() != world - 1:
        errors.append(f"all_reduce MAX on rank {rank} gave {highest.item()}, not {world - 1}")
    return CollectiveResult(ctx.backend, latencies, tuple(errors))


def gather(obj: object) -> list:
    if dist.get_world_size() == 1:
        return [obj]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def run_check(env: JobEnv, backends: list[str], timeout_s: float, as_json: bool) -> int:
    problems: list[str] = []
    summary: dict[str, object] = {"world_size": env.world_size, "backends": {}}
    say = print if env.is_main and not as_json else _quiet
    for index, backend in enumerate(backends):
        with process_group(env, backend, timeout_s) as ctx:
            if index == 0:
                mine = asdict(collect_report(ctx.env, ctx.device))
                reports = [RankReport(**r) for r in gather(mine)]
                problems += find_differences(reports)
                summary["ranks"] = [asdict(r) for r in reports]
                summary["warnings"] = node_warnings(reports)
                say(format_table(reports), flush=True)
            results = gather(check_collectives(ctx))
        errors = [f"{ctx.backend}: {e}" for result in results for e in result.errors]
        problems += errors
        latencies = results[0].ping_pong_us
        summary["backends"][ctx.backend] = {"ping_pong_us": latencies, "ok": not errors}
        worst = max(latencies.values(), default=0.0)
        say(f"{ctx.backend}: ping-pong with {len(latencies)} peer(s), worst one-way "
            f"{worst:.0f} us; all_reduce {'WRONG' if errors else 'ok'}", flush=True)
    summary["problems"] = problems
    summary["ok"] = not problems
    for line in problems:
        say(line, flush=True)
    say("check passed" if not problems else f"check FAILED: {len(problems)} problem(s)",
        flush=True)
    if env.is_main and as_json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if not problems else EXIT_CHECK_FAILED


def _quiet(*_args: object, **_kwargs: object) -> None:
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.check",
        description="Check that every rank runs the same software and that collectives work.",
    )
    parser.add_argument(
        "--backend", default="auto",
        help="backend(s) to test, comma-separated: " + ", ".join(BACKEND_CHOICES)
        + " (default auto: nccl with CUDA; on CPU mpi under mpiexec or srun --mpi=pmi2 with "
        "the image's MPICH, else gloo)",
    )
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before a collective that does not complete is an error")
    parser.add_argument("--json", action="store_true",
                        help="print one machine-readable summary line on rank 0, no table")
    parser.add_argument("--preflight", action="store_true", help="instead: measure each node "
                        "and node pair, name the slow nodes (launcher.preflight)")
    parser.add_argument("--slow-nodes", type=Path, metavar="FILE", help="with --preflight: "
                        "rank 0 writes their names here, one per line (empty: all fine)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_statuses():
        env = detect_environment()
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        unknown = [b for b in backends if b not in BACKEND_CHOICES]
        if unknown or not backends:
            raise LaunchError(f"unknown backend {', '.join(unknown) or '(none)'} in --backend",
                              hint=f"use one or more of: {', '.join(BACKEND_CHOICES)}")
        if args.preflight or args.slow_nodes:
            from launcher import preflight  # it gathers through this module

            return preflight.run(env, backends, args.timeout, args.slow_nodes, args.preflight)
        return run_check(env, backends, args.timeout, args.json)


if __name__ == "__main__":
    sys.exit(main())
