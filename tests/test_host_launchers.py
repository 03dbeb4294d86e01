"""The image under the host's launcher, for real: ranks started by srun (PMI-2, PMIx, the
site's MpiDefault), MPICH's Hydra ``mpiexec`` or Open MPI's ``mpirun`` on the host, each rank
running in the cpu image through Charliecloud's ``ch-run`` (the runtime of Apptainer's kind that
installs here).

Hybrid model: the image's own MPI joins the host launcher; ``launcher.mpi.library`` picks
MPICH for PMI-1/PMI-2 and Open MPI for PMIx. Bind model: the host's MPI library is bound into
the image's empty /opt/host-mpi/lib and named on LD_LIBRARY_PATH; nothing else is set.

Each case runs ``launcher.check --backend mpi`` (every rank reports the MPI it loaded) and a
short ``launcher.train --backend mpi`` whose weights must hash the same on every rank. The ch-run
command lines come from ``ddp_tasks.runtimes`` (what ``invoke run --runtime charliecloud``
prints), except where a test spells out the acceptance command of the issue.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_tasks.commands import Launch, container_argv, program_env
from launcher.mpi import huge_pages
from tests.fixtures.docker import COLD_BUILD_TIMEOUT
from tests.fixtures.host_mpi import (
    IMPI_ENV,
    IMPI_VERSION,
    OPENMPI4_VERSION,
    OPENMPI_ROOT_ENV,
    OPENMPI_VERSION,
)
from tests.fixtures.mpi import REPO_ROOT, clean_environ, mpiexec_path
from tests.fixtures.tasks_cli import on_path

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(COLD_BUILD_TIMEOUT)]

#: ranks import torch on a 2-core machine; a launch that forms no world fails in seconds
RUN_TIMEOUT = 300
#: the scratch mount point the image provides (ch-run cannot create bind targets)
SCRATCH = "/scratch"
HOST_MPI_LIB = "/opt/host-mpi/lib"
TRAIN = ["--backend", "mpi", "--epochs", "1", "--run-dir", f"{SCRATCH}/run",
         "--data-dir", f"{SCRATCH}/data"]
# not anchored to lines: Intel's Hydra may join two ranks' lines into one
HASH = re.compile(r"param-sha256 rank=(\d+) ([0-9a-f]{64})")
LIBMPI_PATH = re.compile(r"^libmpi_path: (\S+)$", re.M)
MPICH = "MPICH Version: 5.0.2"
OPENMPI = f"Open MPI v{OPENMPI_VERSION}"
#: how launcher.check names the compiled mpi backend built in the image
COMPILED = "the compiled mpi backend (/opt/ddp/venv/lib/ddp-ext/"


def _user_env() -> dict[str, str]:
    # ch-run refuses to start without USER; CI's environment may not set it
    return {"USER": os.environ.get("USER") or getpass.getuser()}


def ch_run(image: Path, scratch: Path, binds: tuple[str, ...] = (),
           env: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """``ch-run ... IMAGE --`` as ``invoke run --runtime charliecloud`` builds it for the
    tests' launches: 2 ranks on this one node (``--join-ct=2``)."""
    launch = Launch(runtime="charliecloud", image=str(image), procs_per_node=2,
                    binds=(f"{scratch}:{SCRATCH}", *binds), env=program_env("USR1", extra=env))
    return container_argv(launch)


