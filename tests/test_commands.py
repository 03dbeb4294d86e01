"""Launch commands, compared exactly with golden files; their errors.

Each case is checked twice: the pure builder in-process, and ``invoke run --dry-run`` as a user
types it, so the task's flag wiring is covered too. The batch script: test_batch_script.py.

After an intended change, regenerate the goldens and review the diff:

    UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_commands.py tests/test_batch_script.py \
        && git diff tests/golden
"""

from __future__ import annotations

import re

import pytest

from ddp_tasks.commands import launch_segments, parse_env, program_env, render, with_resume
from ddp_tasks.launch_spec import Launch
from launcher.core.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, LaunchError
from tests.fixtures.golden import GOLDEN, golden
from tests.fixtures.mpi import REPO_ROOT, mpiexec_path
from tests.fixtures.tasks_cli import INVOKE, invoke, on_path

RUN_CASES = {
    "run_srun_apptainer": (
        ["--nodes", "2", "--procs-per-node", "4", "--launcher", "srun", "--gpus-per-node", "4",
         "--cpus-per-task", "8", "--bind", "/scratch", "--ifname", "ib0",
         "--args", "--epochs 3"],
        Launch(nodes=2, procs_per_node=4, launcher="srun", gpus_per_node=4, cpus_per_task=8,
               binds=("/scratch",), args=("--epochs", "3"),
               env=program_env("USR1", omp_threads=8, ifname="ib0")),
    ),
    "run_mpich_apptainer": (
        ["--nodes", "2", "--procs-per-node", "2", "--hosts", "n[1-2]",
         "--env", "DDP_DATA=/scratch/digits"],
        Launch(nodes=2, procs_per_node=2, hosts=("n1", "n2"),
               env=program_env("USR1", extra=(("DDP_DATA", "/scratch/digits"),))),
    ),
    "run_openmpi_apptainer": (
        ["--nodes", "2", "--procs-per-node", "2", "--hosts", "a,b", "--mpi", "openmpi",
         "--signal", "USR2"],
        Launch(nodes=2, procs_per_node=2, hosts=("a", "b"), mpi="openmpi",
               env=program_env("USR2")),
    ),
    "run_mpich_docker": (
        ["--nodes", "2", "--procs-per-node", "2", "--runtime", "docker", "--prefix", "t1-",
         "--ifname", "eth0"],
        Launch(nodes=2, procs_per_node=2, runtime="docker", container_prefix="t1-",
               env=program_env("USR1", ifname="eth0")),
    ),
    "run_docker_run": (
        ["--procs-per-node", "8", "--runtime", "docker", "--image", "ddp:cpu", "--module",
         "launcher.check"],
        Launch(procs_per_node=8, runtime="docker", image="ddp:cpu", module="launcher.check",
               env=program_env("USR1")),
    ),
    "run_srun_charliecloud": (
        ["--nodes", "2", "--procs-per-node", "2", "--launcher", "srun", "--runtime",
         "charliecloud", "--pmi", "pmix", "--image", "/var/tmp/ddp-cpu",
         "--bind", "/opt/openmpi/lib:/opt/host-mpi/lib",
         "--env", "LD_LIBRARY_PATH=/opt/host-mpi/lib", "--args", "--backend mpi"],
        Launch(nodes=2, procs_per_node=2, launcher="srun", runtime="charliecloud", pmi="pmix",
               image="/var/tmp/ddp-cpu", binds=("/opt/openmpi/lib:/opt/host-mpi/lib",),
               args=("--backend", "mpi"),
               env=program_env("USR1", extra=(("LD_LIBRARY_PATH", "/opt/host-mpi/lib"),))),
    ),
    "run_openmpi_charliecloud": (
        ["--nodes", "2", "--procs-per-node", "1", "--hosts", "a,b", "--mpi", "openmpi",
         "--runtime", "charliecloud", "--module", "launcher.check"],
        Launch(nodes=2, hosts=("a", "b"), mpi="openmpi", runtime="charliecloud",
               module="launcher.check", env=program_env("USR1")),
    ),
    "run_srun_pyxis": (
        ["--nodes", "2", "--procs-per-node", "4", "--launcher", "srun", "--runtime", "pyxis",
         "--pmi", "default", "--image", "registry.example.org#ddp:cuda", "--gpus-per-node", "4",
         "--bind", "/scratch:/scratch", "--env", "DDP_DATA=/scratch/digits"],
        Launch(nodes=2, procs_per_node=4, launcher="srun", runtime="pyxis", pmi="default",
               image="registry.example.org#ddp:cuda", gpus_per_node=4,
               binds=("/scratch:/scratch",),
               env=program_env("USR1", extra=(("DDP_DATA", "/scratch/digits"),))),
    ),
    "run_srun_podman_hpc": (
        ["--nodes", "2", "--procs-per-node", "4", "--launcher", "srun", "--runtime",
         "podman-hpc", "--gpus-per-node", "4", "--bind", "/scratch:/scratch"],
        Launch(nodes=2, procs_per_node=4, launcher="srun", runtime="podman-hpc",
               gpus_per_node=4, binds=("/scratch:/scratch",), env=program_env("USR1")),
    ),
    "run_none": (
        ["--procs-per-node", "2", "--runtime", "none", "--master-addr", "127.0.0.1",
         "--master-port", "29500", "--env", "NOTE=two words", "--module", "launcher.check"],
        Launch(procs_per_node=2, runtime="none", module="launcher.check",
               env=program_env("USR1", master_addr="127.0.0.1", master_port=29500,
                               extra=(("NOTE", "two words"),))),
    ),
}

