"""``--backend``: what ``auto`` stands for, and names mapped to torch backends."""

from __future__ import annotations

import pytest

from launcher.backends import resolve_auto, select_backend
from launcher.errors import LaunchError


@pytest.mark.parametrize(("cuda", "mpi_faster", "expected"), [
    (True, True, "nccl"), (True, False, "nccl"), (False, True, "mpi"), (False, False, "gloo")])
def test_auto_follows_the_device_then_the_measurements(cuda, mpi_faster, expected):
    assert resolve_auto("auto", cuda, mpi_faster) == expected


@pytest.mark.parametrize("explicit", ["gloo", "mpi", "nccl"])
def test_an_explicit_backend_is_the_override(explicit):
    assert resolve_auto(explicit, cuda_available=False, mpi_measured_faster=True) == explicit
    assert resolve_auto(explicit, cuda_available=True, mpi_measured_faster=False) == explicit


@pytest.mark.parametrize("name", ["auto", "tcp"])
def test_an_unresolved_or_unknown_name_is_refused_with_the_choices(name):
    with pytest.raises(LaunchError) as error:
        select_backend(name, cuda_available=False, native_mpi=False)
    assert "gloo" in error.value.hint


def test_nccl_without_cuda_names_the_cpu_backends():
    with pytest.raises(LaunchError) as error:
        select_backend("nccl", cuda_available=False, native_mpi=False)
    assert "--backend gloo or mpi" in error.value.hint
