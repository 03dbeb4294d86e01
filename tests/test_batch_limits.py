"""The batch script's time limit against its preemption signal: Slurm's ``--time`` formats read
as Slurm reads them, and a signal that would come at the job's start refused."""

from __future__ import annotations

import pytest

from ddp_tasks.batch_script import Batch, batch_script, time_limit_seconds
from ddp_tasks.launch_spec import Launch
from launcher.core.errors import LaunchError

LAUNCH = Launch(launcher="srun")


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90 * 60),  # minutes
    ("5:30", 6 * 60),  # minutes:seconds; Slurm rounds the limit up to whole minutes
    ("4:00", 4 * 60),
    ("01:00:00", 3600),  # hours:minutes:seconds
    ("2-0", 2 * 86400),  # days-hours
    ("1-", 86400),
    ("1-02:30", 86400 + 2 * 3600 + 30 * 60),  # days-hours:minutes
    ("1-02:30:01", 86400 + 2 * 3600 + 31 * 60),  # days-hours:minutes:seconds, rounded up
    ("UNLIMITED", None), ("infinite", None), ("-1", None), ("0", None), ("00:00:00", None),
    ("", None),  # no --time: the partition's default, unknown here
])
def test_time_limit_reads_slurms_formats(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["1h", "1:2:3:4", "-5", "1-:30", "1-2-3", "10 min", ":30"])
def test_a_time_slurm_rejects_is_one_error(text):
    with pytest.raises(LaunchError, match="is not a Slurm time limit") as error:
        batch_script(LAUNCH, Batch(time=text))
    assert error.value.hint


@pytest.mark.parametrize(("time", "seconds"), [
    ("00:05:00", 300),  # the report: the signal at the job's start, requeued forever
    ("00:05:00", 240),  # Slurm may send it 60 s early: at the start again
    ("5", 600),
    ("1", 60),  # a one-minute job has no room for the signal at all
])
def test_a_signal_at_the_jobs_start_is_refused(time, seconds):
    with pytest.raises(LaunchError, match="it can come at the job's start") as error:
        batch_script(LAUNCH, Batch(time=time, signal_seconds=seconds))
    assert "--signal-seconds" in error.value.hint and "--time" in error.value.hint


@pytest.mark.parametrize(("time", "seconds"), [
    ("00:05:00", 239), ("01:00:00", 60), ("UNLIMITED", 3600), ("0", 600),
])
def test_a_signal_before_the_limit_is_written(time, seconds):
    assert f"#SBATCH --signal=USR1@{seconds}\n" in batch_script(
        LAUNCH, Batch(time=time, signal_seconds=seconds))


def test_no_time_writes_no_time_directive():
    """An empty --time leaves the limit to the partition: ``--time=`` would make sbatch fail."""
    text = batch_script(LAUNCH, Batch(time=""))
    assert "--time" not in text
    assert "#SBATCH --time=01:00:00\n" in batch_script(LAUNCH, Batch())
