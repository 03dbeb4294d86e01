"""Transparent huge pages for torch's CPU buffers where a node's ranks copy from each other's
memory (CMA, ``launcher.mpi.single_copy``).

For each large message between two ranks of a node, the kernel looks up the sender's pages
one by one as it copies (``process_vm_readv``): 1,024 lookups for 4 MiB in 4 KiB pages, 2 in
huge pages of 2 MiB. torch's CPU allocator asks the kernel for huge pages (``madvise``) for
its buffers of 2 MiB and more only when ``THP_MEM_ALLOC_ENABLE=1``, read at its first
allocation; an all_reduce of 2-64 MiB was 1.17-1.39x faster on them, with either mpi backend
and raw mpi4py alike, and no faster without CMA (benchmarks/README.md, "Huge pages").

The launcher sets it where it turns CMA on, unless the user set it (``=0`` keeps 4 KiB pages:
a kernel short of free huge pages compacts memory at the fault, which a fragmented node may
pay for), and not where the kernel gives none (``never``). In the image it is set as Python
starts (the ``.pth`` line), before anything allocates; a script of one's own that makes
tensors before ``launcher.distributed()`` in the venv keeps 4 KiB pages (``taken`` says so).
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
                    "buffers of 2 MiB and more: CMA copies them page by page, 1.2-1.4x faster "
                    "all_reduce from 2 MiB up")


def taken() -> bool:
    """Whether this process's torch allocates in huge pages: it aligns its large buffers to a
    page then (else to 64 bytes, where a page-aligned address is all but impossible)."""
    import torch

    return torch.empty(HUGE_PAGE, dtype=torch.uint8).data_ptr() % 4096 == 0


def line(mode: str | None = None) -> str:
    """launcher.check's line: whether this rank's torch allocates in huge pages, and why."""
    mode = system_mode() if mode is None else mode
    value = os.environ.get(VARIABLE)
    if mode in ("never", "unknown"):
        return f"huge pages: off: the kernel's rule is {mode}"
    if taken():
        return (f"huge pages: on for torch's CPU buffers of 2 MiB and more ({VARIABLE}={value}, "
                f"the kernel's rule: {mode})")
    if value == "1":
        return (f"huge pages: off: torch allocated before {VARIABLE}=1 was set; set it in the "
                "job's environment")
    return f"huge pages: off ({VARIABLE}={value})" if value else "huge pages: off"


def backed_bytes() -> int:
    """Bytes of this process's anonymous memory in huge pages now."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