# -- golden files -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", RUN_CASES)
def test_run_golden(name):
    _, launch = RUN_CASES[name]
    golden(f"{name}.txt", render(launch_segments(launch)) + "\n")


@pytest.mark.parametrize("name", RUN_CASES)
def test_run_cli_dry_run(name):
    flags, _ = RUN_CASES[name]
    result = invoke("run", "--dry-run", *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (GOLDEN / f"{name}.txt").read_text()


@pytest.mark.parametrize("name", [*(f"{name}.txt" for name in RUN_CASES), "sbatch.sh"])
def test_docs_show_the_golden_outputs(name):
    """docs/launching.md quotes every golden file: a changed command needs changed docs."""
    assert (GOLDEN / name).read_text().strip() in (REPO_ROOT / "docs" / "launching.md").read_text()


@pytest.mark.mpi
def test_run_starts_the_ranks_and_returns_their_status(tmp_path):
    """For real, with the venv's mpiexec: two ranks that exit 75 make `invoke run` exit 75."""
    mpiexec_path()  # skips (fails in CI) without the venv's MPICH
    (tmp_path / "preempted.py").write_text("import sys\nsys.exit(75)\n")
    result = invoke("run", "--runtime", "none", "--procs-per-node", "2", "--module", "preempted",
                    cwd=tmp_path, PATH=on_path(INVOKE.parent))
    assert result.returncode == EXIT_PREEMPTED, result.stderr


STAGGERED = """\
import os, sys, time
rank = int(os.environ["SLURM_PROCID"])
time.sleep(0.5 * rank)  # rank 0 ends first, the others a little later, as after a preemption
sys.exit(int(sys.argv[1]) if rank == 0 else 75)
"""


@pytest.mark.slurm
@pytest.mark.parametrize(("rank0_exit", "status"), [(EXIT_PREEMPTED, EXIT_PREEMPTED), (1, 75)])
def test_srun_status_survives_staggered_exits(slurm_cluster, tmp_path, rank0_exit, status):
    """For real: srun returns 75, not 143 (SIGTERM), when the ranks exit one after another.

    With --kill-on-bad-exit=1 the first non-zero exit would have the others killed.
    """
    (tmp_path / "staggered.py").write_text(STAGGERED)
    result = invoke("run", "--launcher", "srun", "--runtime", "none", "--procs-per-node", "3",
                    "--module", "staggered", "--args", str(rank0_exit), cwd=tmp_path,
                    PATH=on_path(INVOKE.parent), SLURM_CONF=str(slurm_cluster.conf))
    assert result.returncode == status, result.stdout + result.stderr


# -- small pure functions ---------------------------------------------------------------------


def test_program_env_order_and_override():
    env = program_env("sigusr2", omp_threads=4, master_port=29500, ifname="ib0",
                      extra=(("OMP_NUM_THREADS", "2"), ("DDP_X", "1")))
    assert env == (
        ("PYTHONUNBUFFERED", "1"), ("OMP_NUM_THREADS", "2"), ("DDP_PREEMPT_SIGNAL", "USR2"),
        ("MASTER_PORT", "29500"), ("GLOO_SOCKET_IFNAME", "ib0"), ("NCCL_SOCKET_IFNAME", "ib0"),
        ("DDP_X", "1"),
    )


def test_parse_env_keeps_equals_in_values():
    assert parse_env(["A=1", "B=x=y", "C="]) == (("A", "1"), ("B", "x=y"), ("C", ""))


@pytest.mark.parametrize("args", [("--resume", "none"), ("--resume=none",)])
def test_with_resume_keeps_the_users_choice(args):
    assert with_resume("launcher.train", args) == args


def test_with_resume_only_for_launcher_train():
    assert with_resume("launcher.train", ("--epochs", "3")) == ("--resume", "auto", "--epochs",
                                                                "3")
    assert with_resume("mypkg.train", ("--epochs", "3")) == ("--epochs", "3")


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("launch", "cause"),
    [
        (Launch(nodes=0), "--nodes 0 must be at least 1"),
        (Launch(procs_per_node=0), "--procs-per-node 0 must be at least 1"),
        (Launch(gpus_per_node=-1), "--gpus-per-node -1 is negative"),
        (Launch(launcher="torchrun"), "unknown --launcher 'torchrun'"),
        (Launch(mpi="intel"), "unknown --mpi 'intel'"),
        (Launch(runtime="podman"), "unknown --runtime 'podman'"),
        (Launch(nodes=3, hosts=("a", "b")), "--hosts names 2 host(s) but --nodes is 3"),
        (Launch(hosts=("a",), hostfile="hosts.txt"), "both --hosts and --hostfile given"),
        (Launch(nodes=2), "mpirun on 2 nodes needs to know which nodes"),
        (Launch(runtime="none", binds=("/data",)), "--bind needs a container runtime that binds"),
        (Launch(runtime="pyxis"), "--runtime pyxis is an srun plugin: mpirun cannot use it"),
        (Launch(launcher="srun", pmi="pmi3"), "unknown --pmi 'pmi3'"),
        (Launch(launcher="srun", runtime="docker"), "--runtime docker cannot be started by srun"),
        (Launch(launcher="srun", hostfile="h"), "srun takes no --hostfile"),
        (Launch(launcher="srun", env=(("X", "a,b"),)), "--export splits its list at commas"),
        (Launch(runtime="docker", mpi="openmpi"), "the image ships MPICH's Hydra only"),
        (Launch(runtime="docker", hostfile="h"), "--runtime docker takes no --hostfile"),
    ],
)
def test_bad_launch(launch, cause):
    with pytest.raises(LaunchError) as error:
        launch_segments(launch)
    assert cause in error.value.message
    assert error.value.hint


