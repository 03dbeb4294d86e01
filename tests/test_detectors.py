"""Launcher detection from recorded environments, precedence, and every bad-input error.

Environments marked "recorded" were printed by the real launchers on this project's test
machine (srun/sbatch/salloc of Slurm 22.05 with the test cluster of tests/fixtures/slurm.py,
Hydra of the ``mpich`` wheel, torchrun of torch 2.13), trimmed to the variables that matter.
The others follow the launchers' documentation.
"""

from __future__ import annotations

import pytest

from launcher.core.errors import LaunchError
from launcher.placement.env import (
    BuildTools,
    JobEnv,
    build_tools,
    detect_environment,
    launch_pmi,
    local_device_index,
    visible_device_count,
)
from launcher.placement.ports import slurm_port

# recorded: `srun -n 2 --mpi=pmi2`, task 1 (job 1, step 0)
SRUN_PMI2 = {
    "PMI_FD": "13", "PMI_JOBID": "1.0", "PMI_RANK": "1", "PMI_SIZE": "2",
    "SLURM_JOBID": "1", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1",
    "SLURM_LOCALID": "1", "SLURM_MPI_TYPE": "pmi2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
    "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NAME": "sh", "SLURM_GTIDS": "0,1",
}  # fmt: skip

# recorded: the batch script of `sbatch -n 2` (job 3): SLURM_PROCID=0 but no step id
SBATCH_SCRIPT = {
    "SLURM_GTIDS": "0", "SLURM_JOBID": "3", "SLURM_JOB_ID": "3", "SLURM_JOB_NAME": "batch.sh",
    "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2",
}  # fmt: skip

# recorded: `mpiexec -n 2` (Hydra) inside that batch script, rank 1. Hydra's Slurm bootstrap
# runs its proxy as a one-task step, so the SLURM_* describe the proxy: PROCID 0 of 1, step 0.
SBATCH_MPIEXEC = {
    **SBATCH_SCRIPT,
    "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "6", "PMI_HOSTNAME": "vm",
    "PMI_JOBID": "3.0", "PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_EXTERNAL_LAUNCHER": "1",
    "SLURM_NPROCS": "1", "SLURM_NTASKS": "1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1",
}  # fmt: skip

# recorded: `srun -n 2` inside the batch script: step 1 of job 3, task 1
SBATCH_SRUN = {
    **SBATCH_SCRIPT,
    "PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_LOCALID": "1", "SLURM_PROCID": "1",
    "SLURM_STEPID": "1", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
}  # fmt: skip

# recorded: the shell of `salloc -n 2` (job 4)
SALLOC = {
    "SLURM_JOBID": "4", "SLURM_JOB_ID": "4", "SLURM_JOB_NAME": "interactive",
    "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
    "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2",
}  # fmt: skip

# recorded: `mpiexec -n 3` (Hydra, mpich wheel), rank 2
HYDRA = {"MPI_LOCALNRANKS": "3", "MPI_LOCALRANKID": "2", "PMI_FD": "9", "PMI_HOSTNAME": "vm",
         "PMI_RANK": "2", "PMI_SIZE": "3"}

# recorded: `torchrun --nproc-per-node 2`, worker 1
TORCHRUN = {
    "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost", "MASTER_PORT": "44999", "RANK": "1", "ROLE_NAME": "default",
    "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "7b81b7b0",
    "TORCHELASTIC_RESTART_COUNT": "0", "WORLD_SIZE": "2",
}  # fmt: skip

# Open MPI 5 mpirun, 4 ranks on 2 nodes, rank 3 (OMPI_COMM_WORLD_NODE_RANK is not a node index)
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_UNIVERSE_SIZE": "4", "PMIX_RANK": "3",
}  # fmt: skip

# MVAPICH2 through its Hydra: MV2_* and PMI_* agree
MVAPICH = {
    "MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
    "MV2_COMM_WORLD_LOCAL_SIZE": "2", "PMI_RANK": "2", "PMI_SIZE": "4",
}  # fmt: skip

# Cray PALS mpiexec with Cray PMI: 8 ranks, 4 per node, rank 5
PALS = {
    "PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "4", "PALS_NODEID": "1",
    "PALS_APID": "a1b2c3", "PALS_DEPTH": "1", "PMI_RANK": "5", "PMI_SIZE": "8",
    "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4",
}  # fmt: skip

# srun over 3 nodes, 5 tasks placed 2,2,1: the task on the third node
SLURM_3_NODES = {
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "2", "SLURM_PROCID": "4", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2", "SLURM_NTASKS": "5", "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "gpu-[01-02],login.x",
    "SLURM_JOB_NODELIST": "gpu-[01-04],login.x", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_TASKS_PER_NODE": "4(x4),1",
}  # fmt: skip


