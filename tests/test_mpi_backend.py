"""The mpi4py backend: every op against gloo, DDP, subgroups and user errors, under real mpiexec.

Scenarios live in tests/mpi_backend_worker.py; each rank prints one JSON object.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.mpi import backend as mpi_backend
from launcher.mpi import buffers as mpi_buffers
from launcher.mpi import cxx as mpi_cxx
from launcher.mpi import library as mpi_library
from launcher.mpi import waiting as mpi_waiting
from launcher.placement.ports import free_port
from tests.fixtures.docker import COLD_BUILD_TIMEOUT
from tests.fixtures.gpu import needs_gpu
from tests.fixtures.mpi import json_objects, run_mpi

WORKER = "tests/mpi_backend_worker.py"


def run_worker(ranks: int, *args: str, timeout: float = 240, env: dict | None = None):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    result = run_mpi(ranks, [WORKER, *args], timeout=timeout, env=env)
    assert not result.timed_out, f"mpiexec hung past {timeout} s\n{result.output}"
    return result


def by_rank(objects: list[dict], ranks: int, **match) -> list[dict]:
    picked = [o for o in objects if all(o.get(k) == v for k, v in match.items())]
    assert sorted(o["rank"] for o in picked) == list(range(ranks)), objects
    return sorted(picked, key=lambda o: o["rank"])


@pytest.fixture(params=["python", "cxx"])
def impl(request, monkeypatch) -> str:
    """Both implementations of the mpi backend: the Python one and the compiled one."""
    if request.param == "cxx" and not mpi_cxx.built_path().exists():
        pytest.skip("the compiled mpi backend is not built (python -m launcher.mpi.cxx)")
    monkeypatch.setenv("DDP_MPI_IMPL", request.param)
    return request.param


# -- in-process: registration and the pieces that need no second rank ------------------------

def test_register_is_idempotent_and_claims_cpu_and_cuda():
    assert mpi_backend.register() == mpi_backend.BACKEND_NAME == "mpi4py"
    assert mpi_backend.register() == "mpi4py"
    assert dist.Backend.backend_list.count("mpi4py") == 1
    assert dist.Backend.backend_capability["mpi4py"] == ["cpu", "cuda"]


def test_contiguous_cpu_tensors_reach_mpi_without_a_copy():
    t = torch.arange(12, dtype=torch.float32)
    assert mpi_buffers.addressable(t) is t
    strided = torch.arange(24, dtype=torch.float32).view(12, 2)[:, 0]
    staged = mpi_buffers.addressable(strided)
    assert staged.is_contiguous() and staged.data_ptr() != strided.data_ptr()
    assert torch.equal(staged, strided)


def test_half_precision_reductions_are_computed_in_float32():
    for dtype in (torch.float16, torch.bfloat16):
        _, compute, _ = mpi_buffers.reduction(dtype, dist.ReduceOp.SUM)
        assert compute == torch.float32
        assert mpi_buffers.addressable(torch.ones(3, dtype=dtype), compute).dtype == torch.float32


@pytest.mark.parametrize(("dtype", "op"), [
    (torch.float32, dist.ReduceOp.BAND),
    (torch.int64, dist.ReduceOp.AVG),
    (torch.complex64, dist.ReduceOp.MAX),
])
def test_unsupported_reductions_name_the_dtype_and_op(dtype, op):
    with pytest.raises(LaunchError) as error:
        mpi_buffers.reduction(dtype, op)
    assert str(dtype) in error.value.message and op.name in error.value.message
    assert error.value.hint


# -- under mpiexec ---------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "default", "algorithm", "order"), [
    (2, "gloo-default", "auto", 1), (3, "mpi4py-default", "auto", 1),
    (4, "gloo-default", "auto", 1),
    # what the launcher picks for the bundled MPICH across nodes (launcher/mpi/library.py);
    # the compiled backend first: the default group in one case each
    (3, "mpi4py-default", "tsp_ring", -1)])
def test_every_op_and_dtype_matches_gloo(ranks, default, algorithm, order):
    """~2000 cases per rank: 15 dtypes x empty/1/42-element/non-contiguous (+3 MiB float32)
    x every collective, reduce op and point-to-point call; both implementations of the
    backend in the same processes, against one gloo reference."""
    impls = ["python"] + (["cxx"] if mpi_cxx.built_path().exists() else [])
    result = run_worker(ranks, "compare", default,
                        env={mpi_library.IALLREDUCE_VARIABLE: algorithm,
                             "DDP_TEST_IMPLS": ",".join(impls[::order])})
    reports = by_rank(json_objects(result.stdout), ranks)
    # more ranks than this machine's CPUs: waits sleep at once instead of spinning first
    spin = 0.0 if ranks > len(os.sched_getaffinity(0)) else mpi_waiting.SPIN_S
    for report in reports:
        assert report["failed"] == 0, report["failures"]
        assert report["cases"] > 1900 and len(report["impls"]) == len(impls)
        assert report["spin_s"] == spin
    assert result.returncode == 0, result.output
    if len(impls) == 1:
        pytest.skip("the Python backend agrees; the compiled one is not built "
                    "(python -m launcher.mpi.cxx)")


@pytest.mark.mpi
@pytest.mark.parametrize("thread_level", ["multiple", "serialized"])
def test_ddp_keeps_ranks_bit_identical_and_matches_gloo(thread_level, impl):
    """50 DDP steps, then 5 of FSDP2; 'serialized' makes the backend take its lock around
    every MPI call."""
    if impl == "cxx" and thread_level == "serialized":
        pytest.skip("the compiled backend needs MPI_THREAD_MULTIPLE (else: the Python one)")
    result = run_worker(2, "ddp", "50", env={"MPI4PY_RC_THREAD_LEVEL": thread_level})
    assert result.returncode == 0, result.output
    objects = json_objects(result.stdout)
    ours = by_rank(objects, 2, backend="mpi4py")
    gloo = by_rank(objects, 2, backend="gloo")
    expected_level = {"multiple": 3, "serialized": 2}[thread_level]
    assert all(o["thread_level"] == expected_level for o in ours)
    assert len({o["digest"] for o in ours}) == 1, ours
    # two ranks: each sum has two terms, so MPI and gloo must agree to the bit
    assert ours[0]["digest"] == gloo[0]["digest"]
    # FSDP2 the same way: its collectives sharded, every rank's full weights alike
    assert {o["fsdp_digest"] for o in ours + gloo} == {gloo[0]["fsdp_digest"]}, ours + gloo


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["auto", "tsp_ring"])
def test_ddp_three_ranks_stay_identical(algorithm, impl):
    result = run_worker(3, "ddp", "50", env={mpi_library.IALLREDUCE_VARIABLE: algorithm})
    assert result.returncode == 0, result.output
    ours = by_rank(json_objects(result.stdout), 3, backend="mpi4py")
    assert len({o["digest"] for o in ours}) == 1, ours


@pytest.mark.mpi
def test_subgroup_runs_on_its_members_only(impl):
    result = run_worker(3, "subgroup")
    assert result.returncode == 0, result.output
    reports = by_rank(json_objects(result.stdout), 3)
    assert [r["subgroup_sum"] for r in reports] == [4.0, None, 4.0]  # ranks 0 and 2: 1 + 3
    assert all(r["world_sum"] == 3.0 for r in reports)


@pytest.mark.mpi
def test_polled_receive_from_any_rank_reports_sender_and_data(impl):
    result = run_worker(3, "poll", timeout=60)
    assert result.returncode == 0, result.output
    assert by_rank(json_objects(result.stdout), 3)[0]["sources"] == [1, 2], result.output


def assert_clean_user_error(result, ranks: int, *phrases: str) -> None:
    assert result.returncode != 0, result.output
    for rank in range(ranks):
        assert f"[rank {rank}] error: " in result.stderr, result.output
        assert f"[rank {rank}] HINT: " in result.stderr, result.output
    for phrase in phrases:
        assert phrase in result.stderr, result.output
    assert "Traceback" not in result.stderr, result.output


@pytest.mark.mpi
def test_world_size_that_does_not_match_mpi_fails_on_every_rank(impl):
    result = run_worker(2, "bad-world-size", timeout=60)
    assert_clean_user_error(result, 2, "of 3, but MPI started this process as rank",
                            "MPI.COMM_WORLD.size")


@pytest.mark.mpi
def test_rank_mismatch_seen_by_some_ranks_fails_on_every_rank(impl):
    """rank=0 everywhere: rank 0 itself looks fine, so it must learn of the others' failure."""
    result = run_worker(3, "bad-rank", timeout=60)
    assert_clean_user_error(result, 3, "init_process_group has rank 0 of 3, but MPI started "
                            "this process as rank 1", "[rank 0] error: MPI rank(s) 1, 2 were given")


