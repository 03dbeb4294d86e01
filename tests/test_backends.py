"""``--backend``: what ``auto`` stands for, and names mapped to torch backends."""

from __future__ import annotations

import pytest

from launcher.backends import select_backend
from launcher.errors import LaunchError


@pytest.mark.parametrize(("cuda", "expected"), [(True, "nccl"), (False, "gloo")])
def test_auto_follows_the_device(cuda, expected):
    assert select_backend("auto", cuda_available=cuda, native_mpi=False) == expected


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(LaunchError) as error:
        select_backend("tcp", cuda_available=False, native_mpi=False)
    assert "gloo" in error.value.hint


def test_nccl_without_cuda_names_the_cpu_backends():
    with pytest.raises(LaunchError) as error:
        select_backend("nccl", cuda_available=False, native_mpi=False)
    assert "--backend gloo or mpi" in error.value.hint
