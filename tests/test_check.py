"""launcher.check for real: plain python, mpiexec -n 2 / -n 3, torchrun, and a cluster that
disagrees with itself (MPMD: one rank told it runs in another image)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launcher.core.errors import EXIT_USER_ERROR
from launcher.diagnostics.rank_report import RankReport, find_differences, format_table
from launcher.mpi import cxx as mpi_cxx
from launcher.placement import network
from tests.fixtures.gpu import nccl_ranks, needs_gpu
from tests.fixtures.mpi import REPO_ROOT, clean_environ, json_objects, run_mpi
from tests.fixtures.rank_exits import FAILURE_ENDS_WITHIN_S, RECORD, rank_exits


def _report(rank: int, **overrides: str) -> RankReport:
    fields = dict(
        rank=rank, local_rank=rank, node_rank=0, host="n0", launcher="hydra", device="cpu",
        python_executable="/opt/ddp/venv/bin/python", python_version="3.11.2", torch="2.13.0",
        mpi4py="4.1.2", mpi_library="MPICH Version: 5.0.2", mpi_abi="mpich",
        libmpi_path="/x/libmpi.so.12", pmi="pmi", mpi_choice="bundled, for PMI pmi",
        cuda="-", nccl="-", image="ddp:cpu", interface="eth1 10.0.0.1 (route to n0)",
        shm_mib=1024, memlock="unlimited", warnings=(),
    )
    fields.update(overrides)
    return RankReport(**fields)


def test_identical_ranks_have_no_differences():
    assert find_differences([_report(0), _report(1), _report(2)]) == []


def test_each_differing_field_is_one_line_naming_the_ranks():
    reports = [_report(0), _report(1, torch="2.5.0"), _report(2, torch="2.5.0"),
               _report(3, python_version="3.12.1")]
    assert find_differences(reports) == [
        "DIFFERENT python_version: rank 0-2: 3.11.2; rank 3: 3.12.1",
        "DIFFERENT torch: rank 0,3: 2.13.0; rank 1-2: 2.5.0",
    ]


def test_table_has_a_row_per_rank():
    table = format_table([_report(0), _report(1)])
    assert table.splitlines()[1].startswith("0 ")
    assert table.splitlines()[2].startswith("1 ")
    assert "mpi_library: MPICH Version: 5.0.2" in table


def _summary(stdout: str) -> dict:
    summaries = [o for o in json_objects(stdout) if "backends" in o]
    assert len(summaries) == 1, stdout  # rank 0 only
    return summaries[0]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_check_passes_under_mpiexec_on_gloo_and_mpi(ranks):
    result = run_mpi(ranks, ["-m", "launcher.check", "--backend", "gloo,mpi", "--json"],
                     timeout=180)
    assert result.returncode == 0, result.output
    summary = _summary(result.stdout)
    assert summary["ok"] and summary["problems"] == []
    assert [r["rank"] for r in summary["ranks"]] == list(range(ranks))
    assert {r["launcher"] for r in summary["ranks"]} == {"hydra"}
    mpi = mpi_cxx.BACKEND_NAME if mpi_cxx.built_path().exists() else "mpi4py"
    assert set(summary["backends"]) == {"gloo", mpi}
    assert all(len(b["ping_pong_us"]) == ranks - 1 for b in summary["backends"].values())


@pytest.mark.mpi
def test_the_default_check_names_each_ranks_interface_and_no_idle_memlock_news():
    """Under plain `mpiexec -n 2` (backend auto: the mpi backend, no rendezvous host) every
    rank still says how it reaches the others; memlock is news only on a node with RDMA."""
    result = run_mpi(2, ["-m", "launcher.check", "--json"], timeout=120)
    assert result.returncode == 0, result.output
    summary = _summary(result.stdout)
    assert all(r["interface"] not in ("", "-") for r in summary["ranks"]), summary["ranks"]
    if not network.has_rdma():
        assert not any("memlock" in w for r in summary["ranks"] for w in r["warnings"])


@pytest.mark.mpi
def test_check_prints_one_table_on_rank_zero():
    result = run_mpi(2, ["-m", "launcher.check", "--backend", "mpi"], timeout=120)
    assert result.returncode == 0, result.output
    assert result.stdout.count("python_executable:") == 1
    assert "check passed" in result.stdout


@pytest.mark.mpi
def test_a_rank_in_another_image_fails_the_check_on_every_rank():
    # Hydra's MPMD form gives each rank its own environment
    args = [sys.executable, "-m", "launcher.check", "--backend", "gloo"]
    result = run_mpi(
        1, [*args[1:]], timeout=120,
        mpiexec_args=("-env", "DDP_IMAGE", "ddp:1.0", *args, ":", "-n", "1", "-env",
                      "DDP_IMAGE", "ddp:2.0"),
    )
    assert result.returncode == 1, result.output
    assert "DIFFERENT image: rank 0: ddp:1.0; rank 1: ddp:2.0" in result.stdout
    assert "check FAILED" in result.stdout


@pytest.mark.mpi
def test_ranks_on_different_mpi_implementations_fail_the_check():
    """Rank 1 told to take the Python backend, rank 0 the compiled one: one problem line."""
    if not mpi_cxx.built_path().exists():
        pytest.skip("the compiled mpi backend is not built (python -m launcher.mpi.cxx)")
    args = [sys.executable, "-m", "launcher.check", "--backend", "mpi"]
    result = run_mpi(
        1, [*args[1:]], timeout=120,
        mpiexec_args=("-env", "DDP_MPI_IMPL", "cxx", *args, ":", "-n", "1", "-env",
                      "DDP_MPI_IMPL", "python"),
    )
    assert result.returncode == 1, result.output
    assert "mpi: rank 0 runs the compiled mpi backend" in result.stdout
    assert ("the ranks run different implementations of one backend: mpi_cxx on rank(s) 0; "
            "mpi4py on rank(s) 1") in result.stdout


def test_check_runs_as_a_single_process():
    result = subprocess.run(
        [sys.executable, "-m", "launcher.check", "--json"], capture_output=True, text=True,
        timeout=120, env=clean_environ(), cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    summary = _summary(result.stdout)
    assert summary["world_size"] == 1 and summary["ok"]


def test_check_under_torchrun():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    result = subprocess.run(
        [*torchrun, "-m", "launcher.check", "--backend", "gloo", "--json"], capture_output=True,
        text=True, timeout=180, env=clean_environ(), cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = _summary(result.stdout)
    assert {r["launcher"] for r in summary["ranks"]} == {"torchrun"}


def test_mpi_under_torchrun_stops_every_rank_at_once_with_the_cause():
    """torchrun offers no PMI: --backend mpi would make each rank an MPI world of its own. Every
    rank says so before MPI starts and exits 2; nothing waits for a peer."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--no-python", "sh", "-c", RECORD, "sh"]
    result = subprocess.run(
        [*torchrun, sys.executable, "-m", "launcher.check", "--backend", "mpi"],
        capture_output=True, text=True, timeout=180, env=clean_environ(), cwd=REPO_ROOT,
    )
    ended = time.time()
    assert result.returncode != 0, result.stdout
    # each rank stopped by itself with the user-error status (one killed by torchrun after a
    # peer failed would show 143), and torchrun ended soon after the first of them
    exits = rank_exits(result.stderr)
    assert {rank: status for rank, (status, _) in exits.items()} == \
        {0: EXIT_USER_ERROR, 1: EXIT_USER_ERROR}, result.stderr
    assert ended - min(at for _, at in exits.values()) < FAILURE_ENDS_WITHIN_S, result.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] error: torchrun offers no MPI" in result.stderr, result.stderr
        assert f"[rank {rank}] HINT: under Slurm pass srun --mpi=pmi2" in result.stderr
    # torchrun's agent prints its own ChildFailedError; no rank prints a trace of ours
    assert str(REPO_ROOT / "launcher") not in result.stderr, result.stderr


