"""The launcher under a real Slurm: srun steps, a batch script, PMI-2 with the venv's MPICH.

Every test runs against the one-node cluster of ``tests.fixtures.slurm`` (real munged,
slurmctld, slurmd); tasks run the venv's Python from the repository root.
"""

from __future__ import annotations

import re
import shlex
import sys

import pytest

from launcher.placement.ports import slurm_port
from tests.fixtures.mpi import REPO_ROOT, json_objects

pytestmark = pytest.mark.slurm

PY = sys.executable
# importing torch on every rank of a shared 2-core machine takes tens of seconds
TORCH_TIMEOUT = 300


def _ok(result) -> str:
    """stdout of a successful srun; both streams in the assertion message otherwise."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _env_records(slurm_cluster, ranks: int, *srun_args: str) -> list[dict]:
    out = _ok(slurm_cluster.srun(["-n", str(ranks), *srun_args, PY, "-m", "launcher.env",
                                  "--json"], timeout=120, cwd=REPO_ROOT))
    return sorted(json_objects(out), key=lambda record: record["rank"])


@pytest.mark.parametrize("ranks", [2, 3])
def test_srun_tasks_see_their_place(slurm_cluster, ranks):
    records = _env_records(slurm_cluster, ranks, "--mpi=pmi2")
    node = slurm_cluster.node
    assert [r["rank"] for r in records] == list(range(ranks))
    assert [r["local_rank"] for r in records] == list(range(ranks))  # one node: local == global
    for record in records:
        assert record["launcher"] == "slurm", record
        assert (record["world_size"], record["local_world_size"]) == (ranks, ranks)
        assert (record["node_rank"], record["num_nodes"]) == (0, 1)
        assert record["hosts"] == [node] and record["master_addr"] == node
    job_ids = {r["job_id"] for r in records}
    ports = {r["master_port"] for r in records}
    assert len(job_ids) == 1 and len(ports) == 1, "ranks disagree on the rendezvous"
    # every rank computes the port alone, from the job id and step id 0 of this srun
    assert ports == {slurm_port(job_ids.pop(), "0")}


def test_each_job_gets_its_own_port(slurm_cluster):
    """Two jobs on one node must not rendezvous on the same port ("Address already in use")."""
    first, second = (_env_records(slurm_cluster, 2)[0] for _ in range(2))
    assert first["job_id"] != second["job_id"]
    assert first["master_port"] != second["master_port"]


def test_batch_script_is_one_process_and_its_srun_the_job(slurm_cluster, tmp_path):
    """The batch script has SLURM_PROCID=0 and SLURM_NTASKS=2 but is one process, not rank 0."""
    output = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    command = shlex.join([PY, "-m", "launcher.env", "--json"])
    script.write_text(f"#!/bin/bash\n#SBATCH -n 2\nset -e\n{command}\nsrun --mpi=pmi2 {command}\n")
    job_id = slurm_cluster.sbatch(script, ["--output", str(output)], cwd=REPO_ROOT)
    result = slurm_cluster.wait_job(job_id, timeout=120)
    text = output.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", "0:0"), text
    batch, *tasks = json_objects(text)
    assert (batch["launcher"], batch["world_size"], batch["rank"]) == ("single", 1, 0)
    assert sorted(t["rank"] for t in tasks) == [0, 1]
    assert {(t["launcher"], t["world_size"], t["job_id"]) for t in tasks} == {
        ("slurm", 2, str(job_id))}


def test_mpi4py_world_forms_under_srun_pmi2(slurm_cluster):
    """The PyPI MPICH in the venv takes its rank from Slurm's PMI-2: one world of 2."""
    code = ("from mpi4py import MPI; w = MPI.COMM_WORLD; "
            "print('world', w.Get_rank(), w.Get_size(), w.allreduce(w.Get_rank() + 1), "
            "MPI.Get_library_version().split()[0], flush=True)")
    out = _ok(slurm_cluster.srun(["-n", "2", "--mpi=pmi2", PY, "-c", code], timeout=120))
    lines = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("world "))
    assert lines == [["0", "2", "3", "MPICH"], ["1", "2", "3", "MPICH"]], out


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "not-built"])
def test_mpi_starts_under_srun_pmi2_with_or_without_the_ucx_padding(slurm_cluster, tmp_path,
                                                                   padded):
    """The bundled MPICH's PMI lines stay under Slurm's pmi2 limit: its UCX address is padded
    with zeros (launcher.mpi.ucx_address, built by the bootstrap); where that is not built,
    MPI_Init runs on a thread of its own (launcher.mpi.own_arena), not the main one."""
    code = ("from launcher.mpi import library, ucx_address; from launcher.placement.env import "
            "detect_environment; w = library.start(detect_environment()); from mpi4py import MPI; "
            "print('main', w.Get_rank(), MPI.Is_thread_main(), w.allreduce(1), "
            "ucx_address.padded(), flush=True)")
    env = {} if padded else {"DDP_MPI_CXX_DIR": str(tmp_path)}  # nothing built there
    out = _ok(slurm_cluster.srun(["-n", "2", "--mpi=pmi2", PY, "-c", code], timeout=120,
                                 cwd=REPO_ROOT, env=env))
    expected = "True 2 1" if padded else "False 2 None"
    assert sorted(line for line in out.splitlines() if line.startswith("main ")) == [
        f"main 0 {expected}", f"main 1 {expected}"], out


