"""launcher.faults.rank_record: the record a running rank keeps in the run directory, and what it
leaves when the rank ends without Python seeing it (killed: its node line; crashed: a
traceback after it). The batch script's reading of them: tests/test_batch_endings.py; on a
real Slurm with a survivor that crashes in MPI: tests/test_requeue.py."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.faults import rank_record
from tests.fixtures.mpi import REPO_ROOT


def test_the_record_holds_the_node_while_the_rank_runs_and_goes_after(tmp_path):
    path = tmp_path / "ranks" / "3"
    with rank_record.kept(tmp_path, 3, "n7"):
        assert path.read_text() == "n7\n"
        (tmp_path / "ranks" / "4").write_text("n8\n")  # another rank, still running
    assert not path.exists() and (tmp_path / "ranks").exists()


def test_an_exception_removes_it_too(tmp_path):
    with pytest.raises(RuntimeError), rank_record.kept(tmp_path, 0, "n0"):
        raise RuntimeError
    assert not (tmp_path / "ranks").exists()  # the last one leaves no empty directory


def test_it_is_touched_while_the_rank_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_record, "TOUCH_S", 0.05)
    path = tmp_path / "ranks" / "0"
    with rank_record.kept(tmp_path, 0, "n0"):
        os.utime(path, (0, 0))
        deadline = time.monotonic() + 5
        while path.stat().st_mtime == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_mtime > time.time() - 60


def test_an_unwritable_run_directory_is_left_to_the_job_to_report(tmp_path):
    (tmp_path / "ranks").write_text("a file where the directory goes")
    with rank_record.kept(tmp_path, 0, "n0"):
        pass


def test_a_faulthandler_the_user_enabled_is_enabled_again(tmp_path):
    faulthandler.enable()
    try:
        with rank_record.kept(tmp_path, 0, "n0"):
            pass
        assert faulthandler.is_enabled()
    finally:
        faulthandler.disable()


def _rank_that(ends: str, run_dir) -> subprocess.CompletedProcess:
    """A process that keeps its record and then ``ends`` (Python statements)."""
    code = ("import pathlib, launcher.faults.rank_record as r\n"
            f"with r.kept(pathlib.Path({str(run_dir)!r}), 1, 'n1'):\n    {ends}\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_crash_leaves_the_node_and_the_traceback(tmp_path):
    result = _rank_that("import faulthandler; faulthandler._sigsegv()", tmp_path)
    assert result.returncode == -signal.SIGSEGV
    node, *traceback = (tmp_path / "ranks" / "1").read_text().splitlines()
    assert node == "n1" and traceback[0] == "Fatal Python error: Segmentation fault"
    assert '  File "<string>", line 3 in <module>' in traceback


def test_a_killed_rank_leaves_its_node_alone(tmp_path):
    result = _rank_that("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    assert result.returncode == -signal.SIGKILL
    assert (tmp_path / "ranks" / "1").read_text() == "n1\n"
