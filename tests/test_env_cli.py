"""``python -m launcher.env`` for real: plain python, mpiexec, torchrun, mpiexec inside sbatch.

srun steps and the batch script itself are covered by tests/test_slurm.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.mpi import REPO_ROOT, clean_environ, json_objects, mpiexec_path, run_mpi
from tests.fixtures.requirements import missing

ENV_JSON = ["-m", "launcher.env", "--json"]


def run_python(args: list[str], env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=clean_environ(env), cwd=REPO_ROOT, timeout=timeout)


def by_rank(records: list[dict], size: int) -> dict[int, dict]:
    ranks = {record["rank"]: record for record in records}
    assert sorted(ranks) == list(range(size)), records
    return ranks


def test_plain_python_json():
    result = run_python(ENV_JSON, env={"DDP_IMAGE": "ddp:test"})
    assert result.returncode == 0, result.stderr
    [record] = json_objects(result.stdout)
    assert record["launcher"] == "single"
    assert (record["rank"], record["world_size"], record["is_main"]) == (0, 1, True)
    assert (record["master_addr"], record["master_port"]) == ("127.0.0.1", None)
    assert record["image"] == "ddp:test"


def test_plain_python_table():
    result = run_python(["-m", "launcher.env"])
    assert result.returncode == 0, result.stderr
    rows = dict(line.split(None, 1) for line in result.stdout.splitlines() if "  " in line)
    assert rows["launcher"].strip() == "single" and rows["world_size"].strip() == "1"


def test_detection_starts_nothing_heavy():
    """No torch, no MPI: the CLI must be instant and must not start communication."""
    code = ("import sys; from launcher.placement.env import detect_environment; "
            "detect_environment(); "
            "heavy = [m for m in ('torch', 'mpi4py', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = run_python(["-c", code], env={"PMI_RANK": "0", "PMI_SIZE": "1",
                                           "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert result.returncode == 0, result.stderr


def test_bad_input_exits_2_with_hint():
    result = run_python(ENV_JSON, env={"MASTER_PORT": "99999"})
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[0].startswith("error: MASTER_PORT='99999'")
    assert result.stderr.splitlines()[1].startswith("HINT: ")
    assert "Traceback" not in result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 3])
def test_under_mpiexec(size):
    result = run_mpi(size, ENV_JSON, timeout=60)
    assert result.returncode == 0, result.output
    ranks = by_rank(json_objects(result.stdout), size)
    for rank, record in ranks.items():
        assert record["launcher"] == "hydra"
        assert (record["world_size"], record["local_rank"], record["local_world_size"]) == (
            size, rank, size)
        assert (record["master_addr"], record["master_port"]) == (None, None)
        assert record["is_main"] == (rank == 0)


@pytest.mark.mpi
def test_bad_input_under_mpiexec_fails_every_rank():
    result = run_mpi(2, ENV_JSON, timeout=60, env={"DDP_PREEMPT_SIGNAL": "SIGNOPE"})
    assert result.returncode == 2, result.output
    # counted in the whole text, not per line: Hydra merges the ranks' stderr and can split
    # one rank's line around another's
    assert result.stderr.count("error: DDP_PREEMPT_SIGNAL='SIGNOPE'") == 2, result.output
    assert result.stderr.count("HINT: ") == 2, result.output
    assert "Traceback" not in result.stderr


def test_under_torchrun():
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        missing(f"no torchrun next to {sys.executable}: torch is not installed there")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", *ENV_JSON], capture_output=True, text=True,
        env=clean_environ(), cwd=REPO_ROOT, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ranks = by_rank(json_objects(result.stdout), 2)
    ports = {record["master_port"] for record in ranks.values()}
    assert len(ports) == 1 and None not in ports
    for rank, record in ranks.items():
        assert record["launcher"] == "torchrun"
        assert (record["world_size"], record["local_rank"], record["local_world_size"]) == (
            2, rank, 2)
        assert record["job_id"]  # TORCHELASTIC_RUN_ID


@pytest.mark.slurm
@pytest.mark.mpi
def test_sbatch_script_and_mpiexec_inside(slurm_cluster, tmp_path):
    """The batch script itself is one process; mpiexec inside it must not read SLURM_PROCID."""
    tmp_path.chmod(0o755)
    python = f"{sys.executable} -m launcher.env --json"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"cd {REPO_ROOT}\n"
        f"{python} > {tmp_path}/batch.json\n"
        f"{mpiexec_path()} -n 2 {python} > {tmp_path}/mpiexec.json\n"
    )
    job_id = slurm_cluster.sbatch(script, ["-n", "2", "-o", str(tmp_path / "job.out")])
    state = slurm_cluster.wait_job(job_id, timeout=120)
    output = (tmp_path / "job.out").read_text()
    assert state.state == "COMPLETED", output
    [batch] = json_objects((tmp_path / "batch.json").read_text())
    assert (batch["launcher"], batch["world_size"], batch["job_id"]) == ("single", 1, str(job_id))
    ranks = by_rank(json_objects((tmp_path / "mpiexec.json").read_text()), 2)
    for rank, record in ranks.items():
        assert (record["launcher"], record["world_size"], record["local_rank"]) == (
            "hydra", 2, rank)


@pytest.mark.mpi
def test_run_mpi_timeout_kills_every_rank(tmp_path):
    """The fixture's promise to other tests: a hung run ends at its timeout, ranks and all."""
    code = (f"import os, time; open(r'{tmp_path}/' + os.environ['PMI_RANK'], 'w')"
            ".write(str(os.getpid())); time.sleep(600)")
    result = run_mpi(2, ["-c", code], timeout=5)
    assert result.timed_out and result.returncode != 0
    pids = [int(path.read_text()) for path in tmp_path.iterdir()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


@pytest.mark.mpi
def test_torchrun_under_mpiexec_does_not_take_the_agents_pmi(tmp_path):
    """The agent is Hydra's rank; its PMI_FD and PMI_RANK reach the workers, which are no MPI
    processes of Hydra: read as an offered PMI, the default backend was mpi and MPI_Init
    aborted ("PMIU_write error; fd=9 ... Bad file descriptor")."""
    script = tmp_path / "job.py"
    script.write_text(
        "import json, launcher\n"
        "with launcher.distributed(timeout_s=30) as job:\n"
        "    print(json.dumps({'rank': job.rank, 'backend': job.backend,\n"
        "                      'pmi': job.env.pmi, 'launcher': job.env.launcher}), flush=True)\n"
    )
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = run_mpi(1, [*torchrun, str(script)], timeout=90)
    assert result.returncode == 0, result.output
    for record in by_rank(json_objects(result.stdout), 2).values():
        assert (record["launcher"], record["pmi"], record["backend"]) == (
            "torchrun", "none", "gloo"), record
