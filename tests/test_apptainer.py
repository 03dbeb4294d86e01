"""apptainer/ddp-FLAVOR.def: generated from the Dockerfile, parsed with spython, exact commands.

No Apptainer binary exists for Debian 12 or on PyPI: `invoke sif --builder apptainer` is checked
by its exact command line here; the SIF itself is built natively and run in tests/test_sif.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from spython.main.parse.parsers import SingularityParser

from ddp_tasks import apptainer_def, flavors, sif_build
from ddp_tasks import image_commands as ic
from launcher import __version__
from launcher.core.errors import LaunchError

INVOKE = [sys.executable, "-m", "invoke"]
APPTAINER_SIF = [*INVOKE, "sif", "--builder", "apptainer"]


def parse(path) -> object:
    return SingularityParser(str(path)).recipe["spython-base"]


def labels(recipe) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in recipe.labels)


@pytest.mark.parametrize("flavor", flavors.NAMES)
def test_the_committed_definition_is_the_generated_one(flavor):
    """apptainer/ddp-FLAVOR.def is written by `invoke sif-defs`: a change to the Dockerfile's
    pins, labels or ENV that did not regenerate it fails here."""
    assert ic.apptainer_def(flavor).read_text() == apptainer_def.definition(flavor), (
        "run `invoke sif-defs` and commit apptainer/")


def test_a_pin_changed_in_the_dockerfile_changes_the_definition():
    dockerfile = ic.DOCKERFILE.read_text().replace("ARG TORCH_VERSION=2.13.0",
                                                   "ARG TORCH_VERSION=9.9.9")
    assert "io.ddp.torch 9.9.9" in apptainer_def.definition("cpu", dockerfile)


@pytest.mark.parametrize("flavor", flavors.NAMES)
def test_def_labels_pin_the_dockerfile_versions(flavor):
    args = apptainer_def.flavor_args(flavor, ic.pins())
    found = labels(parse(ic.apptainer_def(flavor)))
    assert found["io.ddp.torch"] == args["TORCH_VERSION"]
    assert found["io.ddp.mpi4py"] == args["MPI4PY_VERSION"]
    assert found["io.ddp.python"] == args["PYTHON_VERSION"]
    assert found["io.ddp.flavor"] == flavor
    assert found["io.ddp.mpi"].startswith(f"mpich {args['MPICH_VERSION']} ")
    assert found["io.ddp.mpi.openmpi"].startswith(f"openmpi {args['OPENMPI_VERSION']} ")
    assert ("io.ddp.cuda" in found) is (flavor == "cuda")


@pytest.mark.parametrize("flavor", flavors.NAMES)
def test_def_environment_matches_the_image(flavor):
    recipe = parse(ic.apptainer_def(flavor))
    assert recipe.fromHeader == ic.image_tag(ic.DEFAULT_NAME, flavor)
    assert "PATH=/opt/ddp/venv/bin:$PATH" in recipe.environ
    identity = ic.image_identity(ic.DEFAULT_NAME, __version__, flavor)
    assert f"DDP_IMAGE=${{DDP_IMAGE:-{identity}}}" in recipe.environ
    assert "PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}" in recipe.environ
    # no fixed CMA setting: the launcher decides it on each node (launcher/mpi/cma.py)
    assert "MPIR_CVAR_CH4_CMA_ENABLE" not in "\n".join(recipe.environ)
    assert "python -m launcher.check" in "\n".join(recipe.install)  # spython's form of %test
    assert recipe.cmd == 'exec python -m launcher.train "$@"'


@pytest.mark.parametrize(("source", "image"), [
    ("docker-daemon", "ddp:cuda"),
    ("docker-archive", "ddp-cpu.tar"),
    ("docker", "registry.example.org:5000/team/ddp:cpu"),
])
def test_sif_definition_points_the_header_at_the_image(tmp_path, source, image):
    text = ic.sif_definition(ic.apptainer_def("cpu").read_text(), source, image)
    (tmp_path / "ddp.def").write_text(text)
    assert text.splitlines()[:2] == [f"Bootstrap: {source}", f"From: {image}"]
    assert parse(tmp_path / "ddp.def").fromHeader == image
    # only the header changes
    assert text.splitlines()[2:] == ic.apptainer_def("cpu").read_text().splitlines()[2:]


def test_sif_definition_rejects_an_unknown_source():
    with pytest.raises(LaunchError) as error:
        ic.sif_definition("Bootstrap: docker\nFrom: x\n", "oras", "x")
    assert "docker-daemon" in error.value.hint


def test_sif_plan_uses_the_repository_def_for_the_default_image():
    path, _, command = sif_build.sif_plan(output="ddp-cpu.sif", flavor="cpu",
                                            source="docker-daemon", image="ddp:cpu")
    assert path == ic.apptainer_def("cpu")
    assert command == ["apptainer", "build", "ddp-cpu.sif", str(path)]


def test_sif_dry_run_prints_the_exact_command():
    result = subprocess.run([*APPTAINER_SIF, "--dry-run"], cwd=ic.ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"apptainer build ddp-cpu.sif {ic.apptainer_def('cpu')}")


def test_sif_dry_run_for_cuda_shows_a_cuda_definition_with_nv():
    result = subprocess.run([*APPTAINER_SIF, "--flavor", "cuda", "--dry-run"], cwd=ic.ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "From: ddp:cuda" in result.stdout and "io.ddp.flavor cuda" in result.stdout
    assert "apptainer exec --nv ddp-cuda.sif" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        f"apptainer build ddp-cuda.sif {ic.apptainer_def('cuda')}")


def test_sif_dry_run_for_a_registry_image_with_fakeroot():
    result = subprocess.run(
        [*APPTAINER_SIF, "--dry-run", "--fakeroot", "--source", "docker",
         "--image", "127.0.0.1:5000/ddp:cpu", "--output", "out.sif"],
        cwd=ic.ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = f"apptainer build --fakeroot out.sif {ic.ROOT / 'build' / 'ddp-cpu-docker.def'}"
    assert result.stdout.splitlines()[-1] == expected
