"""The cpu image: built once by the cpu_image fixture, then run for real with docker.

The pure builders behind `invoke base/build` are checked first (no engine needed).
"""

from __future__ import annotations

import inspect
import io
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
from invoke.exceptions import Exit

from ddp_tasks import engine, flavors
from ddp_tasks import image as image_tasks
from ddp_tasks import image_commands as ic
from launcher import __version__
from launcher.core.errors import LaunchError
from tests.fixtures.docker import COLD_BUILD_TIMEOUT, assert_holds_its_lock, host_ca_bundle

# ------------------------------------------------------------------------------ pure builders

CPU = flavors.get("cpu")


def test_every_version_is_pinned_at_the_top_of_the_dockerfile():
    pins = ic.pins()
    for name in ("BASE_IMAGE", "FLAVOR", "PYTHON_VERSION", "MPICH_VERSION", "MPI4PY_VERSION",
                 "TORCH_VERSION", "NUMPY_VERSION", "SCIPY_VERSION", "SCIKIT_LEARN_VERSION"):
        assert pins.get(name), f"ARG {name} has no default"
    assert pins["TORCH_VERSION"] == "2.13.0"
    # the ARGs come before the first FROM: one place to read and change them
    text = ic.DOCKERFILE.read_text()
    header = text[:text.index("\nFROM ")]
    assert all(f"ARG {name}=" in header for name in pins if name != "SOURCE_DIGEST")


def test_dockerfile_args_reads_defaults_and_bare_args():
    text = 'ARG A=1\nARG B="x y"\nARG C\nFROM x\nARG A=2\n'
    assert ic.dockerfile_args(text) == {"A": "1", "B": "x y", "C": ""}


