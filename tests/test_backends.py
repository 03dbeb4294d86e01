"""``--backend``: the plan each rank carries out, from its launch and faked facts."""

from __future__ import annotations

import pytest

from launcher.core.errors import LaunchError
from launcher.group import debug_level
from launcher.group.backends import BackendFacts, plan, select_backend
from launcher.placement.env import detect_environment

HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5", "MPI_LOCALRANKID": "1",
         "MPI_LOCALNRANKS": "2"}
SRUN_PMI2 = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "7", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n1",
             "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "PMI_RANK": "1",
             "PMI_SIZE": "2", "PMI_FD": "4"}
SRUN_PMIX = {**{k: v for k, v in SRUN_PMI2.items() if not k.startswith("PMI_")},
             "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.7.0"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-1@1"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
ONE_HYDRA_RANK = {**HYDRA, "PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0",
                  "MPI_LOCALNRANKS": "1"}

CPU = BackendFacts(cuda_available=False, native_mpi=False, bundled_mpich=True)
HOST_MPI = BackendFacts(cuda_available=False, native_mpi=False, bundled_mpich=False)
NATIVE = BackendFacts(cuda_available=False, native_mpi=True, bundled_mpich=True)
GPU = BackendFacts(cuda_available=True, native_mpi=False, bundled_mpich=True)
NATIVE_GPU = BackendFacts(cuda_available=True, native_mpi=True, bundled_mpich=True)


# (requested, launch, facts) -> (backend, start_mpi, store, if_gpu_shared)
@pytest.mark.parametrize(("requested", "environ", "facts", "expected"), [
    # auto on CPU: mpi where it was measured faster (PMI-1/2 and the bundled MPICH)
    ("auto", HYDRA, CPU, ("mpi4py", True, False, None)),
    ("auto", SRUN_PMI2, CPU, ("mpi4py", True, False, None)),
    ("auto", SRUN_PMI2, NATIVE, ("mpi", True, False, None)),
    ("auto", HYDRA, HOST_MPI, ("gloo", True, True, None)),  # a host MPI: not measured
    ("auto", SRUN_PMIX, CPU, ("gloo", False, True, None)),
    ("auto", OPENMPI, CPU, ("gloo", True, True, None)),  # the address is agreed over MPI
    ("auto", TORCHRUN, CPU, ("gloo", False, True, None)),
    ("auto", ONE_HYDRA_RANK, CPU, ("gloo", False, True, None)),  # one rank: nothing to sync
    ("auto", {}, CPU, ("gloo", False, True, None)),
    # auto on GPUs: nccl, which falls back to gloo where ranks share a GPU
    ("auto", HYDRA, GPU, ("nccl", True, True, "gloo")),
    ("auto", TORCHRUN, GPU, ("nccl", False, True, "gloo")),
    ("auto", {}, GPU, ("nccl", False, True, None)),
    # explicit names are the override; gloo and nccl start MPI only for the rendezvous
    ("nccl", TORCHRUN, GPU, ("nccl", False, True, "refuse")),
    ("gloo", TORCHRUN, CPU, ("gloo", False, True, None)),
    ("gloo", SRUN_PMI2, CPU, ("gloo", False, True, None)),
    ("gloo", HYDRA, CPU, ("gloo", True, True, None)),
    ("gloo", HYDRA, GPU, ("gloo", True, True, None)),
    ("mpi", SRUN_PMIX, CPU, ("mpi4py", True, False, None)),
    ("mpi", TORCHRUN, GPU, ("mpi4py", True, False, None)),
    ("mpi", HYDRA, NATIVE, ("mpi", True, False, None)),
    # torch's own MPI backend refuses CUDA tensors on a MPI that is not CUDA-aware
    ("mpi", HYDRA, NATIVE_GPU, ("mpi4py", True, False, None)),
])
def test_the_plan_follows_the_launch_and_the_facts(requested, environ, facts, expected):
    chosen = plan(requested, detect_environment(environ, hostname="n1"), facts)
    assert (chosen.backend, chosen.start_mpi, chosen.store, chosen.if_gpu_shared) == expected
    assert chosen.reason


def test_the_reason_says_what_auto_stood_for():
    env = detect_environment(HYDRA, hostname="n1")
    assert "not torch's own MPI backend" in plan("mpi", env, NATIVE_GPU).reason
    assert "not torch's own" not in plan("mpi", env, NATIVE).reason
    assert "MPI was measured faster" in plan("auto", env, CPU).reason
    assert "--backend gloo" in plan("gloo", env, CPU).reason
    assert "agreed on over MPI" in plan("gloo", env, CPU).reason


@pytest.mark.parametrize("name", ["auto", "tcp"])
def test_an_unresolved_or_unknown_name_is_refused_with_the_choices(name):
    with pytest.raises(LaunchError) as error:
        select_backend(name, cuda_available=False, native_mpi=False)
    assert "gloo" in error.value.hint


def test_nccl_without_cuda_names_the_cpu_backends():
    with pytest.raises(LaunchError) as error:
        plan("nccl", detect_environment({}, hostname="n1"), CPU)
    assert "--backend gloo or mpi" in error.value.hint


@pytest.mark.parametrize("backend, lowered, says", [
    ("mpi4py", True, "running at INFO"), ("mpi_cxx", True, "running at INFO"),
    ("gloo", False, "not a long job"), ("nccl", False, "not a long job"),
    ("mpi", False, None)])  # torch's own MPI backend: torch does not wrap it
def test_detail_debugging_is_lowered_only_where_no_store_is_shared(backend, lowered, says):
    lower, line = debug_level.note(backend, detail=True)
    assert lower == lowered and (line is None if says is None else says in line)
    assert debug_level.note(backend, detail=False) == (False, None)