# srun over 2 nodes, 4 tasks each: task 5 (the second node's local 1), no PMI (--mpi=none)
SRUN_2X4 = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "nid[001000-001001]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}  # fmt: skip

# the same task under Slurm's mpi/cray_shasta plugin (the default --mpi of many HPE Cray EX
# systems): mpi_p_slurmstepd_task in Slurm's mpi_cray_shasta.c sets these five PALS_* and, with
# reserved ports, PMI_CONTROL_PORT; no PALS_LOCAL_RANKID, no PMI_RANK/PMI_SIZE (Cray PMI reads
# the rest from the apinfo file)
SRUN_CRAY_SHASTA = {
    **SRUN_2X4,
    "PALS_APID": "4242.0", "PALS_RANKID": "5", "PALS_NODEID": "1",
    "PALS_SPOOL_DIR": "/var/spool/slurmd/mpi_cray_shasta/4242.0",
    "PALS_APINFO": "/var/spool/slurmd/mpi_cray_shasta/4242.0/apinfo",
    "PMI_CONTROL_PORT": "11000", "SLURM_STEP_RESV_PORTS": "11000-11001",
}  # fmt: skip

# the same task with RANK/WORLD_SIZE/LOCAL_RANK exported from SLURM_* by hand: enroot's
# 50-slurm-pytorch.sh hook (NGC images under Pyxis) or `RANK=$SLURM_PROCID ...` in a script
SRUN_RANK_BY_HAND = {
    **SRUN_2X4, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
    "MASTER_ADDR": "nid001000", "MASTER_PORT": "65242",
}  # fmt: skip


def detect(environ: dict[str, str]) -> JobEnv:
    return detect_environment(environ, hostname="testhost")


def placement(env: JobEnv) -> tuple:
    return (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size,
            env.node_rank, env.num_nodes)  # fmt: skip