@pytest.mark.mpi
def test_unsupported_reduction_fails_on_every_rank(impl):
    result = run_worker(2, "bad-reduce-op", timeout=60)
    assert_clean_user_error(result, 2, "cannot reduce torch.float32 tensors with ReduceOp.BAND")


@pytest.mark.mpi
def test_collective_with_a_missing_rank_times_out_and_aborts_the_job(impl):
    """The last rank sleeps 60 s; the group timeout is 2 s, so the job must end well before."""
    result = run_worker(3, "timeout", timeout=45)
    assert result.returncode != 0, result.output
    assert "barrier on a group of 3 ranks did not complete within 0:00:02" in result.stderr
    assert "HINT: " in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("thread_level", ["serialized", "multiple"])
def test_threads_share_the_group(thread_level, impl):
    """Below MPI_THREAD_MULTIPLE the backend's lock is all that keeps two threads' MPI calls
    apart (without it this run hung about one time in three)."""
    if impl == "cxx" and thread_level == "serialized":
        pytest.skip("the compiled backend needs MPI_THREAD_MULTIPLE (else: the Python one)")
    result = run_worker(3, "threads", timeout=90, env={"MPI4PY_RC_THREAD_LEVEL": thread_level})
    assert result.returncode == 0, result.output
    reports = by_rank(json_objects(result.stdout), 3)
    assert all(r["errors"] == [] for r in reports), reports
    assert {r["thread_level"] for r in reports} == {2 if thread_level == "serialized" else 3}


