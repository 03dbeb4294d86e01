"""Huge pages for torch's CPU buffers where a node's ranks copy from each other's memory
(launcher.mpi.huge_pages): the kernel's rule read, the setting made or left, and a real job's
all_reduce buffer in huge pages. The speedup is a benchmark's (benchmarks/huge_pages.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.mpi import huge_pages
from launcher.placement import settings
from tests.fixtures.mpi import clean_environ, run_mpi


@pytest.fixture
def own_settings(monkeypatch):
    """An empty record and environment of this process's own, as a rank starts with."""
    monkeypatch.setattr(settings, "_applied", {})
    monkeypatch.setattr(settings.os, "environ", {})


@pytest.mark.parametrize(("text", "mode"), [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
    ("garbled\n", "unknown"),
])
def test_the_kernels_rule_is_the_bracketed_word(tmp_path, text, mode):
    (tmp_path / "enabled").write_text(text)
    assert huge_pages.system_mode(tmp_path / "enabled") == mode
    assert huge_pages.system_mode(tmp_path / "absent") == "unknown"


@pytest.mark.parametrize(("mode", "user", "expected"), [
    ("madvise", None, "1"),
    ("always", None, "1"),
    ("madvise", "0", "0"),  # the user's own value wins
    ("never", None, None),  # the kernel gives none: nothing to ask torch for
    ("unknown", None, None),
])
def test_torch_is_asked_for_huge_pages_unless_the_user_or_the_kernel_decided(own_settings, mode,
                                                                           user, expected):
    if user is not None:
        settings.os.environ[huge_pages.VARIABLE] = user
    huge_pages.prefer(mode)
    assert settings.os.environ.get(huge_pages.VARIABLE) == expected
    recorded = {s["name"]: s for s in settings.applied()}
    if expected is None:
        assert recorded == {}
    else:
        assert recorded[huge_pages.VARIABLE]["source"] == ("user" if user else "launcher")
        assert f"the kernel's rule: {mode}" in recorded[huge_pages.VARIABLE]["why"]


def test_set_after_torch_allocated_the_line_says_it_came_too_late():
    code = ("import os, torch\nfrom launcher.mpi import huge_pages\ntorch.zeros(1)\n"
            "os.environ[huge_pages.VARIABLE] = '1'\nprint(huge_pages.line('madvise'))\n"
            "print(huge_pages.line('never'))")
    environ = {k: v for k, v in clean_environ().items() if k != huge_pages.VARIABLE}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "huge pages: off: torch allocated before THP_MEM_ALLOC_ENABLE=1 was set; set it in "
        "the job's environment",
        "huge pages: off: the kernel's rule is never"]


def test_a_jobs_large_buffers_are_in_huge_pages_where_its_ranks_use_cma(monkeypatch):
    """Two ranks of one node under mpiexec with the mpi backend: where the launcher turned CMA
    on (this machine: the node's probe finds it works), torch's 8 MiB buffer (DDP's buckets
    are up to 25 MiB) has huge pages in it; on a kernel that gives none, or with CMA off, the
    launcher did not ask."""
    for name in (huge_pages.VARIABLE, "MPIR_CVAR_CH4_CMA_ENABLE"):  # the launcher's to decide
        monkeypatch.delenv(name, raising=False)
    code = ("import os, torch, launcher\nfrom launcher.mpi import huge_pages, single_copy\n"
            "with launcher.distributed('mpi') as job:\n"
            "    grads = torch.ones(2 << 20)\n"
            "    torch.distributed.all_reduce(grads)\n"
            "    held = huge_pages.backed_bytes(grads.data_ptr(), grads.nbytes)\n"
            "    job.print((single_copy.decided() or (False,))[0],\n"
            "              os.environ.get(huge_pages.VARIABLE), huge_pages.taken(),\n"
            "              held >= 2 << 20, grads[0].item())")
    done = run_mpi(2, ["-c", code], timeout=120)
    assert done.returncode == 0, done.output
    cma_on = done.stdout.startswith("True ")
    if cma_on and huge_pages.system_mode() in ("madvise", "always"):
        assert done.stdout == "True 1 True True 2.0\n", done.output
    else:
        assert done.stdout.split()[1:3] == ["None", "False"], done.output


@pytest.mark.skipif(huge_pages.system_mode() not in ("madvise", "always"),
                    reason="the kernel gives no transparent huge pages")
def test_glibcs_tunable_puts_torchs_buffers_below_2_mib_in_huge_pages_too():
    """The opt-in docs/launching.md gives: torch's own rule stops at 2 MiB, and a buffer glibc
    serves from its heap (once a large one was freed) is in the heap's 4 KiB pages, unless
    glibc, told as the process starts, advises its heap to huge pages."""
    code = ("import torch\nfrom launcher.mpi import huge_pages\n"
            "big = torch.ones(1 << 20)\ndel big\n"  # glibc serves what follows from its heap
            "grads = torch.ones(1 << 18)\n"  # 1 MiB, DDP's first bucket
            "print(huge_pages.backed_bytes(grads.data_ptr(), grads.nbytes) >= 2 << 20)\n"
            "print(huge_pages.line().split(')', 1)[1])")  # launcher.check's words after torch's
    environ = {**clean_environ(), huge_pages.VARIABLE: "1"}
    environ.pop("GLIBC_TUNABLES", None)
    seen = []
    for tunables in ({}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**environ, **tunables}, timeout=120)
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.splitlines())
    assert seen == [["False", ""], ["True", "; smaller ones too: glibc's heap advised "
                                           "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1)"]]
