"""TensorBoard curves: the event format written by hand (checked against known CRC32C values
and read back), each step once across attempts, and a real run of launcher.train --tensorboard
preempted, rewound to an older checkpoint and resumed on another world size.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.api.job import Job
from launcher.core import event_file
from launcher.core.curves import PREFIX, Curves, read_curves
from launcher.core.errors import LaunchError
from launcher.core.event_file import Event
from tests.fixtures.mpi import REPO_ROOT, clean_environ
from tests.fixtures.training import metrics, preempt_rank_1, start_training, train


def test_crc32c_and_its_mask_match_the_published_values():
    assert event_file.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert event_file.crc32c(b"") == 0



def test_records_and_events_are_byte_for_byte_tensorboards():
    """The bytes tensorboard 2.21's RecordWriter and event_pb2 write for the same input."""
    assert (event_file.record(b"") + event_file.record(b"hello")).hex() == (
        "000000000000000029039807d8ea82a20500000000000000eab2043e68656c6c6fbb1f1c19")
    assert event_file.encode(Event(2.0, 300, (("a", 1.0),))).hex() == (
        "09000000000000004010ac022a0a0a080a0161150000803f")


@pytest.mark.parametrize("event", [
    Event(1.5, version=event_file.FILE_VERSION),
    Event(1700000000.25, 0, (("train/loss", 0.5),)),
    Event(2.0, 300, (("a", 1.0), ("eval/test_accuracy", 0.875))),
    Event(3.0, -1, (("x", -2.0),)),
])
def test_events_read_back_as_written(event):
    [read] = event_file.read_events(event_file.record(event_file.encode(event)))
    assert read == event


def test_reading_stops_at_a_torn_or_corrupt_record():
    first = event_file.record(event_file.encode(Event(1.0, 1, (("a", 1.0),))))
    second = event_file.record(event_file.encode(Event(2.0, 2, (("a", 2.0),))))
    assert [e.step for e in event_file.read_events(first + second[:-3])] == [1]
    flipped = second[:14] + bytes([second[14] ^ 1]) + second[15:]
    assert [e.step for e in event_file.read_events(first + flipped)] == [1]


def test_a_later_attempt_replaces_the_steps_it_logs_again(tmp_path):
    """The second attempt resumed at step 2 after the first had logged up to 5: each step once,
    the second attempt's from 3 on; the torn end of the first file is dropped with them."""
    first = Curves(tmp_path, is_main=True)
    for step in range(1, 6):
        first.log(step, loss=float(step))
    first.close()
    [path] = tmp_path.glob(f"{PREFIX}*")
    with path.open("ab") as torn:
        torn.write(b"\x10\x00")
    second = Curves(tmp_path, is_main=True)
    for step in range(3, 8):
        second.log(step, loss=-float(step))
    second.close()
    assert read_curves(tmp_path) == {"loss": [(1, 1.0), (2, 2.0), (3, -3.0), (4, -4.0),
                                              (5, -5.0), (6, -6.0), (7, -7.0)]}
    assert len(list(tmp_path.glob(f"{PREFIX}*"))) == 2


def test_only_the_main_rank_writes(tmp_path):
    Curves(tmp_path / "tb", is_main=False).log(1, loss=1.0)
    assert not (tmp_path / "tb").exists()


def test_log_metrics_without_a_run_directory_is_a_user_error():
    job = Job(env=None, backend="gloo", device=None, watch=None)
    with pytest.raises(LaunchError, match="no run directory was given") as caught:
        job.log_metrics(1, loss=0.5)
    assert "status_dir=RUN_DIR" in caught.value.hint


#: 48 divides into 2 and 3 ranks; 29 steps per epoch; a point every 5 steps and at epoch ends;
#: checkpoints at 20 and 40, so a preemption asked for after step 25 may land up to 14 steps
#: later (a loaded machine) and still leave ckpt-20 as the one before it
FLAGS = ["--global-batch-size", "48", "--epochs", "2", "--log-every", "5",
         "--checkpoint-every", "20", "--tensorboard"]


@pytest.mark.mpi
def test_one_point_per_step_after_a_preemption_and_a_resume_on_3_ranks(tmp_path):
    """2 ranks preempted after step 25; the checkpoint it saved is lost, so 3 ranks resume from
    step 20 and log 25 again: the curves hold every step once, the later value where logged
    twice, and the same steps as metrics.jsonl."""
    run, data = tmp_path / "run", tmp_path / "data"
    preempt_rank_1(start_training(run, data, "gloo", FLAGS), run, 25)
    saved = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    assert saved[-2].name == "ckpt-00000020.pt", saved
    saved[-1].unlink()  # as if the job had died after writing ckpt-20 only
    resumed = train(3, run, data, *FLAGS, "--resume", "auto")
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.stdout and "(step 20," in resumed.stdout, resumed.output

    curves = read_curves(run / "tensorboard")
    assert len(list((run / "tensorboard").glob(f"{PREFIX}*"))) == 2  # one file per attempt
    logged = [r["step"] for r in metrics(run, "step")]
    assert logged.count(25) == 2  # logged by both attempts
    latest = {r["step"]: r for r in metrics(run, "step")}
    steps = [step for step, _ in curves["train/loss"]]
    assert steps == sorted(latest) == sorted({*range(5, 58, 5), 29, 58}), steps
    for step, value in curves["train/loss"]:
        assert value == pytest.approx(latest[step]["loss"], rel=1e-6), step
    assert [step for step, _ in curves["eval/test_accuracy"]] == [29, 58]
    assert {"train/lr", "train/samples_per_s", "eval/test_loss"} <= set(curves)


def test_the_api_writes_curves_to_the_run_directory(tmp_path):
    """``job.log_metrics`` in a script of one's own, one process (world size 1)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, launcher\n"
        "with launcher.distributed(status_dir=sys.argv[1]) as job:\n"
        "    for step in range(1, 4):\n"
        "        job.log_metrics(step, **{'train/loss': 1 / step})\n")
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                            env=clean_environ(), cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert read_curves(tmp_path / "run" / "tensorboard") == {
        "train/loss": [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]}
