"""The cuda image, built for real on this CPU-only machine and checked with 2 ranks over MPI.

Same Debian base as cpu; torch is PyPI's default wheel, which is the CUDA build and brings the
CUDA user space, cuDNN and NCCL as wheels. Without a GPU, CUDA is reported absent (not a
failure) while torch still names the CUDA and NCCL it was built with.
"""

from __future__ import annotations

import pytest

from ddp_tasks import flavors
from launcher import __version__
from tests.fixtures.docker import COLD_BUILD_TIMEOUT, assert_holds_its_lock

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2 * COLD_BUILD_TIMEOUT)]

PINS = flavors.get("cuda").build_args


def test_check_passes_on_two_ranks_over_mpi(cuda_image, run_in_image):
    status, output = run_in_image(cuda_image, ["mpiexec", "-n", "2", "python", "-m",
                                               "launcher.check", "--backend", "mpi"])
    assert status == 0, output
    assert f"ddp:{__version__}+cuda" in output
    assert f"cuda: {PINS['CUDA_VERSION']}" in output, output
    assert f"nccl: {PINS['NCCL_VERSION']}" in output, output


def test_labels_environment_and_nothing_ranks_do_not_run(cuda_image, dockerd, run_in_image):
    image = dockerd.images.get(cuda_image)
    labels = image.labels
    assert labels["io.ddp.flavor"] == "cuda"
    for label, pin in (("io.ddp.cuda", "CUDA_VERSION"), ("io.ddp.cudnn", "CUDNN_VERSION"),
                       ("io.ddp.nccl", "NCCL_VERSION")):
        assert labels[label] == PINS[pin], label
    environment = dict(item.split("=", 1) for item in image.attrs["Config"]["Env"])
    assert environment["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert environment["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    script = ("site=$(python -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))'); "
              "find $site/nvidia -name include -o -name '*.a' | head -3; echo END")
    status, output = run_in_image(cuda_image, ["bash", "-c", script])
    assert status == 0 and output.strip() == "END", output


def test_the_image_holds_exactly_its_lock(cuda_image, run_in_image):
    """Every CUDA wheel included: two builds of one commit have one `pip freeze`."""
    assert_holds_its_lock(cuda_image, "cuda", run_in_image)