@pytest.mark.parametrize(
    "environ, expected",
    [
        pytest.param({}, ("single", 0, 1, 0, 1, 0, 1), id="plain-python"),
        pytest.param(SRUN_PMI2, ("slurm", 1, 2, 1, 2, 0, 1), id="srun-pmi2"),
        pytest.param(SBATCH_SCRIPT, ("single", 0, 1, 0, 1, 0, 1), id="sbatch-script"),
        pytest.param(SALLOC, ("single", 0, 1, 0, 1, 0, 1), id="salloc-shell"),
        pytest.param(SBATCH_MPIEXEC, ("hydra", 1, 2, 1, 2, 0, 1), id="mpiexec-in-sbatch"),
        pytest.param(SBATCH_SRUN, ("slurm", 1, 2, 1, 2, 0, 1), id="srun-in-sbatch"),
        pytest.param(HYDRA, ("hydra", 2, 3, 2, 3, 0, 1), id="hydra"),
        pytest.param(TORCHRUN, ("torchrun", 1, 2, 1, 2, 0, 1), id="torchrun"),
        pytest.param({**SRUN_PMI2, **TORCHRUN}, ("torchrun", 1, 2, 1, 2, 0, 1),
                     id="torchrun-in-srun"),
        pytest.param({**OPENMPI, **TORCHRUN}, ("torchrun", 1, 2, 1, 2, 0, 1),
                     id="torchrun-under-mpirun"),
        pytest.param(OPENMPI, ("openmpi", 3, 4, 1, 2, 1, 2), id="openmpi"),
        pytest.param(MVAPICH, ("mvapich", 2, 4, 0, 2, 1, 2), id="mvapich"),
        pytest.param(PALS, ("pals", 5, 8, 1, 4, 1, 2), id="pals"),
        pytest.param(SLURM_3_NODES, ("slurm", 4, 5, 0, 1, 2, 3), id="slurm-3-nodes"),
        pytest.param({**SRUN_PMI2, "PMIX_RANK": "1"}, ("slurm", 1, 2, 1, 2, 0, 1),
                     id="srun-pmix"),
        pytest.param({**SBATCH_SCRIPT, "SLURM_STEP_ID": "4294967291"},
                     ("single", 0, 1, 0, 1, 0, 1), id="slurm-batch-step-id"),
        pytest.param({**SBATCH_SCRIPT, "SLURM_STEP_ID": "batch"},
                     ("single", 0, 1, 0, 1, 0, 1), id="slurm-batch-step-name"),
        pytest.param({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
                     ("torchrun", 0, 2, 0, 2, 0, 1), id="env-by-hand"),
        pytest.param(SRUN_CRAY_SHASTA, ("slurm", 5, 8, 1, 4, 1, 2), id="srun-cray-shasta"),
        pytest.param({**SBATCH_SCRIPT, **PALS}, ("pals", 5, 8, 1, 4, 1, 2),
                     id="pals-mpiexec-in-sbatch"),
        pytest.param({**SRUN_2X4, **PALS}, ("pals", 5, 8, 1, 4, 1, 2), id="pals-mpiexec-in-srun"),
        pytest.param(SRUN_RANK_BY_HAND, ("slurm", 5, 8, 1, 4, 1, 2), id="srun-rank-by-hand"),
        pytest.param({**SRUN_2X4, "RANK": "5"}, ("slurm", 5, 8, 1, 4, 1, 2),
                     id="srun-rank-alone-by-hand"),
        pytest.param({**SRUN_RANK_BY_HAND, "LOCAL_WORLD_SIZE": "4"}, ("slurm", 5, 8, 1, 4, 1, 2),
                     id="srun-all-four-by-hand"),
        pytest.param({**SRUN_2X4, **TORCHRUN}, ("torchrun", 1, 2, 1, 2, 0, 1),
                     id="torchrun-in-srun-2-nodes"),
    ],
)
def test_detects_launcher_and_placement(environ, expected):
    assert placement(detect(environ)) == expected


def test_slurm_fields():
    env = detect(SLURM_3_NODES)
    assert env.hosts == ("gpu-01", "gpu-02", "login.x")  # the step's nodes, not the job's
    assert env.master_addr == "gpu-01"
    assert env.master_port == slurm_port("123456", "2")
    assert env.job_id == "123456"
    assert env.is_distributed and not env.is_main


def test_single_in_allocation_keeps_job_id():
    env = detect(SBATCH_SCRIPT)
    assert (env.job_id, env.master_addr, env.master_port, env.hosts) == ("3", "127.0.0.1", None, ())
    assert env.is_main and not env.is_distributed


def test_mpi_launchers_leave_rendezvous_open():
    for environ in (HYDRA, OPENMPI, MVAPICH, SBATCH_MPIEXEC):
        env = detect(environ)
        assert (env.master_addr, env.master_port, env.hosts) == (None, None, ())


def test_rank_by_hand_under_srun_keeps_slurms_node_list_and_the_given_rendezvous():
    env = detect(SRUN_RANK_BY_HAND)
    assert env.hosts == ("nid001000", "nid001001") and env.node_name == "nid001001"
    assert (env.master_addr, env.master_port, env.job_id) == ("nid001000", 65242, "4242")


@pytest.mark.parametrize(
    "environ, pmi",
    [
        pytest.param(SRUN_CRAY_SHASTA, "pmi", id="srun-cray-shasta"),
        pytest.param({k: v for k, v in SRUN_CRAY_SHASTA.items() if k != "PMI_CONTROL_PORT"},
                     "pmi", id="srun-cray-shasta-no-reserved-port"),
        pytest.param(PALS, "pmi", id="pals"),
        pytest.param(SRUN_PMI2, "pmi", id="srun-pmi2"),
        pytest.param(HYDRA, "pmi", id="hydra"),
        pytest.param(OPENMPI, "pmix", id="openmpi"),
        pytest.param(SRUN_2X4, "none", id="srun-mpi-none"),
        pytest.param({**SRUN_PMI2, **TORCHRUN}, "none", id="torchrun-in-srun-pmi2"),
        pytest.param({**HYDRA, **TORCHRUN, "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
                      "PMI_RANK": "0", "PMI_SIZE": "1"}, "none", id="torchrun-under-mpiexec"),
        pytest.param({**OPENMPI, **TORCHRUN}, "none", id="torchrun-under-mpirun"),
    ],
)
def test_pmi_offered(environ, pmi):
    assert detect(environ).pmi == pmi


@pytest.mark.parametrize("name", ["PALS_APINFO", "PMI_CONTROL_PORT"])
def test_cray_pmi_alone_is_a_pmi(name):
    assert launch_pmi({name: "x"}) == "pmi"


def test_torchrun_provides_rendezvous():
    env = detect(TORCHRUN)
    assert (env.master_addr, env.master_port, env.job_id) == ("localhost", 44999, "7b81b7b0")


def test_explicit_master_wins():
    env = detect({**SLURM_3_NODES, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"})
    assert (env.master_addr, env.master_port) == ("10.0.0.7", 29500)
    env = detect({**HYDRA, "MASTER_PORT": "29501"})
    assert (env.master_addr, env.master_port) == (None, 29501)


def test_pass_through_fields():
    env = detect({"CUDA_VISIBLE_DEVICES": "2,3", "DDP_IMAGE": "ddp:1.0@sha256:ab",
                  "DDP_PREEMPT_SIGNAL": "SIGUSR2"})
    assert (env.visible_devices, env.image, env.preempt_signal, env.hostname) == (
        "2,3", "ddp:1.0@sha256:ab", "USR2", "testhost")
    assert detect({"NCCL_PROXY_DUMP_SIGNAL": " 10 "}).nccl_dump_signal == "10"
    assert detect({}).nccl_dump_signal is None


def test_the_compiled_backends_directory_comes_in_jobenv():
    assert detect({"DDP_MPI_CXX_DIR": "/opt/ext"}).mpi_cxx_dir == "/opt/ext"
    assert detect({"DDP_MPI_CXX_DIR": ""}).mpi_cxx_dir is None
    assert detect({}).mpi_cxx_dir is None


def test_build_tools_read_directory_and_compiler():
    assert build_tools({}) == BuildTools(mpi_cxx_dir=None, compiler="c++")
    assert build_tools({"DDP_MPI_CXX_DIR": "/x", "CXX": "clang++"}) == BuildTools("/x", "clang++")


@pytest.mark.parametrize("value, name", [("USR1", "USR1"), ("sigterm", "TERM"), ("usr2", "USR2"),
                                         (" SIGHUP ", "HUP")])
def test_preempt_signal_names(value, name):
    assert detect({"DDP_PREEMPT_SIGNAL": value}).preempt_signal == name


def test_reads_os_environ_by_default(monkeypatch):
    for key in list(__import__("os").environ):
        monkeypatch.delenv(key)
    for key, value in HYDRA.items():
        monkeypatch.setenv(key, value)
    assert placement(detect_environment()) == ("hydra", 2, 3, 2, 3, 0, 1)


# (environment, words every one of which the error message must contain)
BAD = [
    pytest.param({"RANK": "1"}, ["WORLD_SIZE", "torchrun"], id="rank-without-size"),
    pytest.param({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"},
                 ["LOCAL_RANK", "torchrun"], id="torchrun-no-local-rank"),
    pytest.param({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE", "Open MPI"],
                 id="openmpi-rank-without-size"),
    pytest.param({**OPENMPI, "OMPI_COMM_WORLD_RANK": "4"}, ["openmpi", "rank 4", "world size 4"],
                 id="rank-not-below-size"),
    pytest.param({**HYDRA, "MPI_LOCALRANKID": "3"}, ["hydra", "local rank 3"],
                 id="local-rank-not-below-local-size"),
    pytest.param({**HYDRA, "PMI_RANK": "-1"}, ["PMI_RANK", "'-1'", "Hydra"], id="negative"),
    pytest.param({**HYDRA, "PMI_SIZE": "0"}, ["PMI_SIZE", "positive"], id="zero-size"),
    pytest.param({**SRUN_PMI2, "SLURM_PROCID": "one"}, ["SLURM_PROCID", "'one'", "Slurm"],
                 id="non-integer"),
    pytest.param({**SRUN_PMI2, "SLURM_PROCID": "1.0"}, ["SLURM_PROCID"], id="float"),
    pytest.param({**SRUN_PMI2, "SLURM_PROCID": "1_0"}, ["SLURM_PROCID"], id="underscore"),
    pytest.param({**SRUN_PMI2, "SLURM_LOCALID": ""}, ["SLURM_LOCALID", "''"], id="empty"),
    pytest.param({**HYDRA, "MPI_LOCALNRANKS": "4", "PMI_SIZE": "2", "PMI_RANK": "1"},
                 ["local world size 4", "world size 2"], id="local-size-above-size"),
    pytest.param({"PMI_RANK": "0", "PMI_SIZE": "2"}, ["MPI_LOCALRANKID", "PMI_RANK"],
                 id="pmi-without-local-rank"),
    pytest.param({"PMIX_RANK": "1"}, ["PMIX_RANK", "world size"], id="pmix-alone"),
    pytest.param({**SRUN_PMI2, "SLURM_STEP_NODELIST": "vm[1-2"}, ["SLURM_STEP_NODELIST"],
                 id="unparsable-node-list"),
    pytest.param({**SLURM_3_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x"},
                 ["SLURM_STEP_TASKS_PER_NODE"], id="unparsable-tasks-per-node"),
    pytest.param({**SLURM_3_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
                 ["SLURM_NODEID=2", "SLURM_STEP_TASKS_PER_NODE"], id="node-beyond-tasks-list"),
    pytest.param({**SLURM_3_NODES, "SLURM_STEP_NUM_NODES": "2"},
                 ["3 hosts", "SLURM_STEP_NUM_NODES=2"], id="node-count-mismatch"),
    pytest.param({**SRUN_PMI2, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "1"},
                 ["slurm", "rank 1", "world size 1"], id="slurm-rank-not-below-size"),
    pytest.param({**OPENMPI, "PMI_RANK": "0", "PMI_SIZE": "8"},
                 ["disagree", "openmpi", "PMI_RANK=0", "PMI_SIZE=8"], id="openmpi-vs-pmi"),
    pytest.param({**SRUN_PMI2, "PMI_SIZE": "4"}, ["disagree", "slurm", "PMI_SIZE=4"],
                 id="slurm-vs-pmi"),
    pytest.param({**MVAPICH, "PMI_SIZE": "3"}, ["disagree", "mvapich", "PMI_SIZE=3"],
                 id="mvapich-vs-pmi"),
    pytest.param({**PALS, "PMI_RANK": "4"}, ["disagree", "pals", "PMI_RANK=4"], id="pals-vs-pmi"),
    pytest.param({**SRUN_RANK_BY_HAND, "RANK": "3"}, ["RANK=3", "SLURM_PROCID=5"],
                 id="rank-by-hand-vs-slurm"),
    pytest.param({**SRUN_RANK_BY_HAND, "WORLD_SIZE": "16"}, ["WORLD_SIZE=16", "8"],
                 id="world-size-by-hand-vs-slurm"),
    pytest.param({**SRUN_RANK_BY_HAND, "LOCAL_WORLD_SIZE": "8"}, ["LOCAL_WORLD_SIZE=8", "4"],
                 id="local-size-by-hand-vs-slurm"),
    pytest.param({**SRUN_RANK_BY_HAND, "LOCAL_RANK": "one"}, ["LOCAL_RANK", "'one'"],
                 id="local-rank-by-hand-not-a-number"),
    pytest.param({k: v for k, v in PALS.items() if k != "PMI_SIZE"}, ["PMI_SIZE", "PALS"],
                 id="pals-without-size"),
    pytest.param({"MASTER_PORT": "70000"}, ["MASTER_PORT", "70000", "1-65535"], id="port-high"),
    pytest.param({"MASTER_PORT": "0"}, ["MASTER_PORT"], id="port-zero"),
    pytest.param({"MASTER_PORT": "http"}, ["MASTER_PORT", "'http'"], id="port-text"),
    pytest.param({"DDP_PREEMPT_SIGNAL": "KILL"}, ["DDP_PREEMPT_SIGNAL", "KILL"], id="sigkill"),
    pytest.param({"DDP_PREEMPT_SIGNAL": "USR3"}, ["DDP_PREEMPT_SIGNAL", "USR3"], id="no-signal"),
]


@pytest.mark.parametrize("environ, words", BAD)
def test_bad_input_is_one_clear_error(environ, words):
    with pytest.raises(LaunchError) as info:
        detect(environ)
    for word in words:
        assert word in info.value.message, info.value.message
    assert info.value.hint, "every error says how to fix it"


@pytest.mark.parametrize(
    "visible, count",
    [(None, None), ("", 0), ("0", 1), ("0,1,2,3", 4), ("GPU-8d3a,GPU-11fe", 2), ("0,-1,2", 1),
     ("NoDevFiles", 0)],
)
def test_visible_device_count(visible, count):
    assert visible_device_count(visible) == count


def test_local_rank_beyond_visible_gpus():
    env = detect({**HYDRA, "CUDA_VISIBLE_DEVICES": "0,1"})  # local rank 2 of 3, two GPUs
    with pytest.raises(LaunchError) as info:
        local_device_index(env)
    assert "local rank 2" in info.value.message and "'0,1'" in info.value.message
    assert "-ppn 2" in info.value.hint
    assert local_device_index(env, device_count=3) == 2  # the count is a parameter
    with pytest.raises(LaunchError):
        local_device_index(detect(HYDRA), device_count=2)


def test_device_index():
    # srun --gpus-per-task=1 shows each task its own GPU as device 0
    assert local_device_index(detect({**HYDRA, "CUDA_VISIBLE_DEVICES": "3"})) == 0
    assert local_device_index(detect(HYDRA)) == 2  # nothing known: trust the local rank
    assert local_device_index(detect(HYDRA), device_count=4) == 2
