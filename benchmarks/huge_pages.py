"""all_reduce on memory in 4 KiB pages beside the same on transparent huge pages (2 MiB), for
each backend and raw mpi4py, in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m benchmarks.huge_pages \
        --json benchmarks/results/huge_pages.json

On one node MPICH moves a large message with a single copy out of the peer's memory (CMA:
``process_vm_readv``), and the kernel looks up each of the peer's pages as it copies: 1,024
lookups for 4 MiB in 4 KiB pages, 2 in huge pages. torch's CPU allocator asks for huge pages
only when ``THP_MEM_ALLOC_ENABLE=1`` (its buffers of 2 MiB and more), which the launcher sets
(``launcher.mpi.huge_pages``); this measures what that buys each contender. Both buffers are
mappings of their own, aligned to 2 MiB, the same size; the small one is advised against huge
pages (MADV_NOHUGEPAGE) so that a host whose kernel gives them to every mapping ("always")
still has a contender in 4 KiB pages. Contenders take turns in rounds (benchmarks/timing.py).

torch's buffers below 2 MiB, and those glibc hands out from its heap, stay in 4 KiB pages
unless glibc advises its own memory to huge pages too, which it reads as the process starts:

    .venv/bin/mpiexec -n 2 -genv GLIBC_TUNABLES glibc.malloc.hugetlb=1 .venv/bin/python \
        -m benchmarks.huge_pages --json benchmarks/results/huge_pages_glibc_hugetlb.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from benchmarks import plots, rank_side, timing
from benchmarks.allreduce import contenders, init_groups
from benchmarks.timing import COMM, measure
from launcher.mpi import huge_pages

MiB = 1 << 20
SIZES = (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 25 * MiB, 64 * MiB)
#: 4 KiB pages, huge pages throughout, and what torch's allocator gives with the launcher's
#: setting: huge pages for the 2 MiB-aligned part of its buffer (it aligns to 4 KiB only)
PAGES = ("small", "huge", "torch")


def parse_args() -> argparse.Namespace:
    parser = timing.parser(__doc__, rounds=6, seconds=1.0, max_calls=1000)
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) * MiB for x in s.split(",")),
                        default=SIZES, help="sizes in MiB, comma-separated")
    return parser.parse_args()


def mapped(nbytes: int, huge: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """A float32 tensor of zeros on a mapping of its own, 2 MiB-aligned, in huge pages or
    advised against them; the mapping must outlive the tensor."""
    # private: the kernel gives huge pages to private anonymous memory, not to shared
    region = mmap.mmap(-1, nbytes + huge_pages.HUGE_PAGE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    offset = -whole.ctypes.data % huge_pages.HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, offset, nbytes)
    view = whole[offset:offset + nbytes]
    view[:] = 1  # fault the pages in now, not in the first timed call
    view[:] = 0
    return region, torch.from_numpy(view.view(np.float32))


def fallbacks() -> int:
    """The kernel's count of faults that asked for a huge page and got 4 KiB ones, as no free
    2 MiB was left and compaction failed (``thp_fault_fallback``, for the whole machine; 0
    where unreadable). A full node does that: in a CI run with image builds beside it, the
    8 MiB "huge" buffer got none (compaction failed 120 times of 150)."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, value = line.split()
            if name == "thp_fault_fallback":
                return int(value)
    except OSError:
        pass
    return 0


