"""Start-up under real launchers: a rank that cannot start MPI ends every rank within the
bound (launcher.group.startup_guard), the venv under PMIx gives one clear error, gloo never loads
MPI; after each, no process of the job, no new MPICH segment in /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.group.startup_guard import GRACE_S
from tests.fixtures.host_mpi import OPENMPI_ROOT_ENV
from tests.fixtures.left_behind import LeftBehind
from tests.fixtures.mpi import REPO_ROOT, clean_environ, json_objects, mpiexec_path, run_mpi
from tests.fixtures.rank_exits import RANK_VARIABLE, RECORD, rank_exits

PY = sys.executable
#: launcher.check --timeout: each start-up stage may take it plus GRACE_S
TIMEOUT_S = 10
BOUND_S = TIMEOUT_S + GRACE_S
#: what a rank may take beyond the bound: the watchdog's own start, the kill, the exit
SLACK_S = 5
#: rank 1 stops before MPI_Init (as a rank whose node is slow or stuck); rank 0 then waits
#: inside MPI_Init, where no Python code of its own runs
RANK1_NEVER_STARTS = 'if [ "' + RANK_VARIABLE + '" = 1 ]; then exec sleep 600; fi; exec "$@"'
#: rank 1's MPI_Init fails (MPICH exits at once on a netmod it does not have); rank 0 then
#: waits inside MPI_Init, the case of a stale segment or a UCX address error
RANK1_FAILS_IN_MPI_INIT = ('if [ "' + RANK_VARIABLE + '" = 1 ]; then export '
                           'MPIR_CVAR_CH4_NETMOD=no-such-netmod; fi; exec "$@"')


def _check_argv(inject: str) -> list[str]:
    return ["sh", "-c", RECORD, "sh", "sh", "-c", inject, "sh", PY, "-m", "launcher.check",
            "--backend", "mpi", "--timeout", str(TIMEOUT_S)]


def _stage_error_on(stderr: str, rank: int) -> bool:
    return (f"[rank {rank} on " in stderr and "error: starting MPI did not finish within "
            f"{BOUND_S:.0f} s" in stderr)


def _mpiexec(argv: list[str], mark: str, timeout: float = 240) -> tuple[int, str]:
    """``mpiexec -n 2 ARGV`` to its end: exit status and stderr. CMA is set off: its probe
    waits up to 20 s for a rank that never comes, and rank 0 is to be in MPI_Init by then,
    where Hydra ends the job when it is killed (a rank that never spoke to Hydra is not
    waited for by the others, but by Hydra itself)."""
    process = subprocess.Popen([str(mpiexec_path()), "-n", "2", *argv], stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True, cwd=REPO_ROOT,
                               start_new_session=True,
                               env=clean_environ({"DDP_TEST_MARK": mark,
                                                  "MPIR_CVAR_CH4_CMA_ENABLE": "0"}))
    try:
        _, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr


def test_a_rank_stuck_before_mpi_ends_the_others_under_mpiexec():
    left = LeftBehind()
    status, stderr = _mpiexec(_check_argv(RANK1_NEVER_STARTS), left.mark)
    exits = rank_exits(stderr)
    assert _stage_error_on(stderr, 0), stderr
    assert stderr.count("error:") == 1, stderr
    assert "HINT: look at the other ranks' errors" in stderr
    assert status != 0 and exits[0][0] == 137, (status, exits)  # rank 0: ended by its watchdog
    left.check()


@pytest.mark.mpi
def test_a_rank_stuck_before_mpi_ends_the_others_under_open_mpi_mpirun(openmpi_prefix):
    """Open MPI's mpirun (PMIx), the venv's mpi4py pointed at it."""
    left = LeftBehind()
    stuck = 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exec sleep 600; fi; exec "$@"'
    library = str(openmpi_prefix / "lib" / "libmpi.so.40")
    process = subprocess.run(
        [str(openmpi_prefix / "bin" / "mpirun"), "-n", "2", "--oversubscribe",
         "-x", "MPI4PY_LIBMPI", "-x", "DDP_TEST_MARK", "-x", "PYTHONPATH",
         "sh", "-c", stuck, "sh", PY, "-m", "launcher.check", "--backend", "mpi",
         "--timeout", str(TIMEOUT_S)],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT,
        env=clean_environ({**OPENMPI_ROOT_ENV, "MPI4PY_LIBMPI": library,
                           "DDP_TEST_MARK": left.mark}))
    assert _stage_error_on(process.stderr, 0), process.stderr
    assert process.stderr.count("error:") == 1, process.stderr
    assert process.returncode != 0
    left.check()


@pytest.mark.slurm
def test_a_rank_failing_in_mpi_init_ends_the_others_under_srun(slurm_cluster):
    """The launch of the golden srun lines (--kill-on-bad-exit=0 --wait=60): the failed rank
    leaves the other in MPI_Init; its watchdog ends it within the bound, before srun would."""
    left = LeftBehind()
    started = time.time()
    result = slurm_cluster.srun(["-n", "2", "--mpi=pmi2", "--kill-on-bad-exit=0", "--wait=60",
                                 *_check_argv(RANK1_FAILS_IN_MPI_INIT)],
                                timeout=300, cwd=REPO_ROOT,
                                env={"DDP_TEST_MARK": left.mark, "PYTHONPATH": str(REPO_ROOT)})
    exits = rank_exits(result.stderr)
    assert sorted(exits) == [0, 1], result.stderr
    assert _stage_error_on(result.stderr, 0), result.stderr
    assert "[rank 1 on" in result.stderr and "the rank ended while starting MPI" in result.stderr
    assert exits[0][0] == 137 and exits[1][0] != 0, exits  # rank 0 ended by its watchdog
    # rank 0 entered MPI_Init before rank 1 failed or soon after: the bound, from then on
    assert exits[0][1] - exits[1][1] < BOUND_S + SLACK_S + 30, (exits, started)
    left.check()


@pytest.mark.slurm
def test_the_venv_under_pmix_gives_one_clear_error_on_every_rank(slurm_cluster):
    """The venv's MPICH speaks no PMIx: refused before MPI_Init, with the ways out."""
    if (Path(sys.prefix) / "lib" / "libmpi.so.40").exists():
        pytest.skip("this venv has an Open MPI: it starts under PMIx")
    left = LeftBehind()
    result = slurm_cluster.srun(["-n", "2", "--mpi=pmix", PY, "-m", "launcher.check",
                                 "--backend", "mpi", "--timeout", "60"],
                                timeout=300, cwd=REPO_ROOT, env={"DDP_TEST_MARK": left.mark})
    assert result.returncode == 2, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] error: slurm offers PMIx, which the MPICH at" in result.stderr
        assert f"[rank {rank}] HINT: launch with srun --mpi=pmi2" in result.stderr
    assert "MPIR_Init_thread" not in result.stderr, result.stderr  # MPICH's own stack
    assert "Traceback" not in result.stderr, result.stderr
    left.check()