@pytest.mark.parametrize("runtime", ["charliecloud", "podman-hpc"])
def test_srun_passes_commas_that_do_not_go_through_export(runtime):
    """ch-run's --set-env and podman-hpc's -e carry the variables, not srun's --export."""
    launch = Launch(launcher="srun", runtime=runtime,
                    env=program_env("USR1", ifname="ib0,ib1",
                                    extra=(("NCCL_IB_HCA", "mlx5_0,mlx5_1"),)))
    line = render(launch_segments(launch))
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1 " in line and "NCCL_SOCKET_IFNAME=ib0,ib1 " in line
    assert "--export=ALL \\\n" in line


@pytest.mark.parametrize(("runtime", "name"), [("apptainer", "APPTAINERENV_NCCL_IB_HCA"),
                                               ("pyxis", "NCCL_IB_HCA"), ("none", "NCCL_IB_HCA")])
def test_srun_refuses_commas_that_go_through_export(runtime, name):
    launch = Launch(launcher="srun", runtime=runtime, env=(("NCCL_IB_HCA", "mlx5_0,mlx5_1"),))
    with pytest.raises(LaunchError, match="--export splits its list at commas") as error:
        launch_segments(launch)
    assert error.value.message.startswith(f"srun cannot pass {name}=")
    assert error.value.hint.startswith(f"export {name} in your shell")