def test_unknown_backend_is_one_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "launcher.check", "--backend", "tcp"], capture_output=True,
        text=True, timeout=60, env=clean_environ(), cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "error: unknown backend tcp" in result.stderr
    assert "HINT:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.mpi
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend, ranks", [("nccl", nccl_ranks()), ("mpi", 2)])
def test_check_on_gpu_reports_cuda_and_passes(backend, ranks):
    result = run_mpi(ranks, ["-m", "launcher.check", "--backend", backend, "--json"],
                     timeout=180)
    assert result.returncode == 0, result.output
    summary = _summary(result.stdout)
    assert summary["ok"], summary
    for report in summary["ranks"]:
        assert report["device"].startswith("cuda"), report
        assert report["cuda"] != "-" and report["nccl"] != "-", report


@pytest.mark.mpi
@pytest.mark.gpu
@needs_gpu
def test_ranks_sharing_a_gpu_get_gloo_under_auto_and_one_clear_error_under_nccl():
    """NCCL refuses two ranks on one GPU (a workstation with one GPU, mpiexec -n 2)."""
    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"}
    nccl = run_mpi(2, ["-m", "launcher.check", "--backend", "nccl"], timeout=120, env=one_gpu)
    assert nccl.returncode == 2, nccl.output
    for rank in (0, 1):
        assert f"[rank {rank}] error: NCCL cannot run several ranks on one GPU" in nccl.stderr
        assert f"[rank {rank}] HINT: start one rank per GPU" in nccl.stderr, nccl.output
    assert "Traceback" not in nccl.stderr
    auto = run_mpi(2, ["-m", "launcher.check", "--json"], timeout=120, env=one_gpu)
    assert auto.returncode == 0, auto.output
    assert auto.stderr.count("NCCL cannot share a GPU, so --backend auto uses gloo") == 1
    assert set(_summary(auto.stdout)["backends"]) == {"gloo"}