@pytest.mark.parametrize("backend", ["gloo", "mpi", "gloo,mpi", "mpi,gloo"])
def test_check_passes_under_srun(slurm_cluster, backend):
    """gloo,mpi: the gloo round reads the MPI library's version without starting MPI; the
    mpi round must then start it (it failed with 'before initializing ... MPICH')."""
    result = slurm_cluster.srun(["-n", "2", "--mpi=pmi2", PY, "-m", "launcher.check",
                                 "--backend", backend, "--timeout", "120"],
                                timeout=TORCH_TIMEOUT, cwd=REPO_ROOT)
    out = _ok(result)
    assert "check passed" in out
    # the table lists both ranks, each found by the Slurm detector
    assert len(re.findall(rf"^\d\s.*\s{slurm_cluster.node}\s+slurm\s", out, re.M)) == 2, out


def test_check_without_pmi_explains_the_mismatch(slurm_cluster):
    """``srun --mpi=none``: MPI would start every task as rank 0 of 1 -- one clear error and a
    HINT on every rank before MPI starts, exit 2."""
    result = slurm_cluster.srun(["-n", "2", "--mpi=none", PY, "-m", "launcher.check",
                                 "--backend", "mpi", "--timeout", "60"],
                                timeout=TORCH_TIMEOUT, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stdout
    for rank in (0, 1):
        assert f"[rank {rank}] error: srun started the tasks without a PMI" in result.stderr
        assert f"[rank {rank}] HINT: under Slurm pass srun --mpi=pmi2" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_gloo_needs_no_pmi(slurm_cluster):
    """The same launch with gloo is fine: only MPI needs the PMI."""
    result = slurm_cluster.srun(["-n", "2", "--mpi=none", PY, "-m", "launcher.check",
                                 "--backend", "gloo", "--timeout", "60"],
                                timeout=TORCH_TIMEOUT, cwd=REPO_ROOT)
    assert "check passed" in _ok(result)


def test_train_ends_with_identical_weights(slurm_cluster, tmp_path):
    result = slurm_cluster.srun(
        ["-n", "2", "--mpi=pmi2", PY, "-m", "launcher.train", "--epochs", "1",
         "--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data")],
        timeout=TORCH_TIMEOUT, cwd=REPO_ROOT)
    out = _ok(result)
    hashes = dict(re.findall(r"^(?:\[\S+\] )?param-sha256 rank=(\d+) ([0-9a-f]{64})$", out, re.M))
    assert sorted(hashes) == ["0", "1"], out
    assert hashes["0"] == hashes["1"], out