def cma_line(result) -> str:
    """The node's one line on MPI's single-copy transfers (launcher/mpi/cma.py), from local rank 0
    of a launch on one node."""
    lines = [line for line in result.stderr.splitlines() if "(CMA) on " in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def run_host(argv: list[str], env: dict[str, str] | None = None,
             timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """A host launcher's command line, its whole process group killed on timeout."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_environ({**_user_env(), **(env or {})}),
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{argv[0]} ran over {timeout} s\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def passed_check(result, library: str, libmpi: str, pmi: str, runs: str = "") -> None:
    """``launcher.check`` passed, every rank on ``library`` from ``libmpi`` under ``pmi``, rank 0
    on the mpi backend that ``runs`` begins to name (where given)."""
    out = result.stdout.replace("\0", "")
    report = f"exit {result.returncode}\n{out}\n{result.stderr}"
    assert result.returncode == 0 and "check passed" in out, report
    assert f"mpi_library: {library}" in out, report  # the footer: the same on every rank
    assert LIBMPI_PATH.findall(out) == [libmpi], report
    assert f"pmi: {pmi}" in out, report
    assert f"mpi: rank 0 runs {runs}" in out, report


def equal_hashes(result, ranks: int = 2) -> str:
    out = result.stdout.replace("\0", "")
    assert result.returncode == 0, f"exit {result.returncode}\n{out}\n{result.stderr}"
    hashes = dict(HASH.findall(out))
    assert sorted(hashes) == [str(r) for r in range(ranks)], out
    assert len(set(hashes.values())) == 1, out
    return hashes["0"]


# -- hybrid: the image's MPI joins the host launcher ------------------------------------------


@pytest.mark.slurm
@pytest.mark.parametrize("plugin, library, libmpi", [
    ("pmi2", MPICH, "/opt/ddp/venv/lib/libmpi.so.12"),
    ("pmix", OPENMPI, "/opt/ddp/openmpi/lib/libmpi.so.40"),
])
@pytest.mark.parametrize("how", ["--mpi", "MpiDefault"])
def test_srun_starts_ranks_in_the_image(slurm_cluster, ch_image, tmp_path, plugin, library,
                                        libmpi, how):
    """srun with PMI-2 or PMIx, asked for with --mpi or set as the site's default."""
    ch = ch_run(ch_image, tmp_path)
    mpi = [f"--mpi={plugin}"] if how == "--mpi" else []
    with slurm_cluster.mpi_default(plugin if how == "MpiDefault" else "none"):
        check = slurm_cluster.srun(["-n", "2", *mpi, *ch, "python", "-m", "launcher.check",
                                    "--backend", "mpi"], timeout=RUN_TIMEOUT, env=_user_env())
        passed_check(check, library, libmpi, "pmix" if plugin == "pmix" else "pmi")
        # ch-run --join: the node's ranks share a user namespace, so CMA comes on, and with it
        # huge pages for torch's large buffers, set as the image's Python starts
        assert ": on: 2 local ranks in one user namespace" in cma_line(check)
        [pages] = [x for x in check.stderr.splitlines() if x.startswith("huge pages: ")]
        kernel_gives = huge_pages.system_mode() in ("madvise", "always")
        assert pages.startswith("huge pages: on" if kernel_gives else "huge pages: off"), pages
        train = slurm_cluster.srun(["-n", "2", *mpi, *ch, "python", "-m", "launcher.train",
                                    *TRAIN], timeout=RUN_TIMEOUT, env=_user_env())
    equal_hashes(train)


@pytest.mark.slurm
@pytest.mark.parametrize("plugin", ["pmi2", "pmix"])
def test_the_acceptance_command_needs_no_set_env(slurm_cluster, ch_image, tmp_path, plugin):
    """``srun -n 2 --mpi=P ch-run IMG -- python -m launcher.train --backend mpi``, literally:
    without --set-env ch-run applies none of the image's ENV, and `python` is the host's PATH
    finding the image's /usr/local/bin/python."""
    train = slurm_cluster.srun(
        ["-n", "2", f"--mpi={plugin}", "ch-run", "-b", f"{tmp_path}:{SCRATCH}", str(ch_image),
         "--", "python", "-m", "launcher.train", *TRAIN], timeout=RUN_TIMEOUT, env=_user_env())
    equal_hashes(train)
    # without --join each rank has a user namespace of its own: CMA off, and why
    assert ": off: the 2 local ranks are in 2 user namespaces" in cma_line(train)


@pytest.mark.slurm
def test_srun_without_pmi_is_one_clear_error(slurm_cluster, ch_image, tmp_path):
    """``srun --mpi=none`` cannot form an MPI world: exit 2 on every rank, a HINT, no hang."""
    start = time.monotonic()
    result = slurm_cluster.srun(["-n", "2", "--mpi=none", *ch_run(ch_image, tmp_path), "python",
                                 "-m", "launcher.check", "--backend", "mpi"],
                                timeout=RUN_TIMEOUT, env=_user_env())
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("without a PMI") == 2, result.stderr
    assert result.stderr.count("HINT: under Slurm pass srun --mpi=pmi2") == 2, result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 120


@pytest.mark.mpi
def test_host_hydra_mpiexec_starts_ranks_in_the_image(ch_image, tmp_path):
    ch = ch_run(ch_image, tmp_path)
    mpiexec = [str(mpiexec_path()), "-n", "2", *ch, "python", "-m"]
    check = run_host([*mpiexec, "launcher.check", "--backend", "mpi"])
    passed_check(check, MPICH, "/opt/ddp/venv/lib/libmpi.so.12", "pmi")
    assert ": on: 2 local ranks in one user namespace" in cma_line(check)
    equal_hashes(run_host([*mpiexec, "launcher.train", *TRAIN]))


@pytest.mark.mpi
@pytest.mark.parametrize("forced", [False, True])
def test_plain_ch_run_never_sums_wrong(ch_image, tmp_path, forced):
    """One ch-run per rank (no --join): separate user namespaces. Left to the launcher, CMA
    goes off and every sum is right; forced on by the user, MPICH 5.0.2 would sum wrong, and
    the job must end with one clear error per rank instead (or, where it copes, right sums)."""
    from tests.test_cma import SUMS

    env = {"MPIR_CVAR_CH4_CMA_ENABLE": "1"} if forced else {}
    result = run_host([str(mpiexec_path()), "-n", "2", "ch-run", str(ch_image), "--",
                       "python", "-c", SUMS], env)
    output = result.stdout + result.stderr
    assert "WRONG" not in output, output
    if not forced:
        assert result.returncode == 0 and output.count(" right") == 4, output
        assert ": off: the 2 local ranks are in 2 user namespaces" in cma_line(result)
    elif result.returncode != 0:
        for rank in (0, 1):
            assert output.count(f"[rank {rank}] error: MPI delivered wrong data") == 1, output
        assert " right" not in output and "Traceback" not in output, output
    else:
        assert output.count(" right") == 4, output


@pytest.mark.mpi
def test_host_open_mpi_mpirun_starts_ranks_in_the_image(ch_image, openmpi_prefix, tmp_path):
    ch = ch_run(ch_image, tmp_path)
    mpirun = [str(openmpi_prefix / "bin" / "mpirun"), "-n", "2", "--oversubscribe", *ch,
              "python", "-m"]
    check = run_host([*mpirun, "launcher.check", "--backend", "mpi"], OPENMPI_ROOT_ENV)
    passed_check(check, OPENMPI, "/opt/ddp/openmpi/lib/libmpi.so.40", "pmix")
    assert ": on: 2 local ranks in one user namespace" in cma_line(check)
    equal_hashes(run_host([*mpirun, "launcher.train", *TRAIN], OPENMPI_ROOT_ENV))


def _invoke_run(*flags: str) -> list[str]:
    invoke = Path(sys.executable).parent / "invoke"
    return [str(invoke), "-r", str(REPO_ROOT), "run", "--runtime", "charliecloud",
            "--procs-per-node", "2", *flags]


@pytest.mark.mpi
def test_invoke_run_charliecloud_with_mpiexec(ch_image, tmp_path):
    """``invoke run --runtime charliecloud`` runs what it prints (the venv's bin on PATH)."""
    path = on_path(Path(sys.executable).parent)
    result = run_host(_invoke_run("--image", str(ch_image), "--bind", f"{tmp_path}:{SCRATCH}",
                                  "--args", " ".join(TRAIN)), {"PATH": path})
    equal_hashes(result)


@pytest.mark.slurm
def test_invoke_run_charliecloud_with_srun_pmix(slurm_cluster, ch_image, tmp_path):
    result = run_host(_invoke_run("--launcher", "srun", "--pmi", "pmix", "--image",
                                  str(ch_image), "--module", "launcher.check",
                                  "--args", "--backend mpi"), slurm_cluster.env)
    passed_check(result, OPENMPI, "/opt/ddp/openmpi/lib/libmpi.so.40", "pmix")


@pytest.mark.mpi
def test_the_mpi5_standard_abi_runs_through_the_images_mpiabi_extension(ch_image, tmp_path):
    """MPICH 5's standard-ABI build (libmpi_abi.so.1), named with MPI4PY_LIBMPI: mpi4py loads
    the extension the image compiles for that ABI (the wheel has none)."""
    abi_library = "/opt/ddp/venv/lib/libmpi_abi.so.1"
    ch = ch_run(ch_image, tmp_path, env=(("MPI4PY_LIBMPI", abi_library),))
    mpiexec = [str(mpiexec_path()), "-n", "2", *ch, "python", "-m"]
    check = run_host([*mpiexec, "launcher.check", "--backend", "mpi"])
    passed_check(check, MPICH, abi_library, "pmi")
    assert "mpi_abi: mpiabi" in check.stdout, check.stdout
    equal_hashes(run_host([*mpiexec, "launcher.train", *TRAIN]))


@pytest.mark.mpi
def test_your_own_script_runs_in_the_image(ch_image, tmp_path):
    """A copy of examples/tokens_transformer.py in the user's directory, bound in: `import
    launcher` finds the image's package, and the ranks train with equal parameters."""
    (tmp_path / "my_train.py").write_text(
        (REPO_ROOT / "examples" / "tokens_transformer.py").read_text())
    mpiexec = [str(mpiexec_path()), "-n", "2", *ch_run(ch_image, tmp_path), "python"]
    result = run_host([*mpiexec, f"{SCRATCH}/my_train.py", "--steps", "30", "--backend", "mpi",
                       "--run-dir", f"{SCRATCH}/run"])
    out = result.stdout.replace("\0", "")
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    hashes = dict(re.findall(r"param-sha256 rank=(\d) ([0-9a-f]{16})", out))
    assert sorted(hashes) == ["0", "1"] and len(set(hashes.values())) == 1, out
    assert (tmp_path / "run" / "checkpoints" / "ckpt-00000030.pt").exists()


# -- bind: the host's MPI library replaces the image's ----------------------------------------


@pytest.mark.mpi
def test_host_open_mpi_bound_in(ch_image, openmpi_prefix, tmp_path):
    """The acceptance command: ``mpirun -n 2 ch-run -b OMPI_LIB:DIR
    --set-env=LD_LIBRARY_PATH=DIR IMG -- python -m launcher.check --backend mpi``."""
    mpirun = [str(openmpi_prefix / "bin" / "mpirun"), "-n", "2", "--oversubscribe", "ch-run",
              "-b", f"{openmpi_prefix / 'lib'}:{HOST_MPI_LIB}", "-b", f"{tmp_path}:{SCRATCH}",
              f"--set-env=LD_LIBRARY_PATH={HOST_MPI_LIB}", str(ch_image), "--", "python", "-m"]
    passed_check(run_host([*mpirun, "launcher.check", "--backend", "mpi"], OPENMPI_ROOT_ENV),
                 OPENMPI, f"{HOST_MPI_LIB}/libmpi.so.40", "pmix",
                 "the Python mpi backend: mpi4py runs on /opt/host-mpi/lib/libmpi.so.40, the "
                 "compiled mpi backend on the MPICH ABI (libmpi.so.12): two MPI libraries "
                 "cannot share a process")
    equal_hashes(run_host([*mpirun, "launcher.train", *TRAIN], OPENMPI_ROOT_ENV))


@pytest.mark.mpi
def test_host_open_mpi_4_bound_in_with_a_user_namespace_per_rank(ch_image, openmpi4_prefix,
                                                                 tmp_path):
    """Open MPI 4's mpirun, one ch-run (one user namespace) per rank, its library bound in:
    vader's single copy is turned off, without which the transfer check's 4 MiB all_reduce
    never completes (tests/test_cma.py)."""
    mpirun = [str(openmpi4_prefix / "bin" / "mpirun"), "-n", "2", "--oversubscribe", "ch-run",
              "-b", f"{openmpi4_prefix / 'lib'}:{HOST_MPI_LIB}", "-b", f"{tmp_path}:{SCRATCH}",
              f"--set-env=LD_LIBRARY_PATH={HOST_MPI_LIB}", str(ch_image), "--", "python", "-m"]
    check = run_host([*mpirun, "launcher.check", "--backend", "mpi"], OPENMPI_ROOT_ENV)
    passed_check(check, f"Open MPI v{OPENMPI4_VERSION}", f"{HOST_MPI_LIB}/libmpi.so.40", "pmix",
                 "the Python mpi backend")
    assert ": off: the 2 local ranks are in 2 user namespaces" in cma_line(check)


@pytest.mark.mpi
def test_host_intel_mpi_bound_in(ch_image, impi_prefix, tmp_path):
    ch = ch_run(ch_image, tmp_path, binds=(f"{impi_prefix / 'lib'}:{HOST_MPI_LIB}",),
                env=(("LD_LIBRARY_PATH", HOST_MPI_LIB),))
    mpiexec = [str(impi_prefix / "bin" / "mpiexec.hydra"), "-n", "2", *ch, "python", "-m"]
    passed_check(run_host([*mpiexec, "launcher.check", "--backend", "mpi"], IMPI_ENV),
                 f"Intel(R) MPI Library {IMPI_VERSION}", f"{HOST_MPI_LIB}/libmpi.so.12", "pmi",
                 COMPILED)  # on Intel's library: the MPICH ABI
    equal_hashes(run_host([*mpiexec, "launcher.train", *TRAIN], IMPI_ENV))


@pytest.mark.mpi
def test_a_host_mpich_named_libmpich_is_the_one_loaded(impi_prefix, tmp_path):
    """Debian's and Ubuntu's MPICH ship ``libmpich.so.12`` and no ``libmpi.so.12``: a directory
    holding only that name, first on LD_LIBRARY_PATH, is the host's MPI (played by a copy of
    Intel's MPICH-ABI library under that name, not a link, which /proc/self/maps would show
    resolved; its own directory after it, for libfabric), in the venv, no container. The
    compiled backend, linked to ``libmpi.so.12``, would load a second MPI beside it: the
    Python backend runs, and says why."""
    host = tmp_path / "host-lib"
    host.mkdir()
    shutil.copy(impi_prefix / "lib" / "libmpi.so.12", host / "libmpich.so.12")
    result = run_host([str(impi_prefix / "bin" / "mpiexec.hydra"), "-n", "2", sys.executable,
                       "-m", "launcher.check", "--backend", "mpi"],
                      {**IMPI_ENV, "LD_LIBRARY_PATH": f"{host}:{impi_prefix / 'lib'}"})
    out = result.stdout.replace("\0", "")
    report = f"exit {result.returncode}\n{out}\n{result.stderr}"
    assert result.returncode == 0 and "check passed" in out, report
    assert f"mpi_library: Intel(R) MPI Library {IMPI_VERSION}" in out, report
    assert LIBMPI_PATH.findall(out) == [str(host / "libmpich.so.12")], report
    assert (f"mpi: rank 0 runs the Python mpi backend: mpi4py runs on {host}/libmpich.so.12, the "
            "compiled mpi backend on the MPICH ABI (libmpi.so.12): two MPI libraries cannot "
            "share a process") in out, report


def test_the_image_has_the_mount_points_ch_run_cannot_create(ch_image):
    for target in (HOST_MPI_LIB, "/opt/host-mpi/libfabric", SCRATCH):
        path = ch_image / target.lstrip("/")
        assert path.is_dir() and not any(path.iterdir()), target


def test_python_on_a_plain_path_is_the_images_venv(ch_image):
    result = subprocess.run(["ch-run", str(ch_image), "--", "python", "-c",
                             "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            env={"PATH": "/usr/local/bin:/usr/bin:/bin", **_user_env()},
                            timeout=120)
    assert result.stdout.strip() == "/opt/ddp/venv", result.stderr