def buffers_of(nbytes: int) -> tuple[list[mmap.mmap], dict[str, torch.Tensor], dict]:
    """A buffer of each kind of ``PAGES``, the mappings that hold them, and for each how many
    bytes the kernel put in huge pages (``{pages}_huge_backed_bytes``) and how many faults for
    huge pages it answered with 4 KiB ones meanwhile (``{pages}_huge_fallbacks``)."""
    regions, buffers, backed = [], {}, {}
    for pages in PAGES:
        before = fallbacks()
        if pages == "torch":
            buffers[pages] = torch.ones(nbytes // 4)
            buffers[pages].zero_()
        else:
            region, buffers[pages] = mapped(nbytes, pages == "huge")
            regions.append(region)
        backed[f"{pages}_huge_backed_bytes"] = huge_pages.backed_bytes(
            buffers[pages].data_ptr(), nbytes)
        backed[f"{pages}_huge_fallbacks"] = fallbacks() - before
    return regions, buffers, backed


def ops(buffers: dict[str, torch.Tensor], groups: dict) -> dict:
    """One all_reduce per contender and page size, named "contender/pages"."""
    made = {}
    for pages, buf in buffers.items():
        for name, group in groups.items():
            made[f"{name}/{pages}"] = lambda b=buf, g=group: dist.all_reduce(b, group=g)
        raw = buf.numpy()
        made[f"raw/{pages}"] = lambda r=raw: COMM.Allreduce(MPI.IN_PLACE, r, op=MPI.SUM)
    return made


def table(groups: dict, args) -> list[dict]:
    rows = []
    for nbytes in args.sizes:
        regions, buffers, backed = buffers_of(nbytes)
        stats = measure(ops(buffers, groups), args)
        row = {"bytes": nbytes, **backed}
        for name in contenders(groups):
            for stat in ("median", "best"):
                small = stats[f"{name}/small"][stat]
                for pages in PAGES:
                    row[f"{name}_{pages}_{stat}_us"] = stats[f"{name}/{pages}"][stat] * 1e6
                    if pages != "small":  # > 1: faster than in 4 KiB pages
                        row[f"{name}_{pages}_speedup_{stat}"] = (
                            small / stats[f"{name}/{pages}"][stat])
        rows.append(row)
        del buffers, stats
        for region in regions:
            region.close()
    return rows


def print_table(rows: list[dict], names: tuple[str, ...]) -> None:
    print(f"all_reduce, {COMM.size} ranks: median us in 4 KiB pages, then the speedup on huge "
          f"pages throughout and on torch's own buffer (MiB in huge pages of the mappings "
          f"under each: torch's is all of glibc's heap where the buffer lies in it)")
    print(f"{'MiB':>5} " + " ".join(f"{n:>22}" for n in names) + "  huge MiB: all, torch's")
    for row in rows:
        cells = [f"{row[f'{n}_small_median_us']:>8.0f} {row[f'{n}_huge_speedup_median']:.2f}x "
                 f"{row[f'{n}_torch_speedup_median']:.2f}x" for n in names]
        backed = (f"{row['huge_huge_backed_bytes'] / MiB:.0f}, "
                  f"{row['torch_huge_backed_bytes'] / MiB:.0f}")
        print(f"{row['bytes'] / MiB:>5.0f} " + " ".join(f"{c:>22}" for c in cells) +
              f"  {backed:>15}")


def main() -> None:
    args = parse_args()
    # forced, a user's =0 too: what torch's own buffer gains with the launcher's setting is
    # what this measures; before torch's first allocation, when torch reads it
    os.environ[huge_pages.VARIABLE] = "1"
    taken = huge_pages.taken()
    if not taken:
        sys.exit(f"error: torch allocated before {huge_pages.VARIABLE} was set\n"
                 f"HINT: run with {huge_pages.VARIABLE}=1 in the environment")
    rank_side.end_job_on_error()
    groups = init_groups()
    rows = table(groups, args)
    if COMM.rank == 0:
        mode = huge_pages.system_mode()
        # glibc reads it as the process starts: only the launch line can set it
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        print(f"transparent huge pages: {mode}; GLIBC_TUNABLES={tunables}")
        print_table(rows, contenders(groups))
        if args.json:
            args.json.write_text(json.dumps({
                "command": " ".join(sys.argv),
                "world_size": COMM.size,
                "transparent_hugepage": mode,
                "torch_takes_huge_pages": taken,
                "glibc_tunables": tunables,
                "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
                "torch": torch.__version__,
                "load_average": os.getloadavg(),
                "allreduce": rows,
            }, indent=2) + "\n")
            plots.if_possible(args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
