"""Ranks alive but not meeting, for real: mpiexec, gloo and the mpi backend, 2 and 4 ranks.

Each job runs tests/hang_scripts/hung.py with ``timeout_s=5``: rank 1 skips an all_reduce,
spins in a Python loop, waits on a lock of its own, or stops (SIGSTOP). Every rank that can
must print the one line naming rank 1, the collective and the lines, within the timeout + 10 s
of rank 0 starting to wait, exit 4 (3 for the stopped rank: its node is the suspect), leave the
post-mortem that ``python -m launcher.hang`` reads back to the same line, and nothing behind.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.errors import EXIT_HUNG, EXIT_PEER_LOST
from tests.fixtures.left_behind import LeftBehind
from tests.fixtures.mpi import REPO_ROOT, clean_environ, mpiexec_path

# the ranks' exchanges travel on the side channel of issue 35, merged apart from this branch

SCRIPTS = Path(__file__).parent / "hang_scripts"
TIMEOUT_S = 5
#: what the issue allows after the timeout
BOUND_S = 10


def _line(script: str, marker: str) -> str:
    text = (SCRIPTS / script).read_text().splitlines()
    number = next(n for n, line in enumerate(text, 1) if f"# {marker}" in line)
    return f"tests/hang_scripts/{script}:{number}"


def _run(ranks: int, args: list[str]) -> tuple[int, str, float]:
    """Run the job; its status, output and when it ended (time.monotonic)."""
    left = LeftBehind()
    process = subprocess.run([str(mpiexec_path()), "-n", str(ranks), sys.executable, *args],
                             capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                             env=clean_environ({"DDP_TEST_MARK": left.mark}))
    ended = time.monotonic()
    left.check()
    return process.returncode, process.stdout + process.stderr, ended


def _lines(output: str, rank: int) -> list[str]:
    """Rank's ``hang:`` lines, without the ``[node:rank]`` label other ranks' lines carry in
    the job log (launcher.core.rank_output)."""
    lines = (re.sub(r"^\[[^\]\s]+:\d+\] ", "", line) for line in output.splitlines())
    return [line.split("] ", 1)[1] for line in lines if line.startswith(f"[rank {rank}] hang:")]


CASES = [  # how, backend, ranks
    ("skip", "gloo", 4), ("skip", "mpi", 4), ("spin", "gloo", 2), ("spin", "mpi", 2),
    ("lock", "gloo", 2), ("lock", "mpi", 2), ("stop", "gloo", 2), ("stop", "mpi", 2),
]


@pytest.mark.parametrize(("how", "backend", "ranks"), CASES)
def test_the_line_names_who_is_where(how, backend, ranks, tmp_path):
    status, output, ended = _run(ranks, [str(SCRIPTS / "hung.py"), how, backend,
                                         str(tmp_path)])
    since = float(re.search(r"waiting since (\S+)", output).group(1))
    assert ended - since <= TIMEOUT_S + BOUND_S, output
    waited = _line("hung.py", "the all_reduce")
    if how == "stop":
        assert status == EXIT_PEER_LOST, output
        assert re.search(rf"\[rank 0\] error: .*all_reduce #3 at {waited}.*"
                         r"no heartbeat for 5 s from rank 1 \(", output), output
        return
    assert status == EXIT_HUNG, output
    line = _lines(output, 0)[0]
    for rank in range(ranks):
        # a rank that left the job (rank 1, its barrier met by MPI) prints nothing more
        left = rank == 1 and "rank 1 (vm) ended at " in line
        assert _lines(output, rank) == ([] if left else [line]), output
    if how == "skip":
        assert f"rank 1 (vm) is in barrier #4 at {_line('hung.py', 'the barrier')}" in line \
            or f"rank 1 (vm) called barrier #4 at {_line('hung.py', 'the barrier')}" in line
        assert "all_reduce #4 at " + waited in line and "in a different order" in line
    else:
        assert line.startswith(f"hang: rank 1 (vm) never entered all_reduce #3: it is at "
                               f"{_line('hung.py', 'the ' + how)}"), line
        assert f"wait in all_reduce #3 at {waited}" in line or \
            f"waits in all_reduce #3 at {waited}" in line
    assert (tmp_path / "exit-status").read_text() == f"{EXIT_HUNG} {line}\n"
    again = subprocess.run([sys.executable, "-m", "launcher.hang", str(tmp_path)],
                           capture_output=True, text=True, env=clean_environ(), cwd=REPO_ROOT)
    assert again.stdout.splitlines()[0] == line, again.stdout + again.stderr
    assert len(again.stdout.splitlines()) == 2 + 1 + ranks  # the line, a gap, the table


def test_acceptance_rank_2_skips_the_5th_all_reduce(tmp_path):
    """Issue 36's acceptance: every rank ends within 30 s, one line naming rank 2,
    all_reduce #5 and both source lines; python -m launcher.hang prints the same."""
    started = time.monotonic()
    status, output, ended = _run(4, [str(SCRIPTS / "acceptance.py"), str(tmp_path)])
    assert status == EXIT_HUNG, output
    line = _lines(output, 0)[0]
    # rank 2 left the job before: the others print it
    assert [_lines(output, rank) for rank in (0, 1, 3)] == [[line]] * 3, output
    assert "rank 2 (vm)" in line and "all_reduce #5" in line, line
    assert _line("acceptance.py", "the gradients") in line, line
    assert _line("acceptance.py", "the loss") in line, line
    assert ended - started <= 30 + 10, output  # 30 s of the job, up to 10 s to start it
    again = subprocess.run([sys.executable, "-m", "launcher.hang", str(tmp_path)],
                           capture_output=True, text=True, env=clean_environ(), cwd=REPO_ROOT)
    assert again.stdout.splitlines()[0] == line


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_rank_that_never_reaches_backward(backend, tmp_path):
    """DDP's gradient all_reduce goes from C++ into the group: the model wrapped by
    ``job.wrap`` records it, so the line names the bucket and where the others called
    backward."""
    status, output, ended = _run(2, [str(SCRIPTS / "backward.py"), backend, str(tmp_path)])
    since = float(re.search(r"waiting since (\S+)", output).group(1))
    assert ended - since <= TIMEOUT_S + BOUND_S, output
    assert status == EXIT_HUNG, output
    line = _lines(output, 0)[0]
    assert _lines(output, 1) == [line], output
    call = r"all_reduce #(\d+) \(DDP bucket 0\)"
    found = re.fullmatch(
        rf"hang: rank 1 \(vm\) never entered {call}: it is at "
        rf"{re.escape(_line('backward.py', 'the spin'))} in <module> \(stack: [^)]+\); "
        rf"rank 0 \(vm\) waits in {call} at {re.escape(_line('backward.py', 'the backward'))}"
        r": it does not reach the collective the others wait in", line)
    assert found and found.group(1) == found.group(2), line