GLOO_JOB = """
import json, os, sys
import launcher
with launcher.distributed(backend="gloo", timeout_s=60) as job:
    print(json.dumps({"rank": job.env.rank, "backend": job.backend,
                      "mpi4py": "mpi4py.MPI" in sys.modules,
                      "libmpi": os.environ.get("MPI4PY_LIBMPI")}), flush=True)
"""


@pytest.mark.slurm
def test_gloo_under_srun_pmi2_never_loads_mpi(slurm_cluster):
    result = slurm_cluster.srun(["-n", "2", "--mpi=pmi2", PY, "-c", GLOO_JOB], timeout=300,
                                cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stdout + result.stderr
    records = sorted(json_objects(result.stdout), key=lambda record: record["rank"])
    assert [(r["rank"], r["backend"], r["mpi4py"], r["libmpi"]) for r in records] == [
        (0, "gloo", False, None), (1, "gloo", False, None)]


def test_gloo_under_mpiexec_starts_mpi_for_the_rendezvous_only():
    """Hydra gives no address: the ranks agree on one over MPI, then run gloo."""
    result = run_mpi(2, ["-c", GLOO_JOB], timeout=240)
    assert result.returncode == 0, result.output
    records = json_objects(result.stdout)
    assert {(r["backend"], r["mpi4py"]) for r in records} == {("gloo", True)}, result.output


RANK = """
import re, sys
from launcher.group.startup_guard import guarded
with guarded("rank 3 on test", float(sys.argv[1])) as guard:
    guard.stage("starting MPI")
    if sys.argv[2] == "hang":  # holds the GIL throughout, as MPI_Init_thread does
        re.match(r"(a+)+$", "a" * 64 + "b")
    elif sys.argv[2] == "die":
        import os; os._exit(9)
print("started", flush=True)
"""


def _rank(bound_s: float, how: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([PY, "-c", RANK, str(bound_s), how], capture_output=True,
                            text=True, timeout=60, cwd=REPO_ROOT,
                            env=clean_environ())
    return result, time.monotonic() - started


def test_the_watchdog_is_quiet_after_a_start_in_time():
    result, _ = _rank(30, "fine")
    assert (result.returncode, result.stdout, result.stderr) == (0, "started\n", "")


def test_the_watchdog_ends_a_rank_that_holds_the_gil_past_the_bound():
    result, took = _rank(2, "hang")
    assert result.returncode == -9, result
    assert result.stderr.startswith(
        "[rank 3 on test] error: starting MPI did not finish within 2 s; the rank is ended\n"
        "[rank 3 on test] HINT: "), result.stderr
    assert took < 2 + SLACK_S


def test_the_watchdog_names_the_stage_a_rank_died_in():
    result, _ = _rank(30, "die")
    assert result.returncode == 9
    assert result.stderr.startswith("[rank 3 on test] error: the rank ended while starting "
                                    "MPI"), result.stderr
