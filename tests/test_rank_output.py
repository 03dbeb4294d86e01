"""Each rank's output in RUN_DIR/logs/rank-R.log, and ``[node:rank]`` on the job log's lines
of every rank but 0: the stream itself, then real mpiexec ranks of launcher.train, a clean run
and a user error, each appended to the same files.
"""

from __future__ import annotations

import io
import re
import socket
import sys

import pytest

from launcher.core import rank_output
from tests.fixtures.mpi import run_mpi
from tests.fixtures.training import train


def test_rank_0_passes_through_and_the_file_gets_everything(tmp_path, monkeypatch):
    inner = io.StringIO()
    monkeypatch.setattr(sys, "stdout", inner)
    with rank_output.teed(tmp_path, rank=0, world_size=2, node="n0") as path:
        sys.stdout.write("\r[##..] 1/2")  # a progress bar: shown as it comes
        assert inner.getvalue() == "\r[##..] 1/2"
        print("done")
    assert sys.stdout is inner
    assert path == tmp_path / "logs" / "rank-0.log"
    header, body = path.read_bytes().decode().split("\n", 1)
    assert re.fullmatch(r"--- \S+Z rank 0 of 2 on n0, pid \d+ ---", header)
    assert body == "\r[##..] 1/2done\n"


class Flushes(io.StringIO):
    """An inner stream that keeps what each flush would send to the job log."""

    def __init__(self):
        super().__init__()
        self.sent, self._from = [], 0

    def flush(self):
        if self.tell() > self._from:
            self.sent.append(self.getvalue()[self._from:])
            self._from = self.tell()


def test_rank_0s_printed_line_goes_out_with_its_newline(tmp_path, monkeypatch):
    """print() writes a line and its newline apart: sent apart, another rank's line could land
    between them in the job log (issue 36's acceptance test saw it once under mpiexec)."""
    inner = Flushes()
    monkeypatch.setattr(sys, "stderr", inner)
    with rank_output.teed(tmp_path, rank=0, world_size=4, node="n0"):
        print("[rank 0] hang: rank 2 ...", file=sys.stderr, flush=True)
        sys.stderr.write("\r[#.] 1/2")
    assert inner.sent == ["[rank 0] hang: rank 2 ...\n", "\r[#.] 1/2"]


class Writes(io.StringIO):
    """An unbuffered inner stream, as stderr is: each write goes out at once."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def write(self, text):
        self.sent.append(text)
        return super().write(text)


def test_rank_0s_line_goes_out_in_one_write_to_an_unbuffered_stream(tmp_path, monkeypatch):
    """stderr writes through: CI saw rank 1's hang line land between rank 0's and its newline
    under mpiexec."""
    inner = Writes()
    monkeypatch.setattr(sys, "stderr", inner)
    with rank_output.teed(tmp_path, rank=0, world_size=2, node="n0"):
        print("[rank 0] hang: rank 1 ...", file=sys.stderr, flush=True)
        sys.stderr.write("\r[#.] 1/2")
        print("a prompt: ", end="", file=sys.stderr, flush=True)
        sys.stderr.write("not yet asked for")
    assert inner.sent == ["[rank 0] hang: rank 1 ...\n", "\r[#.] 1/2", "a prompt: ",
                          "not yet asked for"]


def test_other_ranks_lines_are_labelled_whole(tmp_path, monkeypatch):
    inner = io.StringIO()
    monkeypatch.setattr(sys, "stderr", inner)
    with rank_output.teed(tmp_path, rank=3, world_size=4, node="n1"):
        sys.stderr.write("half ")
        assert inner.getvalue() == ""  # a line is shown whole, with its label
        sys.stderr.write("a line\nsecond\nthird")
    assert inner.getvalue() == "[n1:3] half a line\n[n1:3] second\n[n1:3] third\n"
    assert (tmp_path / "logs" / "rank-3.log").read_text().endswith(
        " ---\nhalf a line\nsecond\nthird")


def test_a_single_rank_is_not_labelled(tmp_path, monkeypatch):
    inner = io.StringIO()
    monkeypatch.setattr(sys, "stdout", inner)
    with rank_output.teed(tmp_path, rank=0, world_size=1, node="n0"):
        print("alone")
    assert inner.getvalue() == "alone\n"


def test_an_unwritable_run_directory_is_a_user_error(tmp_path):
    (tmp_path / "logs").write_text("a file where the directory goes")
    with pytest.raises(rank_output.LaunchError, match="cannot write this rank's log") as caught, \
            rank_output.teed(tmp_path, rank=0, world_size=1, node="n0"):
        pass
    assert caught.value.hint


@pytest.mark.mpi
def test_every_rank_keeps_its_output_across_attempts(tmp_path):
    """Two ranks train, then fail on a user error in the same run directory: each rank's file
    holds both attempts; the job log shows rank 1's lines labelled, rank 0's as they were."""
    run, data = tmp_path / "run", tmp_path / "data"
    node = socket.gethostname()
    done = train(2, run, data, "--epochs", "1", "--log-every", "10")
    assert done.returncode == 0, done.output
    steps = re.findall(r"^step \d+/22 epoch 0 loss .*$", done.stdout, re.M)  # rank 0 as before
    assert steps, done.output
    assert re.search(rf"^\[{re.escape(node)}:1\] param-sha256 rank=1 [0-9a-f]{{64}}$",
                     done.stdout, re.M), done.output
    assert re.search(r"^param-sha256 rank=0 ", done.stdout, re.M), done.output

    failed = train(2, run, data, "--epochs", "1", "--model", "absent_module:factory")
    assert failed.returncode == 2, failed.output
    assert f"[{node}:1] [rank 1] error: cannot import 'absent_module'" in failed.stderr
    assert re.search(r"^\[rank 0\] error: cannot import 'absent_module'", failed.stderr, re.M)

    first, second = (run / "logs" / f"rank-{rank}.log" for rank in (0, 1))
    text_0, text_1 = first.read_text(), second.read_text()
    assert len(re.findall(r"^--- \S+ rank 0 of 2 on .*---$", text_0, re.M)) == 2
    assert all(f"{line}\n" in text_0 for line in steps)
    assert "param-sha256 rank=0" in text_0 and "[rank 0] error: cannot import" in text_0
    assert len(re.findall(r"^--- \S+ rank 1 of 2 on .*---$", text_1, re.M)) == 2
    assert re.search(r"^param-sha256 rank=1 ", text_1, re.M)  # unlabelled in its own file
    assert re.search(r"^\[rank 1\] error: cannot import", text_1, re.M)
    assert "step 10/22" not in text_1


@pytest.mark.mpi
def test_check_keeps_each_ranks_output_and_names_the_files(tmp_path):
    result = run_mpi(2, ["-m", "launcher.check", "--backend", "gloo", "--run-dir",
                         str(tmp_path)], timeout=180)
    assert result.returncode == 0, result.output
    assert result.stdout.rstrip().endswith(
        f"check passed\neach rank's output: {tmp_path}/logs/rank-R.log"), result.output
    assert "check passed" in (tmp_path / "logs" / "rank-0.log").read_text()
    assert (tmp_path / "logs" / "rank-1.log").read_text().startswith("--- ")