def test_env_preempt_signal_must_be_the_signal():
    """--env DDP_PREEMPT_SIGNAL beside another --signal: Slurm would send a signal the ranks
    do not catch, and it would end them without a checkpoint."""
    for same in ("USR2", "sigusr2"):
        env = dict(program_env("USR2", extra=(("DDP_PREEMPT_SIGNAL", same),)))
        assert env["DDP_PREEMPT_SIGNAL"] == same
    with pytest.raises(LaunchError) as error:
        program_env("USR1", extra=(("DDP_PREEMPT_SIGNAL", "USR2"),))
    assert error.value.message == ("--env DDP_PREEMPT_SIGNAL=USR2 differs from the preemption "
                                   "signal USR1 (--signal, or its default)")
    assert "--signal USR2" in error.value.hint


@pytest.mark.parametrize("task", [["run", "--dry-run", "--launcher", "srun"], ["sbatch"]])
def test_cli_refuses_env_preempt_signal_unlike_signal(tmp_path, task):
    """`invoke run` and `invoke sbatch` alike, with --signal left at its default."""
    result = invoke(*task, "--runtime", "none", "--env", "DDP_PREEMPT_SIGNAL=USR2", cwd=tmp_path)
    assert result.returncode == EXIT_USER_ERROR, result.stdout + result.stderr
    assert result.stderr.startswith("error: --env DDP_PREEMPT_SIGNAL=USR2 differs"), result.stderr
    assert "\nHINT: " in result.stderr
    assert list(tmp_path.iterdir()) == []
    agreed = invoke(*task, "--runtime", "none", "--signal", "USR2",
                    "--env", "DDP_PREEMPT_SIGNAL=USR2", cwd=tmp_path)
    assert agreed.returncode == 0, agreed.stderr


def test_bad_env_and_signal():
    with pytest.raises(LaunchError, match="is not NAME=VALUE"):
        parse_env(["1X=2"])
    with pytest.raises(LaunchError, match="not a signal"):
        program_env("NOPE")


@pytest.mark.parametrize(
    ("argv", "cause"),
    [
        (["run", "--dry-run", "--nodes", "3", "--hosts", "a,b"], "--hosts names 2 host(s)"),
        (["run", "--dry-run", "--hosts", "a[1-"], "is not a Slurm host list"),
        (["run", "--dry-run", "--env", "novalue"], "is not NAME=VALUE"),
        (["sbatch", "--runtime", "docker"], "--runtime docker cannot be started by srun"),
        (["sbatch", "--time", "00:05:00", "--signal-seconds", "300"], "at the job's start"),
        (["sbatch", "--time", "1h"], "--time '1h' is not a Slurm time limit"),
    ],
)
def test_cli_errors_name_cause_and_hint(argv, cause, tmp_path):
    result = invoke(*argv, cwd=tmp_path)
    assert result.returncode == EXIT_USER_ERROR
    assert cause in result.stderr
    assert "\nHINT: " in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written on error


# -- `invoke run` from .venv/bin with the venv not on PATH (not activated) ---------------------

#: a shell's PATH without the venv: what `.venv/bin/invoke` sees when the venv is not active
NO_VENV_PATH = "/usr/local/bin:/usr/bin:/bin"


@pytest.mark.mpi
def test_run_runtime_none_uses_the_venvs_mpiexec_and_python(tmp_path):
    mpiexec_path()
    result = invoke("run", "--runtime", "none", "--procs-per-node", "2", "--module",
                    "launcher.env", cwd=tmp_path, PATH=NO_VENV_PATH, PYTHONPATH=str(REPO_ROOT))
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"^rank +(\d)$", result.stdout, re.M)) == ["0", "1"], result.stdout


def test_run_without_the_host_launcher_says_so_with_a_hint(tmp_path):
    result = invoke("run", "--module", "launcher.env", cwd=tmp_path, PATH=NO_VENV_PATH)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert result.stderr.startswith("error: mpiexec is not on PATH\nHINT: "), result.stderr


