"""apptainer/ddp.def: parsed with spython, pins equal to the Dockerfile's, exact build commands.

No Apptainer binary exists for Debian 12 or on PyPI, so the SIF itself is not built here: the
definition is checked by parsing and `invoke sif --dry-run` by its exact command line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from spython.main.parse.parsers import SingularityParser

from ddp_tasks import image as image_tasks
from ddp_tasks import image_commands as ic
from launcher.errors import LaunchError

INVOKE = [sys.executable, "-m", "invoke"]


def parse(path) -> object:
    return SingularityParser(str(path)).recipe["spython-base"]


def labels(recipe) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in recipe.labels)


def test_def_labels_pin_the_dockerfile_versions():
    pins = ic.pins()
    found = labels(parse(ic.APPTAINER_DEF))
    assert found["io.ddp.torch"] == pins["TORCH_VERSION"]
    assert found["io.ddp.mpi4py"] == pins["MPI4PY_VERSION"]
    assert found["io.ddp.python"] == pins["PYTHON_VERSION"]
    assert found["io.ddp.flavor"] == pins["FLAVOR"]
    assert found["io.ddp.mpi"].startswith(f"mpich {pins['MPICH_VERSION']} ")
    assert found["io.ddp.mpi.openmpi"].startswith(f"openmpi {pins['OPENMPI_VERSION']} ")


def test_def_environment_matches_the_image():
    recipe = parse(ic.APPTAINER_DEF)
    assert recipe.fromHeader == ic.image_tag(ic.DEFAULT_NAME, "cpu")
    assert "PATH=/opt/ddp/venv/bin:$PATH" in recipe.environ
    assert f"DDP_IMAGE=${{DDP_IMAGE:-{ic.pins()['DDP_IMAGE']}}}" in recipe.environ
    assert "python -m launcher.check" in "\n".join(recipe.install)  # spython's form of %test
    assert recipe.cmd == 'exec python -m launcher.train "$@"'


@pytest.mark.parametrize(("source", "image"), [
    ("docker-daemon", "ddp:cuda"),
    ("docker-archive", "ddp-cpu.tar"),
    ("docker", "registry.example.org:5000/team/ddp:cpu"),
])
def test_sif_definition_points_the_header_at_the_image(tmp_path, source, image):
    text = ic.sif_definition(ic.APPTAINER_DEF.read_text(), source, image)
    (tmp_path / "ddp.def").write_text(text)
    assert text.splitlines()[:2] == [f"Bootstrap: {source}", f"From: {image}"]
    assert parse(tmp_path / "ddp.def").fromHeader == image
    # only the header changes
    assert text.splitlines()[2:] == ic.APPTAINER_DEF.read_text().splitlines()[2:]


def test_sif_definition_rejects_an_unknown_source():
    with pytest.raises(LaunchError) as error:
        ic.sif_definition("Bootstrap: docker\nFrom: x\n", "oras", "x")
    assert "docker-daemon" in error.value.hint


def test_sif_plan_uses_the_repository_def_for_the_default_image():
    path, _, command = image_tasks.sif_plan(output="ddp-cpu.sif", source="docker-daemon",
                                            image="ddp:cpu")
    assert path == ic.APPTAINER_DEF
    assert command == ["apptainer", "build", "ddp-cpu.sif", str(ic.APPTAINER_DEF)]


def test_sif_dry_run_prints_the_exact_command():
    result = subprocess.run([*INVOKE, "sif", "--dry-run"], cwd=ic.ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"apptainer build ddp.sif {ic.APPTAINER_DEF}"


def test_sif_dry_run_for_a_registry_image_with_fakeroot():
    result = subprocess.run(
        [*INVOKE, "sif", "--dry-run", "--fakeroot", "--source", "docker",
         "--image", "127.0.0.1:5000/ddp:cpu", "--output", "out.sif"],
        cwd=ic.ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = f"apptainer build --fakeroot out.sif {ic.ROOT / 'build' / 'ddp-docker.def'}"
    assert result.stdout.splitlines()[-1] == expected
