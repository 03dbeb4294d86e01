"""``python -m launcher.check``: the cluster smoke test of the classic set-up guides, as a tool.

Every rank reports where it runs and the versions and paths that must be identical on every
node; rank 0 prints one table. Any difference between ranks is a failure (one line each). Each
rank also reports its network interface (``launcher.placement.network``), its node's /dev/shm and
memlock limit; limits below what the node's ranks need are warnings (``launcher.placement.shm``),
one per node. Then, for each backend asked for, a ping-pong between rank 0 and every other rank and
an all_reduce whose result every rank checks.

``--preflight`` measures instead how fast each node is (``launcher.diagnostics.preflight``).

Exit status: 0 all good, 1 the cluster is inconsistent or a collective gave a wrong result,
2 bad input or environment (with a HINT).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.core import rank_output
from launcher.core.errors import LaunchError
from launcher.diagnostics import preflight
from launcher.diagnostics.rank_report import (
    RankReport,
    collect_report,
    find_differences,
    format_table,
    gather,
    node_warnings,
)
from launcher.faults.exits import exit_statuses
from launcher.group.backends import BACKEND_CHOICES
from launcher.group.process_group import DistContext, process_group
from launcher.mpi import huge_pages, single_copy
from launcher.placement import settings
from launcher.placement.env import JobEnv

EXIT_CHECK_FAILED = 1

@dataclass(frozen=True)
class CollectiveResult:
    backend: str
    ping_pong_us: dict[int, float]
    errors: tuple[str, ...]
    #: for --backend mpi: which implementation this rank runs, and why
    implementation: str = ""


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
    return CollectiveResult(ctx.backend, latencies, tuple(errors), ctx.implementation)


def run_check(env: JobEnv, backends: list[str], timeout_s: float, as_json: bool) -> int:
    problems: list[str] = []
    summary: dict[str, object] = {"world_size": env.world_size, "backends": {}}
    say = print if env.is_main and not as_json else _quiet
    for index, backend in enumerate(backends):
        with process_group(env, backend, timeout_s) as ctx:
            if index == 0:
                _say_single_copy(ctx.env)
                mine = asdict(collect_report(ctx.env, ctx.device))
                reports = [RankReport(**r) for r in gather(mine)]
                problems += find_differences(reports)
                summary["ranks"] = [asdict(r) for r in reports]
                summary["warnings"] = node_warnings(reports)
                say(format_table(reports), flush=True)
            results = gather(check_collectives(ctx))
        errors = [f"{ctx.backend}: {e}" for result in results for e in result.errors]
        problems += errors + mixed_implementations(results)
        if results[0].implementation:
            say(f"{backend}: rank 0 runs {results[0].implementation}", flush=True)
        latencies = results[0].ping_pong_us
        summary["backends"][ctx.backend] = {"ping_pong_us": latencies, "ok": not errors,
                                             "implementation": results[0].implementation}
        worst = max(latencies.values(), default=0.0)
        say(f"{ctx.backend}: ping-pong with {len(latencies)} peer(s), worst one-way "
            f"{worst:.0f} us; all_reduce {'WRONG' if errors else 'ok'}", flush=True)
    summary["library_settings"] = settings.applied()  # rank 0's
    summary["problems"] = problems
    summary["ok"] = not problems
    for line in problems:
        say(line, flush=True)
    say("check passed" if not problems else f"check FAILED: {len(problems)} problem(s)",
        flush=True)
    if env.is_main and as_json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if not problems else EXIT_CHECK_FAILED


def _say_single_copy(env: JobEnv) -> None:
    """This node's CMA decision, which a run prints only when it is off: here on too, and
    whether torch's large buffers are in huge pages, which CMA copies faster."""
    decided = single_copy.decided()
    if env.local_rank == 0 and decided is not None and decided[0]:
        print(decided[1], file=sys.stderr, flush=True)
        print(huge_pages.line(), file=sys.stderr, flush=True)


def mixed_implementations(results: list[CollectiveResult]) -> list[str]:
    """One problem line when the ranks run different implementations of one backend."""
    ranks: dict[str, list[int]] = {}
    for rank, result in enumerate(results):
        ranks.setdefault(result.backend, []).append(rank)
    if len(ranks) < 2:
        return []
    which = "; ".join(f"{name} on rank(s) {', '.join(map(str, r))}" for name, r in ranks.items())
    return [f"the ranks run different implementations of one backend: {which}"]


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
                        "and node pair, name the slow nodes (launcher.diagnostics.preflight)")
    parser.add_argument("--slow-nodes", type=Path, metavar="FILE", help="with --preflight: "
                        "rank 0 writes their names here, one per line (empty: all fine)")
    parser.add_argument("--run-dir", type=Path, metavar="DIR", help="also keep each rank's "
                        "output in DIR/logs/rank-R.log (as launcher.train does in its run "
                        "directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_statuses() as env:
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        unknown = [b for b in backends if b not in BACKEND_CHOICES]
        if unknown or not backends:
            raise LaunchError(f"unknown backend {', '.join(unknown) or '(none)'} in --backend",
                              hint=f"use one or more of: {', '.join(BACKEND_CHOICES)}")
        with _teed(args.run_dir, env):
            if args.preflight or args.slow_nodes:
                return preflight.run(env, backends, args.timeout, args.slow_nodes,
                                     args.preflight)
            return run_check(env, backends, args.timeout, args.json)


@contextmanager
def _teed(run_dir: Path | None, env: JobEnv) -> Iterator[None]:
    """Each rank's output also in RUN_DIR/logs (``launcher.core.rank_output``); rank 0 ends
    by naming the files."""
    if run_dir is None:
        yield
        return
    with rank_output.teed(run_dir, env.rank, env.world_size, env.node_name):
        yield
        if env.is_main:
            print(f"each rank's output: {rank_output.log_path(run_dir, 'R')}", flush=True)


