"""The batch script `invoke sbatch` writes: compared exactly with its golden file, run as shell
with ``srun`` and ``scontrol`` replaced by stubs that record their arguments (the
requeue-on-75 logic without Slurm), and submitted to a real slurmctld."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from ddp_tasks.batch_script import EXIT_STATUS_FILE, TRAIN_RUN_DIR, Batch, batch_script
from ddp_tasks.commands import launch_segments, program_env
from ddp_tasks.launch_spec import Launch
from launcher.core import run_files
from launcher.core.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, LaunchError
from tests.fixtures.golden import GOLDEN, golden
from tests.fixtures.mpi import REPO_ROOT
from tests.fixtures.requirements import missing
from tests.fixtures.tasks_cli import INVOKE, invoke, on_path, stub_dir

SBATCH_FLAGS = ["--nodes", "2", "--procs-per-node", "4", "--gpus-per-node", "4",
                "--cpus-per-task", "8", "--signal", "USR2", "--time", "02:00:00",
                "--partition", "gpu", "--account", "proj42", "--bind", "/scratch",
                "--args", "--epochs 3"]
SBATCH_LAUNCH = Launch(nodes=2, procs_per_node=4, launcher="srun", gpus_per_node=4,
                       cpus_per_task=8, binds=("/scratch",),
                       args=("--resume", "auto", "--epochs", "3"),
                       env=program_env("USR2", omp_threads=8))
SBATCH_BATCH = Batch(time="02:00:00", partition="gpu", account="proj42", signal="USR2")


def sbatch_text() -> str:
    return batch_script(SBATCH_LAUNCH, SBATCH_BATCH)


def test_sbatch_golden():
    golden("sbatch.sh", sbatch_text())


def test_sbatch_cli_writes_the_script(tmp_path):
    result = invoke("sbatch", *SBATCH_FLAGS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ddp.sbatch\n"
    assert (tmp_path / "ddp.sbatch").read_text() == (GOLDEN / "sbatch.sh").read_text()
    assert os.access(tmp_path / "ddp.sbatch", os.X_OK)


def test_sbatch_cli_takes_a_node_range_restarts_and_preflight(tmp_path):
    flags = ["--nodes", "2-3", "--max-restarts", "2", "--preflight", *SBATCH_FLAGS[2:]]
    result = invoke("sbatch", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = replace(SBATCH_BATCH, max_nodes=3, max_restarts=2, preflight=True)
    assert (tmp_path / "ddp.sbatch").read_text() == batch_script(SBATCH_LAUNCH, expected)


@pytest.mark.parametrize(("nodes", "error"), [("3-2", "the range is empty"),
                                              ("two", "neither a count nor a range")])
def test_sbatch_cli_refuses_a_bad_node_range(tmp_path, nodes, error):
    result = invoke("sbatch", "--nodes", nodes, cwd=tmp_path)
    assert result.returncode == EXIT_USER_ERROR
    assert error in result.stderr and "HINT:" in result.stderr
    assert not (tmp_path / "ddp.sbatch").exists()


def test_sbatch_cli_submits(tmp_path):
    stubs = stub_dir(tmp_path, {"sbatch": 'echo "$@" > "$STUB_LOG/sbatch"; echo "4242;cluster"'})
    result = invoke("sbatch", "--submit", "--script", "job.sh", cwd=tmp_path,
                    PATH=on_path(stubs), STUB_LOG=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "job.sh\nsubmitted job 4242\n"
    assert (tmp_path / "sbatch").read_text() == "--parsable job.sh\n"


@pytest.mark.slurm
def test_sbatch_submit_runs_the_job_for_real(slurm_cluster, tmp_path):
    """`invoke sbatch --submit` against the real slurmctld: the job runs both ranks and ends."""
    (tmp_path / "hello.py").write_text(
        "import os\nprint('hello from rank', os.environ['SLURM_PROCID'])\n")
    result = invoke("sbatch", "--submit", "--runtime", "none", "--procs-per-node", "2",
                    "--module", "hello", "--time", "00:05:00", "--script", "job.sh",
                    cwd=tmp_path, PATH=on_path(INVOKE.parent),
                    SLURM_CONF=str(slurm_cluster.conf))
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = int(result.stdout.splitlines()[-1].removeprefix("submitted job "))
    finished = slurm_cluster.wait_job(job_id)
    assert (finished.state, finished.exit_code) == ("COMPLETED", "0:0"), finished
    output = (tmp_path / f"ddp-{job_id}.out").read_text()
    assert sorted(re.findall(r"^hello from rank (\d)$", output, re.M)) == ["0", "1"], output


# -- the generated script as shell ------------------------------------------------------------


def test_sbatch_script_parses(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(sbatch_text())
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_sbatch_script_is_shellcheck_clean(tmp_path):
    if not shutil.which("shellcheck"):
        missing("shellcheck is not installed (Debian: apt-get install shellcheck)")
    script = tmp_path / "job.sh"
    script.write_text(sbatch_text())
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    ("srun_exit", "scontrol_exit", "script_exit", "requeued"),
    [
        (EXIT_PREEMPTED, 0, 0, True),  # preempted: requeue, and the run is not a failure
        (EXIT_PREEMPTED, 1, 1, True),  # the requeue failed: the job fails
        (0, 0, 0, False),
        (1, 0, 1, False),
        (EXIT_USER_ERROR, 0, EXIT_USER_ERROR, False),
    ],
)
def test_sbatch_script_requeues_on_75(tmp_path, srun_exit, scontrol_exit, script_exit, requeued):
    stubs = stub_dir(tmp_path, {
        "srun": 'printf "%s\\n" "$@" > "$STUB_LOG/srun"; exit "$SRUN_EXIT"',
        "scontrol": 'printf "%s\\n" "$@" > "$STUB_LOG/scontrol"; exit "$SCONTROL_EXIT"',
    })
    script = tmp_path / "job.sh"
    script.write_text(sbatch_text())
    env = {**os.environ, "PATH": on_path(stubs),
           "STUB_LOG": str(tmp_path), "SLURM_JOB_ID": "4242",
           "SRUN_EXIT": str(srun_exit), "SCONTROL_EXIT": str(scontrol_exit)}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == script_exit, result.stderr
    srun_args = (tmp_path / "srun").read_text().splitlines()
    assert srun_args == [a for segment in launch_segments(SBATCH_LAUNCH) for a in segment][1:]
    if requeued:
        assert (tmp_path / "scontrol").read_text() == "requeue\n4242\n"
        assert "requeueing" in result.stderr
    else:
        assert not (tmp_path / "scontrol").exists()


@pytest.mark.parametrize(
    ("srun_exit", "written", "script_exit", "requeued"),
    [
        # torchrun's 1 after a preemption: the file says 75
        (1, "75 preempted, runs/train/checkpoints/ckpt-00000009.pt saved", 0, True),
        # srun's 143 after a lost node: the file says 3, which requeues without the node
        (143, "3 lost contact with rank 1 on n7", 0, True),
        (1, None, 1, False),  # nothing written: srun's status stands, not the previous attempt's
        (0, None, 0, False),
    ],
)
def test_sbatch_script_takes_the_status_the_ranks_wrote(tmp_path, srun_exit, written,
                                                        script_exit, requeued):
    status_file = tmp_path / "runs" / "train" / "exit-status"
    status_file.parent.mkdir(parents=True)
    status_file.write_text("75 preempted, left by the previous attempt\n")
    stubs = stub_dir(tmp_path, {
        "srun": '[ -z "$WRITTEN" ] || echo "$WRITTEN" > runs/train/exit-status; exit "$SRUN_EXIT"',
        "scontrol": 'printf "%s\\n" "$@" > "$STUB_LOG/scontrol"',
    })
    script = tmp_path / "job.sh"
    script.write_text(sbatch_text())
    env = {**os.environ, "PATH": on_path(stubs), "STUB_LOG": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SRUN_EXIT": str(srun_exit), "WRITTEN": written or ""}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == script_exit, result.stderr
    assert (tmp_path / "scontrol").exists() == requeued, result.stderr
    if written:
        code, reason = written.split(" ", 1)
        assert f"job 4242: the ranks report exit {code}: {reason}\n" in result.stderr


def test_status_file_is_where_launcher_train_writes_it():
    from launcher.training.config import TrainConfig

    assert Path(TRAIN_RUN_DIR) == TrainConfig().run_dir
    assert EXIT_STATUS_FILE == run_files.EXIT_STATUS_FILE
    custom = Launch(launcher="srun", args=("--run-dir", "/scratch/my run"))
    assert "status_file='/scratch/my run/exit-status'\n" in batch_script(custom, Batch())
    other = Launch(launcher="srun", module="mine")
    assert "status_file" not in batch_script(other, Batch())


# -- ch-run's join tag ------------------------------------------------------------------------

CH_SRUN = Launch(nodes=2, procs_per_node=2, launcher="srun", runtime="charliecloud",
                 image="/var/tmp/ddp-cpu", env=program_env("USR1"))


def test_ch_run_under_mpirun_keeps_its_own_join_tag():
    """Hydra's proxy or prted is ch-run's parent, one per job and node: its pid is the tag."""
    launch = replace(CH_SRUN, launcher="mpirun", hosts=("a", "b"))
    prefix = launch_segments(launch)[-2]
    assert prefix[:2] == ["ch-run", "--join-ct=2"]
    assert not any(arg.startswith("--join-tag") for arg in prefix)


@pytest.mark.parametrize("restarts", [None, "2"])
def test_ch_run_under_srun_joins_the_group_of_this_job_and_attempt(tmp_path, restarts):
    """The batch shell expands the tag: the job id, its attempt and the shell's pid, so that
    two jobs on a node (or a ch-run lock that a failed attempt left behind) share no group."""
    stubs = stub_dir(tmp_path, {"srun": 'printf "%s\\n" "$@" >> "$STUB_LOG/srun"; exit 0'})
    script = tmp_path / "job.sh"
    script.write_text(batch_script(CH_SRUN, Batch()))
    env = {**os.environ, "PATH": on_path(stubs), "STUB_LOG": str(tmp_path),
           "SLURM_JOB_ID": "4242"}
    env.pop("SLURM_RESTART_COUNT", None)
    if restarts:
        env["SLURM_RESTART_COUNT"] = restarts
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "srun").read_text().splitlines()
    tags = [arg for arg in argv if arg.startswith("--join-tag=")]
    assert len(tags) == 1, argv
    job, attempt, shell = tags[0].removeprefix("--join-tag=ddp-").split(".")
    assert (job, attempt) == ("4242", restarts or "0") and shell.isdigit(), tags
    assert argv[argv.index(tags[0]) - 1] == "ch-run"
    assert argv[argv.index(tags[0]) + 1] == "--join-ct=2"


@pytest.mark.parametrize(
    ("batch", "cause"),
    [
        (Batch(signal="KILL"), "is not a signal this process can catch"),
        (Batch(signal_seconds=0), "leaves no time to save a checkpoint"),
        (Batch(job_name="my job"), "sbatch reads directives without shell quoting"),
    ],
)
def test_bad_batch(batch, cause):
    with pytest.raises(LaunchError) as error:
        batch_script(SBATCH_LAUNCH, batch)
    assert cause in error.value.message
    assert error.value.hint


def test_sbatch_help_offers_only_the_runtimes_srun_starts(tmp_path):
    help_text = invoke("--help", "sbatch", cwd=tmp_path).stdout
    runtime = re.search(r"--runtime=STRING(.*?)\n  --", help_text, re.S).group(1)
    assert "docker" not in runtime and "podman-hpc" in runtime, runtime
    result = invoke("sbatch", "--runtime", "docker", cwd=tmp_path)
    assert result.returncode == EXIT_USER_ERROR  # what the help leaves out is refused


def test_the_written_batch_script_is_not_tracked():
    """`invoke sbatch` in a clone writes JOB_NAME.sbatch beside tasks.py: git ignores it."""
    for name in ("ddp.sbatch", "demo.sbatch"):
        result = subprocess.run(["git", "check-ignore", "-q", name], cwd=REPO_ROOT)
        assert result.returncode == 0, f"{name} is not in .gitignore"
