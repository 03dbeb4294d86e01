"""Transparent huge pages for torch's CPU buffers where a node's ranks copy from each other's
memory (CMA, ``launcher.mpi.single_copy``).

For each large message between two ranks of a node, the kernel walks the sender's page
tables as it copies (``process_vm_readv``): 1,024 pages for 4 MiB in 4 KiB pages, 2 in huge
pages of 2 MiB. torch's CPU allocator asks the kernel for huge pages (``madvise``) for its
buffers of 2 MiB and more only when ``THP_MEM_ALLOC_ENABLE=1``, read at its first
allocation. An all_reduce of 2-64 MiB was 1.17-1.63x faster on memory in huge pages, and
1.11-1.55x on torch's own buffers from 8 MiB up, with either mpi backend and raw mpi4py
alike (two runs); without CMA 0.99-1.09x (benchmarks/README.md, "Huge pages").

The launcher sets it where it turns CMA on for the bundled MPIs, unless the user set it
(``=0`` keeps 4 KiB pages: a kernel short of free huge pages compacts memory at the fault,
which a fragmented node may pay for), and not where the kernel gives none (``never``, or
its rule unreadable). In the image it is set as Python starts (the ``.pth`` line), before
anything allocates; a script of one's own that makes tensors before ``launcher.distributed()``
in the venv keeps 4 KiB pages (``line`` says so). Smaller buffers, and those glibc serves from
its heap, get huge pages only with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the launch
line, an opt-in (``line`` says where it reached the rank).
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.placement import settings

HUGE_PAGE = 2 << 20
VARIABLE = "THP_MEM_ALLOC_ENABLE"
MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def system_mode(path: Path = MODE_FILE) -> str:
    """The kernel's rule for huge pages: "always", "madvise", "never"; "unknown" unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def prefer(mode: str | None = None) -> None:
    """Ask torch for huge pages (``VARIABLE``) unless the user decided or the kernel has none."""
    mode = system_mode() if mode is None else mode
    if mode in ("never", "unknown"):
        return
    settings.prefer(VARIABLE, "1", f"huge pages (the kernel's rule: {mode}) for torch's CPU "
                    "buffers of 2 MiB and more: CMA copies them page by page, all_reduce "
                    "1.1-1.5x faster from 8 MiB up (1.2-1.3x at 25 MiB, DDP's bucket size)")


def taken() -> bool:
    """Whether this process's torch allocates in huge pages: it aligns its large buffers to a
    page then, else to 64 bytes. Four held at once: a heap chunk can happen to start on a
    page, but not four chunks lying back to back."""
    import torch

    probes = [torch.empty(HUGE_PAGE, dtype=torch.uint8) for _ in range(4)]
    return all(p.data_ptr() % 4096 == 0 for p in probes)


def line(mode: str | None = None) -> str:
    """launcher.check's line: whether this rank's torch allocates in huge pages, and why."""
    mode = system_mode() if mode is None else mode
    value = os.environ.get(VARIABLE)
    if mode == "never":
        return "huge pages: off: the kernel's rule is never"
    if mode == "unknown":
        return f"huge pages: unknown: {MODE_FILE} cannot be read"
    if taken():
        return (f"huge pages: on for torch's CPU buffers of 2 MiB and more ({VARIABLE}={value}, "
                f"the kernel's rule: {mode}){_heap_too()}")
    if mode == "always":
        return f"huge pages: by the kernel's rule (always), torch not asked ({VARIABLE}={value})"
    if value == "1":
        return (f"huge pages: off: torch allocated before {VARIABLE}=1 was set; set it in the "
                "job's environment")
    return f"huge pages: off ({VARIABLE}={value})" if value else "huge pages: off"


def _heap_too() -> str:
    """The opt-in for the smaller buffers too, said where it reached this rank: glibc reads it
    as the process starts, so only the launch line sets it (docs/launching.md)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(t.startswith("glibc.malloc.hugetlb=") and t != "glibc.malloc.hugetlb=0"
           for t in tunables.split(":")):
        return f"; smaller ones too: glibc's heap advised (GLIBC_TUNABLES={tunables})"
    return ""


def backed_bytes(start: int = 0, length: int = 0) -> int:
    """Bytes in huge pages of this process's memory mappings that overlap ``start`` to
    ``start + length`` (all of them without a range)."""
    total, overlaps = 0, length == 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: its range
            low, high = (int(x, 16) for x in head.split("-"))
            overlaps = length == 0 or (low < start + length and start < high)
        elif head == "AnonHugePages:" and overlaps:
            total += int(line.split()[1]) * 1024
    return total

