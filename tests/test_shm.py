"""/dev/shm and memlock: the formula, the checks, and Docker's default caught for real."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from ddp_tasks import cluster as cl
from launcher.placement import shm
from launcher.placement.shm import MIB, NodeMemory
from tests.fixtures.mpi import REPO_ROOT, json_objects


def test_recommended_size_grows_with_the_ranks_per_node():
    assert shm.recommended_shm(1) == shm.recommended_shm(4) == 1024 * MIB
    assert shm.recommended_shm(8) == 2048 * MIB
    assert shm.recommended_shm(6) == 1536 * MIB


@pytest.mark.parametrize(("size", "text"), [(1024 * MIB, "1g"), (2048 * MIB, "2g"),
                                            (1536 * MIB, "1536m"), (MIB + 1, "2m")])
def test_docker_writes_the_size(size, text):
    assert shm.docker_size(size) == text


def test_this_node_is_read():
    memory = shm.read_node_memory()
    assert memory.shm_size >= memory.shm_free > 0
    assert memory.memlock == shm.UNLIMITED or memory.memlock > 0
    assert shm.read_node_memory("/no/such/dir").shm_size == 0


def test_too_small_for_mpi_names_the_docker_flag():
    assert shm.too_small_for_mpi(4, NodeMemory(64 * MIB, 64 * MIB, shm.UNLIMITED)) is None
    error = shm.too_small_for_mpi(4, NodeMemory(16 * MIB, 16 * MIB, shm.UNLIMITED))
    assert "16 MiB" in error.message and "24 MiB" in error.message
    assert "--shm-size=1g" in error.hint
    # Docker's default, 12 ranks: MPI_Init hung for good here
    assert shm.too_small_for_mpi(12, NodeMemory(64 * MIB, 64 * MIB, shm.UNLIMITED)) is not None


def test_warnings_below_the_recommendation(tmp_path, monkeypatch):
    fine = NodeMemory(1024 * MIB, 1024 * MIB, shm.UNLIMITED)
    assert shm.warnings(4, fine, rdma=True) == []
    docker_default = NodeMemory(64 * MIB, 64 * MIB, 8192 * 1024)
    (tmp_path / ".dockerenv").touch()
    monkeypatch.setattr(shm, "DOCKERENV", str(tmp_path / ".dockerenv"))
    found = shm.warnings(4, docker_default, rdma=True)
    assert len(found) == 2
    assert "--shm-size=1g" in found[0]
    assert "memlock=-1" in found[1]
    assert len(shm.warnings(8, fine, rdma=True)) == 1  # 8 ranks want 2 GiB


def test_memlock_is_news_only_with_rdma_and_docker_only_in_docker(tmp_path, monkeypatch):
    limited = NodeMemory(1024 * MIB, 1024 * MIB, 8192 * 1024)
    assert shm.warnings(2, limited, rdma=False) == []  # plain TCP locks no memory
    monkeypatch.setattr(shm, "DOCKERENV", str(tmp_path / "no-dockerenv"))
    [line] = shm.warnings(2, limited, rdma=True)
    assert "docker" not in line and "/etc/security/limits.conf" in line, line


# --- in a container, for real ------------------------------------------------------------

@pytest.mark.docker
def test_a_dev_shm_too_small_for_mpi_stops_every_rank_before_mpi(cpu_image, run_in_image):
    """4 ranks in 16 MiB of /dev/shm: MPICH's MPI_Init ends in a segmentation fault (exit 11,
    seen here; 12 ranks in Docker's default 64 MiB hang in it for good). Now every rank stops
    first with the error and the flag that fixes it."""
    status, output = run_in_image(
        cpu_image, ["mpiexec", "-n", "4", "python", "-m", "launcher.check"], timeout=300,
        shm_size="16m")
    assert status == 2, output
    assert output.count("error: /dev/shm holds 16 MiB, and MPI needs 24 MiB") == 4, output
    assert output.count("HINT: give the container more shared memory: docker run "
                        "--shm-size=1g") == 4, output
    assert "Traceback" not in output and "Segmentation" not in output, output


@pytest.mark.docker
def test_dockers_default_dev_shm_is_reported_and_warned_about(cpu_image, run_in_image):
    """Docker's 64 MiB with 4 ranks: MPICH starts (it takes 21 MiB; a 64 MiB all_reduce of
    4 ranks passed there too, by hand), and launcher.check warns, naming --shm-size."""
    status, output = run_in_image(
        cpu_image, ["sh", "-c", "mpiexec -n 4 python -m launcher.check --backend gloo,mpi"],
        timeout=300, shm_size="64m")
    assert status == 0, output
    assert "WARNING " in output and "/dev/shm is 64 MiB, below the 1024 MiB recommended for "\
        "4 rank(s) per node" in output, output
    assert "--shm-size=1g" in output
    assert " 64  " in output.split("WARNING")[0]  # the shm_mib column of the table


@pytest.mark.docker
def test_the_generated_docker_run_line_runs(cpu_image):
    """``invoke run --runtime docker --image`` for real: the ranks see the /dev/shm it asks
    for, and no memlock limit. An engine without CAP_SYS_RESOURCE (this kind of VM) refuses
    ``--ulimit memlock=-1`` at start: there the printed line runs without that one flag, and
    the flag is checked as text, so the rest of the line still runs for real."""
    printed = subprocess.run(
        [sys.executable, "-m", "invoke", "run", "--runtime", "docker", "--image", cpu_image,
         "--procs-per-node", "2", "--module", "launcher.check", "--args", "--json",
         "--dry-run"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    argv = shlex.split(printed.stdout.replace("\\\n", " "))
    assert argv[:2] == ["docker", "run"] and "--shm-size=1g" in argv, argv
    memlock = argv.index("--ulimit")
    assert argv[memlock + 1] == "memlock=-1", argv
    granted = cl.engine_grants_memlock(cpu_image)
    if not granted:
        del argv[memlock:memlock + 2]
    result = subprocess.run(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=300)
    assert result.returncode == 0, result.stdout
    ranks = [rank for obj in json_objects(result.stdout) for rank in obj.get("ranks", ())]
    assert [r["shm_mib"] for r in ranks] == [1024] * 2, result.stdout
    if granted:
        assert [r["memlock"] for r in ranks] == ["unlimited"] * 2, result.stdout