def test_hadolint_is_clean():
    hadolint = ic.ROOT / ".venv" / "bin" / "hadolint"
    command = [str(hadolint) if hadolint.exists() else "hadolint", str(ic.DOCKERFILE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_build_args_for_cpu_keep_the_dockerfile_defaults():
    args = ic.build_args(flavor=flavors.get("cpu"), identity="ddp:0.1.0+cpu", torch_index_url="",
                         source_digest="abc", base_image="ddp-base:bookworm")
    assert args == {"FLAVOR": "cpu", "BASE_IMAGE": "ddp-base:bookworm",
                    "DDP_IMAGE": "ddp:0.1.0+cpu", "TORCH_INDEX_URL": "",
                    "SOURCE_DIGEST": "abc", "KEEP_EXTRA_CA": "0"}


def test_build_args_for_cuda_keep_the_base_and_take_pypis_torch():
    cuda = flavors.get("cuda")
    args = ic.build_args(flavor=cuda, identity="ddp:0.1.0+cuda",
                         torch_index_url=ic.torch_index_for(cuda, False), source_digest="x",
                         extra={"CUDA_VERSION": "13.1"})
    assert "BASE_IMAGE" not in args and "PYTHON_VERSION" not in args  # the Debian base
    assert args["TORCH_INDEX_URL"] == ""  # PyPI's default torch is the CUDA build
    assert args["NCCL_VERSION"] and args["CUDNN_VERSION"]
    assert args["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert args["CUDA_VERSION"] == "13.1"  # extra overrides the flavor's default


def test_a_cuda_build_leaves_cpu_torch_wheels_out(tmp_path):
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl"):
        (wheelhouse / name).write_bytes(b"")
    for flavor, expected in (("cpu", 1), ("cuda", 0)):
        inputs = engine.stage_build_inputs(str(wheelhouse), "", root=tmp_path,
                                           flavor=flavors.get(flavor))
        assert len(list((inputs / ic.TORCH_INPUTS).iterdir())) == expected
        assert [p.name for p in (inputs / ic.BASE_INPUTS / "wheelhouse").iterdir()] == [
            "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl"]


def test_a_wheelhouse_with_torch_replaces_the_torch_index():
    assert ic.torch_index_for(flavors.get("cpu"), True) == ""
    assert ic.torch_index_for(flavors.get("cpu"), False) == "https://download.pytorch.org/whl/cpu"


def test_bad_flavor_and_bad_build_args_say_how_to_fix_them():
    with pytest.raises(LaunchError) as error:
        ic.image_tag("ddp", "rocm")
    assert "cpu, cuda" in error.value.hint
    with pytest.raises(LaunchError) as error:
        ic.parse_build_args("TORCH_VERSION")
    assert "NAME=VALUE" in error.value.hint
    assert ic.parse_build_args("A=1, B=x=y,") == {"A": "1", "B": "x=y"}


def test_base_commands():
    assert ic.debootstrap_command("/tmp/r") == [
        "debootstrap", "--variant=minbase", "bookworm", "/tmp/r", "http://deb.debian.org/debian"]
    assert ic.apt_sources().splitlines() == [
        "deb http://deb.debian.org/debian bookworm main",
        "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://deb.debian.org/debian-security bookworm-security main"]


def test_push_reference():
    assert ic.push_reference("127.0.0.1:5000/", "ddp", "cpu") == ("127.0.0.1:5000/ddp", "cpu")
    assert ic.push_reference("ghcr.io/org", "ddp", "cuda") == ("ghcr.io/org/ddp", "cuda")


def test_stage_build_inputs_is_stateless(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"w")
    (wheels / "notes.txt").write_text("not a wheel")
    bundle = tmp_path / "ca.crt"
    bundle.write_text("CERT")
    inputs = engine.stage_build_inputs(str(wheels), str(bundle), root=tmp_path, flavor=CPU)
    assert sorted(p.name for p in (inputs / ic.TORCH_INPUTS).iterdir()) == [
        "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"]
    assert (inputs / ic.BASE_INPUTS / ic.CA_BUNDLE_NAME).read_text() == "CERT"
    inputs = engine.stage_build_inputs("", "", root=tmp_path, flavor=CPU)
    assert not (inputs / ic.BASE_INPUTS / ic.CA_BUNDLE_NAME).exists()
    assert list((inputs / ic.BASE_INPUTS / "wheelhouse").iterdir()) == []
    assert list((inputs / ic.TORCH_INPUTS).iterdir()) == []


def test_stage_build_inputs_names_missing_inputs(tmp_path):
    with pytest.raises(LaunchError, match="is not a directory"):
        engine.stage_build_inputs(str(tmp_path / "nope"), "", root=tmp_path, flavor=CPU)
    with pytest.raises(LaunchError, match="does not exist") as error:
        engine.stage_build_inputs("", str(tmp_path / "nope.crt"), root=tmp_path, flavor=CPU)
    assert "ca-certificates.crt" in error.value.hint


@pytest.mark.parametrize("filename, cpu, cuda", [
    ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", True, False),
    ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", True, True),
    ("torchvision-0.28.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", True, True),
])
def test_a_flavor_without_a_local_torch_version_refuses_torch_wheels_with_one(filename, cpu,
                                                                               cuda):
    assert (flavors.get("cpu").fits_wheel(filename), flavors.get("cuda").fits_wheel(filename)) \
        == (cpu, cuda)


def test_the_default_wheelhouse_is_optional_a_named_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(ic, "ROOT", tmp_path)
    assert engine.wheelhouse_source(ic.DEFAULT_WHEELHOUSE) is None
    assert engine.wheelhouse_source("") is None
    with pytest.raises(LaunchError, match="wheels is not a directory") as error:
        engine.wheelhouse_source("wheels")
    assert "pip download" in error.value.hint
    (tmp_path / "wheels").mkdir()
    assert engine.wheelhouse_source("wheels") == tmp_path / "wheels"


def _tasks_taking_a_flavor():
    import tasks

    every = [*tasks.ns.tasks.values(),
             *(t for sub in tasks.ns.collections.values() for t in sub.tasks.values())]
    return [t for t in every if "flavor" in inspect.signature(t.body).parameters]


@pytest.mark.parametrize("task", _tasks_taking_a_flavor(), ids=lambda t: t.name)
def test_every_task_names_an_unknown_flavor_before_any_work(task, capsys):
    """One error and one HINT listing the flavors, before Docker or any tool is asked."""
    with pytest.raises(Exit) as stopped:
        task.body(None, flavor="rocm")
    assert str(stopped.value.message).splitlines() == [
        "error: unknown image flavor 'rocm'", "HINT: use one of: cpu, cuda"]
    assert capsys.readouterr().out == ""


def test_the_flavor_tasks_are_the_image_tasks():
    assert {t.name for t in _tasks_taking_a_flavor()} == {
        "build", "push", "chimage", "sif", "lock"}


@pytest.mark.parametrize("task", image_tasks.TASKS, ids=lambda t: t.name)
def test_every_task_parameter_is_documented(task):
    parameters = list(inspect.signature(task.body).parameters)[1:]  # after the context
    assert sorted(task.help) == sorted(parameters)


# ------------------------------------------------------------------------------- real image

IDENTITY = f"ddp:{__version__}+cpu"


def docker_test(function):
    """Marked docker, with room for the cold build whichever test comes first pays for."""
    return pytest.mark.docker(pytest.mark.timeout(COLD_BUILD_TIMEOUT)(function))


@docker_test
def test_check_passes_on_one_rank(cpu_image, run_in_image):
    status, output = run_in_image(cpu_image, ["python", "-m", "launcher.check"])
    assert status == 0, output
    assert IDENTITY in output


@docker_test
def test_check_passes_on_two_ranks_with_the_image_mpiexec(cpu_image, run_in_image):
    status, output = run_in_image(cpu_image, ["mpiexec", "-n", "2", "python", "-m",
                                              "launcher.check"])
    assert status == 0, output
    assert IDENTITY in output


@docker_test
def test_auto_is_the_mpi_backend_under_the_image_mpiexec(cpu_image, run_in_image):
    """The .pth line loads MPI before the entry point: its own MPI4PY_LIBMPI must not read as
    the user's choice, which made --backend auto fall back to gloo in the image."""
    status, output = run_in_image(cpu_image, [
        "mpiexec", "-n", "2", "python", "-m", "launcher.train", "--max-steps", "2",
        "--run-dir", "/tmp/run", "--data-dir", "/tmp/data"], shm_size="1g")
    assert status == 0, output
    # the compiled backend: the image's build stage made it for this MPI
    assert "2 rank(s), backend mpi_cxx, device cpu" in output, output


#: a plain `import mpi4py` as a user's script would, without starting MPI
_LIBRARY = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.__file__.split('/')[-1].split('.')[1], "
            "MPI.Get_library_version().splitlines()[0])")


@docker_test
@pytest.mark.parametrize("pmi_variables, expected", [
    ({}, f"mpich MPICH Version:      {ic.pins()['MPICH_VERSION']}"),
    ({"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "3", "MPI_LOCALRANKID": "0",
      "MPI_LOCALNRANKS": "1"}, f"mpich MPICH Version:      {ic.pins()['MPICH_VERSION']}"),
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "test", "OMPI_COMM_WORLD_RANK": "0",
      "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, f"openmpi Open MPI v{ic.pins()['OPENMPI_VERSION']}"),
    # the MPI-5 standard ABI, through the extension the image compiles for it
    ({"MPI4PY_LIBMPI": "/opt/ddp/venv/lib/libmpi_abi.so.1"},
     f"mpiabi MPICH Version:      {ic.pins()['MPICH_VERSION']}"),
])
def test_every_python_in_the_image_picks_the_mpi_of_its_pmi(cpu_image, run_in_image,
                                                            pmi_variables, expected):
    """The venv makes the launcher's choice at start-up (launcher/mpi/library.py), so a
    user's own mpi4py script loads MPICH under PMI-1/2 and Open MPI under PMIx."""
    status, output = run_in_image(cpu_image, ["python", "-c", _LIBRARY],
                                  environment=pmi_variables)
    assert status == 0, output
    assert output.startswith(expected), output


@docker_test
def test_runtime_is_lean_non_root_and_keeps_no_build_input(cpu_image, run_in_image):
    script = ("id -u; for tool in gcc cc make; do command -v $tool && echo HAS-$tool; done; "
              "ls /tmp/build-inputs /etc/pip.conf /opt/ddp/venv/pip.conf 2>&1; "
              "echo CA-FILES=$(ls -A /opt/ddp/ca | wc -l); "
              "ls /etc/ssh/ssh_host_* 2>&1; command -v sshd ssh ps ip; "
              # the host's tasks and their dependencies: no rank runs them
              "for module in invoke docker spython ddp_tasks; do "
              "python -c \"import $module\" 2>/dev/null && echo HAS-$module; done")
    status, output = run_in_image(cpu_image, ["bash", "-c", script])
    assert output.splitlines()[0] == "1000"
    assert "HAS-" not in output
    for absent in ("/tmp/build-inputs", "/etc/pip.conf", "/opt/ddp/venv/pip.conf",
                   "/etc/ssh/ssh_host_*"):
        assert f"cannot access '{absent}': No such file" in output
    assert "CA-FILES=0" in output
    for tool in ("/usr/sbin/sshd", "/usr/bin/ssh", "/usr/bin/ps", "/usr/sbin/ip"):
        assert tool in output


@docker_test
def test_labels_and_identity(cpu_image, dockerd):
    image = dockerd.images.get(cpu_image)
    pins = ic.pins()
    labels = image.labels
    assert labels["io.ddp.torch"] == pins["TORCH_VERSION"]
    assert labels["io.ddp.mpi4py"] == pins["MPI4PY_VERSION"]
    assert labels["io.ddp.mpi"].startswith(f"mpich {pins['MPICH_VERSION']} ")
    assert labels["io.ddp.mpi.openmpi"].startswith(f"openmpi {pins['OPENMPI_VERSION']} ")
    assert labels["io.ddp.flavor"] == "cpu"
    assert labels["org.opencontainers.image.version"] == IDENTITY
    assert re.fullmatch(r"[0-9a-f]{16}", labels["io.ddp.source-digest"])
    assert f"DDP_IMAGE={IDENTITY}" in image.attrs["Config"]["Env"]
    assert image.attrs["Config"]["User"] == "1000:1000"


def _stand_in_torch_wheel(directory: Path, local: str, cuda: str | None) -> Path:
    """A wheel named torch 2.13.0+LOCAL whose ``torch.version.cuda`` is CUDA: what pip would
    install, for the build's guard, without gigabytes of the real one."""
    version = f"{ic.pins()['TORCH_VERSION']}+{local}"
    wheel = directory / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": "from torch import version\n",
        "torch/version.py": f"__version__ = {version!r}\ncuda = {cuda!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            # fixed dates: the same bytes every run, so the engine's cache takes the failed
            # build's layers again instead of keeping one more copy per run
            archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return wheel


@docker_test
@pytest.mark.parametrize("local, cuda", [("cu130", "13.0"), ("cpu", None)],
                         ids=["only-pypis-cuda-torch", "a-cpu-wheel-the-lock-does-not-know"])
def test_a_cpu_build_without_the_locked_torch_stops_with_a_hint(dockerd, base_image, tmp_path,
                                                                local, cuda):
    """The trap of a closed network: no CPU index, no CPU wheel, and pip would take PyPI's CUDA
    torch for the cpu flavor without a word (a 5 GB image labelled cpu). The lock names the
    +cpu build and its hash: a stand-in CUDA torch (playing PyPI's) is never taken, a stand-in
    +cpu wheel is refused by its hash; the build stops at it with the fix, and tags nothing."""
    wheelhouse = tmp_path / "wheelhouse"
    _stand_in_torch_wheel(wheelhouse, local, cuda)
    log = io.StringIO()
    with pytest.raises(LaunchError, match="image build failed"):
        image_tasks.build_image(flavor="cpu", name="ddp-guard", base_image=base_image,
                                wheelhouse=str(wheelhouse), ca_bundle=host_ca_bundle(), out=log)
    text = log.getvalue()
    version = ic.pins()["TORCH_VERSION"]
    assert f"error: pip could not install the locked torch=={version}+cpu for the cpu " \
           "flavor" in text, text
    assert f"HINT: pip download --no-deps torch=={version} --index-url" in text, text
    assert not engine.image_exists(dockerd, "ddp-guard:cpu")


@docker_test
def test_the_image_holds_exactly_its_lock(cpu_image, run_in_image):
    """Two builds of one commit have one `pip freeze`: the lock's."""
    assert_holds_its_lock(cpu_image, "cpu", run_in_image)