def test_the_mpi_library_is_asked_about_cuda_support():
    """MPICH from PyPI is built without CUDA: it must answer (not None) and say no, so CUDA
    tensors would be staged through host memory."""
    assert mpi_buffers.mpi_cuda_support() is False
    assert mpi_buffers.cuda_aware() is False


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "algorithm"), [(2, "auto"), (3, "auto"), (3, "tsp_ring")])
def test_large_all_reduce_in_slices_equals_one_piece(ranks, algorithm, impl):
    result = run_worker(ranks, "sliced", timeout=120,
                        env={mpi_library.IALLREDUCE_VARIABLE: algorithm})
    assert result.returncode == 0, result.output
    reports = by_rank(json_objects(result.stdout), ranks)
    assert all(r["mismatches"] == [] and r["big_ok"] for r in reports), reports


@pytest.mark.mpi
@pytest.mark.gpu
@needs_gpu
def test_cuda_tensors_give_the_same_results_as_cpu_tensors(impl):
    result = run_worker(2, "cuda", timeout=120)
    assert result.returncode == 0, result.output
    assert all(r["same"] for r in by_rank(json_objects(result.stdout), 2)), result.output


@pytest.mark.mpi
def test_timeout_inside_ddp_backward_surfaces_from_backward(impl):
    result = run_worker(2, "ddp-timeout", timeout=45)
    assert result.returncode != 0, result.output
    assert ("[rank 0] error: all_reduce on a group of 2 ranks did not complete within 0:00:02"
            in result.stderr), result.output
    assert "Traceback" not in result.stderr, result.output


# init the default group in the image; a LaunchError is printed per rank, exit status 2
INIT_IN_IMAGE = """
import torch.distributed as dist
from mpi4py import MPI
from launcher.mpi import backend as mpi_backend
from launcher.mpi import library as mpi_library
from launcher.core.errors import LaunchError, report_and_exit
try:
    dist.init_process_group(mpi_backend.register(), store=dist.HashStore(),
                            rank=MPI.COMM_WORLD.rank, world_size=MPI.COMM_WORLD.size)
except LaunchError as error:
    report_and_exit(error, MPI.COMM_WORLD.rank)
print("group ok", flush=True)
"""


@pytest.mark.docker
@pytest.mark.timeout(COLD_BUILD_TIMEOUT)
def test_blocked_single_copy_transfers_are_caught_in_docker(cpu_image, run_in_image):
    """Docker's seccomp profile forbids process_vm_readv: with MPICH's CMA switched back on,
    Iallreduce returns wrong sums, and the backend's transport check must refuse the group on
    every rank. Left to the launcher, the node's probe finds the call blocked and turns CMA
    off before MPI starts: the same check passes."""
    command = ["mpiexec", "-n", "2", "python", "-c", INIT_IN_IMAGE]
    status, output = run_in_image(cpu_image, command,
                                  environment={"MPIR_CVAR_CH4_CMA_ENABLE": "1"})
    assert status != 0, output
    for rank in (0, 1):
        assert f"[rank {rank}] error: MPI delivered wrong data" in output, output
        assert f"[rank {rank}] HINT: " in output and "MPIR_CVAR_CH4_CMA_ENABLE=0" in output
    assert "(CMA) on " not in output  # the user's setting is not probed
    status, output = run_in_image(cpu_image, command)
    assert status == 0 and output.count("group ok") == 2, output
    assert output.count("(CMA) on ") == 1 and "process_vm_readv" in output, output
