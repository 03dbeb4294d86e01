"""The hang directory's files, for real (2-3 gloo ranks started by hand): a look's files are
read back without an earlier attempt's, and a file system that is slow to write them does not
make a live rank one that "does not answer"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.core.errors import EXIT_HUNG
from launcher.faults.hang_diagnosis import WAITING, Where
from tests.fixtures.by_hand import run_by_hand, write_script
from tests.fixtures.mpi import REPO_ROOT, clean_environ

SCRIPTS = Path(__file__).parent / "hang_scripts"


def _earlier_attempt(run_dir: Path, ranks: int) -> None:
    """What an earlier attempt of RANKS ranks left in ``run_dir/hang``: its line and its rank
    files (as a job before looks had ids wrote them)."""
    hang = run_dir / "hang"
    hang.mkdir(parents=True)
    (hang / "diagnosis.txt").write_text("hang: an earlier attempt's line\n")
    for rank in range(ranks):
        where = Where(rank, "old-node", WAITING, {"op": "all_reduce", "seq": 9, "where": "old.py:1",
                                                  "state": "running"}, at="old.py:1")
        (hang / f"rank-{rank}.json").write_text(json.dumps({"where": where.to_dict(),
                                                            "calls": []}))


def test_the_post_mortem_is_the_last_looks_not_an_earlier_attempts(tmp_path):
    """4 ranks hung in an earlier attempt; resumed into the same run directory with 2, whose
    rank 1 waits on a lock of its own: ``python -m launcher.hang`` prints the new line and
    ranks 0-1 only."""
    _earlier_attempt(tmp_path, 4)
    ranks = run_by_hand([str(SCRIPTS / "hung.py"), "lock", "gloo", str(tmp_path)], 2)
    assert [status for status, _ in ranks] == [EXIT_HUNG] * 2, ranks
    line = next(text.split("] ", 1)[1] for text in ranks[0][1].splitlines()
                if text.startswith("[rank 0] hang: "))
    again = subprocess.run([sys.executable, "-m", "launcher.hang", str(tmp_path)],
                           capture_output=True, text=True, env=clean_environ(), cwd=REPO_ROOT)
    rows = again.stdout.splitlines()
    assert rows[0] == line and rows[1] == "", again.stdout + again.stderr
    assert [row.split()[0] for row in rows[3:]] == ["0", "1"], again.stdout
    assert "old-node" not in again.stdout, again.stdout


#: rank 0 writes a checkpoint inside an agreement for longer than the timeout (busy, not
#: hung) while rank 2's hang files take 6 s to write (a loaded shared file system)
SLOW_FILES = """
import sys, time
import torch, torch.distributed as dist
import launcher
from launcher.faults import hang_files, hang_watch
with launcher.distributed(backend="gloo", timeout_s=3, status_dir=sys.argv[1]) as job:
    if job.rank == 2:
        write = hang_files.write
        def slow(*args):
            time.sleep(hang_watch.ANSWER_S + 1)
            write(*args)
        hang_files.write = slow
    dist.all_reduce(torch.ones(1))
    with job.agree():
        if job.rank == 0:
            time.sleep(18)  # the timeout, rank 0's look, and rank 2's answer missed, and more
    dist.all_reduce(torch.ones(1))
    job.print("done", every_rank=True)
"""


def test_a_rank_slow_to_write_its_files_still_answers(tmp_path):
    run_dir = tmp_path / "run"
    ranks = run_by_hand([str(write_script(tmp_path, SLOW_FILES)), str(run_dir)], 3)
    for rank, (status, output) in enumerate(ranks):
        assert status == 0 and f"[rank {rank}] done" in output, output
    # the files came, after the answer
    assert json.loads((run_dir / "hang" / "rank-2.json").read_text())["where"]["rank"] == 2
