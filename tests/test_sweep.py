"""Sweeps as Slurm array jobs: the grid, the script (golden), each task's decisions with srun
and scontrol stubbed, and what ``invoke sweep-summary`` and ``invoke plot`` make of the run
directories. The same script on the real Slurm fixture: tests/test_sweep_slurm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ddp_tasks.batch_script import Batch, batch_script
from ddp_tasks.commands import program_env
from ddp_tasks.launch_spec import Launch
from ddp_tasks.run_metrics import read_runs
from ddp_tasks.runs import draw, summary_table
from ddp_tasks.sweep import Sweep, config_name, parse_config_name, parse_sweep
from launcher.core.errors import LaunchError
from tests.fixtures.golden import GOLDEN, golden
from tests.fixtures.tasks_cli import invoke, on_path, stub_dir

SWEEP_FLAGS = ["--procs-per-node", "2", "--sweep", "lr=0.1,0.05,0.02",
               "--sweep", "global-batch-size=64,128", "--throttle", "2",
               "--args", "--epochs 3 --run-dir runs/sweep"]
SWEEP_LAUNCH = Launch(procs_per_node=2, launcher="srun",
                      args=("--resume", "auto", "--epochs", "3", "--run-dir", "runs/sweep"),
                      env=program_env("USR1"))
SWEEP = Sweep((("lr", ("0.1", "0.05", "0.02")), ("global-batch-size", ("64", "128"))), 2)


def test_the_grid_is_every_combination_first_axis_slowest():
    assert [config_name(c) for c in SWEEP.configs()] == [
        "lr=0.1,global-batch-size=64", "lr=0.1,global-batch-size=128",
        "lr=0.05,global-batch-size=64", "lr=0.05,global-batch-size=128",
        "lr=0.02,global-batch-size=64", "lr=0.02,global-batch-size=128"]
    assert SWEEP.array() == "0-5%2"
    assert Sweep((("seed", ("0",)),)).array() == "0-0"


def test_flags_and_file_make_one_sweep():
    text = "# the second axis\n--global-batch-size = 64, 128  # two sizes\n\n"
    assert parse_sweep(["lr=0.1,0.05,0.02"], text, throttle=2) == SWEEP


def test_a_config_name_reads_back():
    for config in SWEEP.configs():
        assert parse_config_name(config_name(config)) == config
    assert parse_config_name("train") is None
    assert parse_config_name("lr=0.1,x") is None


@pytest.mark.parametrize(("specs", "text", "throttle", "error"), [
    (["lr"], "", 0, "is not FLAG=VALUE"),
    (["lr=0.1,"], "", 0, "is not FLAG=VALUE"),
    (["lr=0.1 0.2"], "", 0, "is not FLAG=VALUE"),
    (["LR=0.1"], "", 0, "is not FLAG=VALUE"),
    (["lr=a/b"], "", 0, "is not FLAG=VALUE"),
    (["lr=0.1"], "lr=0.2", 0, "lr is given twice"),
    (["lr=0.1,0.1"], "", 0, "repeats a value"),
    (["run-dir=a,b"], "", 0, "each task sets its own --run-dir"),
    ([], "# nothing\n", 0, "the sweep is empty"),
    (["lr=0.1"], "", -1, "--throttle -1 is negative"),
])
def test_a_bad_sweep_is_one_error(specs, text, throttle, error):
    with pytest.raises(LaunchError, match=error) as caught:
        parse_sweep(specs, text, throttle)
    assert caught.value.hint


def test_sweep_golden():
    golden("sbatch_sweep.sh", batch_script(SWEEP_LAUNCH, Batch(), SWEEP))


def test_single_job_scripts_are_unchanged_by_sweeps():
    """No sweep, no array: the script of a single job does not mention one."""
    text = batch_script(SWEEP_LAUNCH, Batch())
    assert "--array" not in text and "SLURM_ARRAY" not in text and "$job" not in text


def test_sbatch_cli_writes_the_sweep_script(tmp_path):
    sweep_file = tmp_path / "grid.txt"
    sweep_file.write_text("global-batch-size=64,128\n")
    flags = SWEEP_FLAGS[:4] + SWEEP_FLAGS[6:]  # without the second --sweep
    result = invoke("sbatch", *flags, "--sweep-file", str(sweep_file), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ddp.sbatch").read_text() == (GOLDEN / "sbatch_sweep.sh").read_text()


@pytest.mark.parametrize(("flags", "error"), [
    (["--sweep", "lr"], "error: --sweep 'lr' is not FLAG=VALUE"),
    (["--throttle", "2"], "error: --throttle limits the tasks of a sweep"),
    (["--sweep-file", "absent.txt"], "error: cannot read --sweep-file absent.txt"),
    (["--sweep", "lr=1", "--module", "hello"], "error: --sweep sets flags of launcher.train"),
])
def test_sbatch_cli_refuses_a_bad_sweep(tmp_path, flags, error):
    result = invoke("sbatch", *flags, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(error) and "HINT: " in result.stderr, result.stderr
    assert not (tmp_path / "ddp.sbatch").exists()


def test_sweep_script_is_shellcheck_clean(tmp_path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed")
    script = tmp_path / "job.sh"
    script.write_text(batch_script(SWEEP_LAUNCH, Batch(), SWEEP))
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# -- each task's decisions, with srun and scontrol stubbed ------------------------------------

#: what a rank writes for the batch script when it ends: $WRITTEN in the task's run directory
SRUN = """\
echo "$*" >> "$STUB_LOG/srun"
for arg; do [ "$prev" = --run-dir ] && run_dir=$arg; prev=$arg; done
mkdir -p "$run_dir"
[ -z "$WRITTEN" ] || echo "$WRITTEN" > "$run_dir/exit-status"
[ -z "$LOST" ] || echo "$LOST" > "$run_dir/lost-nodes"
exit "$SRUN_EXIT"
"""


def _run_task(tmp_path: Path, task: str, srun_exit: int = 0, written: str = "",
              lost: str = "") -> subprocess.CompletedProcess:
    stubs = stub_dir(tmp_path, {"srun": SRUN, "scontrol": 'echo "$*" >> "$STUB_LOG/scontrol"'})
    script = tmp_path / "job.sh"
    script.write_text(batch_script(SWEEP_LAUNCH, Batch(), SWEEP))
    env = {**os.environ, "PATH": on_path(stubs),
           "STUB_LOG": str(tmp_path), "SLURM_JOB_ID": "4300", "SLURM_ARRAY_JOB_ID": "4242",
           "SLURM_ARRAY_TASK_ID": task, "SLURM_JOB_NODELIST": "n0",
           "SRUN_EXIT": str(srun_exit), "WRITTEN": written, "LOST": lost}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=30)


def _calls(tmp_path: Path, name: str) -> list[str]:
    path = tmp_path / name
    return path.read_text().splitlines() if path.exists() else []


def test_a_task_trains_its_own_configuration_in_its_own_run_directory(tmp_path):
    result = _run_task(tmp_path, "3")
    assert result.returncode == 0, result.stderr
    [srun] = _calls(tmp_path, "srun")
    assert srun.endswith("python -m launcher.train --resume auto --epochs 3 --run-dir runs/sweep"
                         " --lr 0.05 --global-batch-size 128"
                         " --run-dir runs/sweep/lr=0.05,global-batch-size=128")
    assert not _calls(tmp_path, "scontrol")


def test_a_preempted_task_requeues_itself_alone(tmp_path):
    """75: ``scontrol requeue JOBID_TASKID``, never the array's id (which is every task)."""
    result = _run_task(tmp_path, "1", srun_exit=1, written="75 preempted")
    assert result.returncode == 0, result.stderr
    assert _calls(tmp_path, "scontrol") == ["requeue 4242_1"]
    assert "job 4242_1 preempted (exit 75): requeueing" in result.stderr
    log = (tmp_path / "runs/sweep/lr=0.1,global-batch-size=128/attempts.log").read_text()
    assert log.endswith("job 4242_1 attempt 1 on n0: exit 75 (preempted): requeue\n")


def test_a_task_that_lost_a_node_requeues_without_it(tmp_path):
    result = _run_task(tmp_path, "0", srun_exit=143, written="3 lost n7", lost="n7")
    assert result.returncode == 0, result.stderr
    assert _calls(tmp_path, "scontrol") == [
        "show job 4242_0", "requeue 4242_0", "update JobId=4242_0 ExcNodeList=n7"]


@pytest.mark.parametrize(("task", "error"), [
    ("6", "array task 6 is not one of the sweep's 6"),
    (None, "it is an array job"),
])
def test_a_task_outside_the_sweep_stops(tmp_path, task, error):
    result = _run_task(tmp_path, task)
    assert result.returncode != 0
    assert error in result.stderr
    assert not _calls(tmp_path, "srun")


# -- reading the runs back --------------------------------------------------------------------


def _write_run(path: Path, lr: float, steps: range, accuracy: float) -> None:
    path.mkdir(parents=True)
    lines = [{"event": "step", "step": s, "epoch": 0, "loss": 1 / (s + lr),
              "samples_per_s": 100.0} for s in steps]
    lines.append({"event": "eval", "step": steps[-1], "epoch": 0, "test_loss": 0.5,
                  "test_accuracy": accuracy})
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_summary_has_one_row_per_configuration_in_sweep_order(tmp_path):
    for lr, accuracy in (("0.1", 0.9), ("0.02", 0.7), ("0.05", 0.8)):
        _write_run(tmp_path / f"lr={lr}", float(lr), range(1, 5), accuracy)
    (tmp_path / "lr=0.05" / "attempts.log").write_text("a\nb\n")
    with (tmp_path / "lr=0.1" / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"event": "step", "st')  # a line the killed writer did not finish
    assert summary_table(read_runs([tmp_path])).splitlines() == [
        "lr    step  epoch  loss    test_loss  test_accuracy  attempts",
        "0.02  4     0      0.2488  0.5000     0.7000         -",
        "0.05  4     0      0.2469  0.5000     0.8000         2",
        "0.1   4     0      0.2439  0.5000     0.9000         -",
    ]


def test_a_resumed_run_counts_each_step_once(tmp_path):
    """A run resumed from a checkpoint at step 2 logged steps 3-4 twice: the later counts."""
    run = tmp_path / "run"
    _write_run(run, 0.1, range(1, 5), 0.9)
    with run.joinpath("metrics.jsonl").open("a") as metrics:
        for step in (3, 4, 5):
            metrics.write(json.dumps({"event": "step", "step": step, "loss": -step}) + "\n")
    [read] = read_runs([run])
    assert [(r["step"], r["loss"]) for r in read.events["step"]][2:] == [(3, -3), (4, -4), (5, -5)]


def test_no_metrics_is_one_error(tmp_path):
    with pytest.raises(LaunchError, match="holds no metrics.jsonl") as caught:
        read_runs([tmp_path])
    assert caught.value.hint


def test_plot_draws_every_run_into_one_png(tmp_path):
    pytest.importorskip("matplotlib")
    for lr in ("0.1", "0.05"):
        _write_run(tmp_path / "sweep" / f"lr={lr}", float(lr), range(1, 5), 0.8)
    result = invoke("plot", str(tmp_path / "sweep"), "--output", str(tmp_path / "c.png"),
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"{tmp_path / 'c.png'}: training loss, test loss, test accuracy, "
                             "samples/s of 2 runs\n")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_leaves_out_what_no_run_has(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    run.joinpath("metrics.jsonl").write_text('{"event": "step", "step": 1, "loss": 2.0}\n')
    assert draw(read_runs([run]), tmp_path / "c.png") == ["training loss"]


def test_docs_show_the_sweep_script():
    """docs/launching.md quotes the head and the step of the golden sweep script."""
    lines = (GOLDEN / "sbatch_sweep.sh").read_text().splitlines()
    docs = (Path(__file__).resolve().parent.parent / "docs" / "launching.md").read_text()
    assert "\n".join(lines[:30]) in docs
    step = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert "\n".join(lines[step:step + 4]) in docs
