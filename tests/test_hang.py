"""Ranks alive but not meeting, for real: under mpiexec, torchrun and srun, gloo and the mpi
backend, 2 and 4 ranks, in a script of the user's own and in ``launcher.train``.

Each mpiexec job runs tests/hang_scripts/hung.py with ``timeout_s=5``: rank 1 skips an
all_reduce, spins in a Python loop, waits on a lock of its own, or stops (SIGSTOP). Every rank
that can must print the one line naming rank 1, the collective and the lines, within the
timeout + 10 s of rank 0 starting to wait, exit 4 (3 for the stopped rank: its node is the
suspect), leave the post-mortem that ``python -m launcher.hang`` reads back to the same line,
and nothing behind. Under torchrun and srun, the most telling cases only: the same script's
skip (gloo) and spin (mpi), and ``launcher.train`` whose rank 1 spins in its model's forward
(``tests.faulty_model``) while rank 0 waits on DDP's gradient all_reduce. Inside ``ch-run``
from the SIF under mpiexec: the skip (mpi).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.core.errors import EXIT_HUNG, EXIT_PEER_LOST
from launcher.faults.hang_watch import ACK_S
from launcher.placement.ports import free_port
from tests.fixtures.gpu import needs_gpu
from tests.fixtures.left_behind import LeftBehind
from tests.fixtures.mpi import REPO_ROOT, clean_environ, mpiexec_path

# the ranks' exchanges travel on the side channel of issue 35, merged apart from this branch

SCRIPTS = Path(__file__).parent / "hang_scripts"
TIMEOUT_S = 5
#: what the issue allows after the timeout
BOUND_S = 10
#: the node every rank runs on (the one Slurm node of ``slurm_cluster`` is this host)
NODE = socket.gethostname().split(".")[0]

#: runs ``argv`` (a python command line) as a job of N ranks, with variables added to its
#: environment: the finished process
Launch = Callable[[list[str], dict[str, str]], subprocess.CompletedProcess]


def _line(script: str, marker: str, folder: str = "tests/hang_scripts") -> str:
    path = REPO_ROOT / folder / script
    number = next(n for n, line in enumerate(path.read_text().splitlines(), 1)
                  if f"# {marker}" in line)
    return f"{folder}/{script}:{number}"


def _local(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env=clean_environ(env))


def mpiexec(ranks: int) -> Launch:
    return lambda argv, env: _local([str(mpiexec_path()), "-n", str(ranks), *argv], env)


def one_gpu_as_hosts(ranks: int) -> Launch:
    """RANKS processes started by hand (env://), each its own host to NCCL (NCCL_HOSTID) and to
    the launcher (local rank 0 of 1): NCCL refuses two ranks of one host on one GPU, and a lent
    machine has one. Rank 0's status is the job's; once it ended, a stopped rank is killed, as
    a launcher would (the others end by themselves, within ACK_S)."""
    def launch(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        port = str(free_port())
        processes = [subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
            env=clean_environ({**env, "RANK": str(rank), "WORLD_SIZE": str(ranks),
                               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                               "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": str(ranks),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                               "NCCL_HOSTID": f"host-{rank}", "NCCL_SOCKET_IFNAME": "lo"}))
            for rank in range(ranks)]
        outputs = [processes[0].communicate(timeout=120)]
        for process in processes[1:]:
            if Path(f"/proc/{process.pid}/stat").read_text().split(") ")[1][0] == "T":
                process.kill()
            outputs.append(process.communicate(timeout=2 * ACK_S))
        return subprocess.CompletedProcess(argv, processes[0].returncode,
                                           "".join(out for out, _ in outputs),
                                           "".join(err for _, err in outputs))
    return launch


def torchrun(ranks: int) -> Launch:
    return lambda argv, env: _local([argv[0], "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node", str(ranks), *argv[1:]], env)


def srun(cluster, ranks: int) -> Launch:
    return lambda argv, env: cluster.srun(["-n", str(ranks), "--mpi=pmi2", *argv], timeout=120,
                                          cwd=REPO_ROOT,
                                          env={**env, "PYTHONPATH": str(REPO_ROOT)})


def _run(launch: Launch, args: list[str], env: dict[str, str] | None = None
         ) -> tuple[int, str, float]:
    """Run ``python ARGS`` under LAUNCH; its status, output and when it ended
    (time.monotonic)."""
    left = LeftBehind()
    process = launch([sys.executable, *args], {**(env or {}), "DDP_TEST_MARK": left.mark})
    ended = time.monotonic()
    left.check()
    return process.returncode, process.stdout + process.stderr, ended


def _lines(output: str, rank: int) -> list[str]:
    """Rank's ``hang:`` lines, without the ``[node:rank]`` label other ranks' lines carry in
    the job log (launcher.core.rank_output)."""
    lines = (re.sub(r"^\[[^\]\s]+:\d+\] ", "", line) for line in output.splitlines())
    return [line.split("] ", 1)[1] for line in lines if line.startswith(f"[rank {rank}] hang:")]


def _on_every_rank(output: str, ranks: int) -> str:
    """The line, printed once by every rank but one that left the job (rank 1, its barrier met
    by MPI), which prints nothing more."""
    line = _lines(output, 0)[0]
    for rank in range(ranks):
        left = rank == 1 and f"rank 1 ({NODE}) ended at " in line
        assert _lines(output, rank) == ([] if left else [line]), output
    return line


def _names_the_skip(line: str) -> None:
    """Rank 1 skipped the 3rd all_reduce of hung.py: its barrier met the others' 4th."""
    barrier = _line("hung.py", "the barrier")
    assert f"rank 1 ({NODE}) is in barrier #4 at {barrier}" in line \
        or f"rank 1 ({NODE}) called barrier #4 at {barrier}" in line, line
    assert "all_reduce #4 at " + _line("hung.py", "the all_reduce") in line, line
    assert "in a different order" in line, line


def _never_entered(line: str, seq: int, at: str, waited: str) -> None:
    """Rank 1 is at AT while rank 0 (and any other) waits in all_reduce #SEQ at WAITED."""
    assert line.startswith(f"hang: rank 1 ({NODE}) never entered all_reduce #{seq}: it is at "
                           f"{at}"), line
    assert f"wait in all_reduce #{seq} at {waited}" in line or \
        f"waits in all_reduce #{seq} at {waited}" in line, line


def _read_back(run_dir: Path, line: str, ranks: int) -> None:
    """The exit status file and ``python -m launcher.hang``: the same line, and the table."""
    assert (run_dir / "exit-status").read_text() == f"{EXIT_HUNG} {line}\n"
    again = subprocess.run([sys.executable, "-m", "launcher.hang", str(run_dir)],
                           capture_output=True, text=True, env=clean_environ(), cwd=REPO_ROOT)
    assert again.stdout.splitlines()[0] == line, again.stdout + again.stderr
    assert len(again.stdout.splitlines()) == 2 + 1 + ranks  # the line, a gap, the table


def _since(output: str, what: str = "waiting") -> float:
    return float(re.search(rf"{what} since (\S+)", output).group(1))


CASES = [  # how, backend, ranks
    ("skip", "gloo", 4), ("skip", "mpi", 4), ("spin", "gloo", 2), ("spin", "mpi", 2),
    ("lock", "gloo", 2), ("lock", "mpi", 2), ("stop", "gloo", 2), ("stop", "mpi", 2),
    ("async", "gloo", 2),
]


@pytest.mark.parametrize(("how", "backend", "ranks"), CASES)
def test_the_line_names_who_is_where(how, backend, ranks, tmp_path):
    _names_who_is_where(mpiexec(ranks), how, backend, ranks, tmp_path)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("how", ["skip", "spin", "lock", "stop", "async"])
def test_nccl_the_line_names_who_is_where(how, tmp_path):
    """nccl, whose calls return at once and finish on the GPU (launcher.faults.gpu_waits): 2
    ranks on one GPU, each its own host to NCCL and to the launcher."""
    _names_who_is_where(one_gpu_as_hosts(2), how, "nccl", 2, tmp_path)


def _names_who_is_where(launch: Launch, how: str, backend: str, ranks: int,
                        tmp_path: Path) -> None:
    status, output, ended = _run(launch, [str(SCRIPTS / "hung.py"), how, backend,
                                          str(tmp_path)])
    assert ended - _since(output) <= TIMEOUT_S + BOUND_S, output
    waited = _line("hung.py", "the all_reduce")
    if how == "stop":
        # with nccl, the oldest kernel that cannot finish: the stopped rank's NCCL proxy thread
        # (the network transport) may have stopped before it served all_reduce #1 or #2
        stuck = r"#\d" if backend == "nccl" else "#3"
        assert status == EXIT_PEER_LOST, output
        assert re.search(rf"\[rank 0\] error: .*all_reduce {stuck} at {waited}.*"
                         r"no heartbeat for 5 s from rank 1 \(", output), output
        return
    assert status == EXIT_HUNG, output
    line = _on_every_rank(output, ranks)
    if how == "skip":
        _names_the_skip(line)
    else:
        _never_entered(line, 3, _line("hung.py", "the spin" if how == "async" else "the " + how),
                       waited)
    _read_back(tmp_path, line, ranks)


#: torchrun's agent ends with 1 whatever its ranks' statuses; it prints each one's
TORCHRUN_EXIT = re.compile(rf"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: {EXIT_HUNG} ")
#: srun's status is the highest of its tasks', 137 where MPI_Abort had the others killed; it
#: prints each one's (the batch script takes the run directory's exit-status)
SRUN_EXIT = re.compile(rf"srun: error: \S+: task 0: Exited with exit code {EXIT_HUNG}$", re.M)


def test_under_torchrun_rank_1_skips_an_all_reduce(tmp_path):
    status, output, ended = _run(torchrun(2), [str(SCRIPTS / "hung.py"), "skip", "gloo",
                                               str(tmp_path)])
    assert ended - _since(output) <= TIMEOUT_S + BOUND_S, output
    assert status == 1 and TORCHRUN_EXIT.search(output), output
    line = _on_every_rank(output, 2)
    _names_the_skip(line)
    _read_back(tmp_path, line, 2)


@pytest.mark.runtime
@pytest.mark.mpi
def test_inside_ch_run_from_the_sif_rank_1_skips_an_all_reduce(sif_root, tmp_path):
    """Hydra's mpiexec on the host, each rank in ``ch-run`` from the SIF's root (the image's
    MPICH and launcher, the compiled mpi backend: tests/test_sif.py checks it is the one
    chosen there): the script and the run directory in the
    bound scratch directory, so the line names the same ``tests/hang_scripts`` lines."""
    from tests.test_host_launchers import SCRATCH, _user_env, ch_run

    shutil.copytree(SCRIPTS, tmp_path / "tests" / "hang_scripts")
    container = ch_run(sif_root, tmp_path)
    container.insert(1, f"--cd={SCRATCH}")

    def in_sif(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return _local([str(mpiexec_path()), "-n", "2", *container, "python", *argv[1:]],
                      {**env, **_user_env()})

    status, output, ended = _run(in_sif, ["tests/hang_scripts/hung.py", "skip", "mpi",
                                          f"{SCRATCH}/run"])
    assert ended - _since(output) <= TIMEOUT_S + BOUND_S, output
    assert status == EXIT_HUNG, output
    line = _on_every_rank(output, 2)
    _names_the_skip(line)
    _read_back(tmp_path / "run", line, 2)


def _train_spinning(launch: Launch, backend: str, tmp_path: Path) -> tuple[int, str]:
    """launcher.train, 2 ranks, rank 1 spinning in its 3rd forward: the line names it, where
    rank 0 waits (the gradients' all_reduce: DDP issued it, and waits for it in C++)."""
    run_dir = tmp_path / "run"
    (tmp_path / "data").mkdir()
    status, output, ended = _run(launch, [
        "-m", "launcher.train", "--model", "tests.faulty_model:factory", "--backend", backend,
        "--run-dir", str(run_dir), "--data-dir", str(tmp_path / "data"), "--epochs", "1",
        "--global-batch-size", "64", "--threads", "1", "--timeout-s", str(TIMEOUT_S)],
        {"FAULT_AT": "spin:3", "FAULT_RANK": "1"})
    assert ended - _since(output, "spinning") <= TIMEOUT_S + BOUND_S, output
    line = _on_every_rank(output, 2)
    # the call as the recorder labels it (DDP's backward: "DDP gradients"), from a line of
    # launcher.train's
    call = r"all_reduce #\d+(?: \([^)]*\))?"
    spin, node = re.escape(_line("faulty_model.py", "the spin", "tests")), re.escape(NODE)
    found = re.match(rf"hang: rank 1 \({node}\) never entered ({call}): it is at {spin} in "
                     rf"forward .*; rank 0 \({node}\) waits in ({call}) at launcher/training/",
                     line)
    assert found and found.group(1) == found.group(2), line
    _read_back(run_dir, line, 2)
    return status, output


def test_under_torchrun_launcher_train_names_a_spinning_rank(tmp_path):
    status, output = _train_spinning(torchrun(2), "gloo", tmp_path)
    assert status == 1 and TORCHRUN_EXIT.search(output), output


@pytest.mark.slurm
def test_under_srun_rank_1_spins(slurm_cluster, tmp_path):
    status, output, ended = _run(srun(slurm_cluster, 2), [str(SCRIPTS / "hung.py"), "spin",
                                                          "mpi", str(tmp_path)])
    assert ended - _since(output) <= TIMEOUT_S + BOUND_S, output
    assert status != 0 and SRUN_EXIT.search(output), output
    line = _on_every_rank(output, 2)
    _never_entered(line, 3, _line("hung.py", "the spin"), _line("hung.py", "the all_reduce"))
    _read_back(tmp_path, line, 2)


@pytest.mark.slurm
def test_under_srun_launcher_train_names_a_spinning_rank(slurm_cluster, tmp_path):
    status, output = _train_spinning(srun(slurm_cluster, 2), "mpi", tmp_path)
    assert status != 0 and SRUN_EXIT.search(output), output


def test_acceptance_rank_2_skips_the_5th_all_reduce(tmp_path):
    """Issue 36's acceptance: every rank ends within 30 s, one line naming rank 2,
    all_reduce #5 and both source lines; python -m launcher.hang prints the same."""
    started = time.monotonic()
    status, output, ended = _run(mpiexec(4), [str(SCRIPTS / "acceptance.py"),
                                               str(tmp_path)])
    assert status == EXIT_HUNG, output
    line = _lines(output, 0)[0]
    # rank 2 left the job before: the others print it
    assert [_lines(output, rank) for rank in (0, 1, 3)] == [[line]] * 3, output
    assert f"rank 2 ({NODE})" in line and "all_reduce #5" in line, line
    assert _line("acceptance.py", "the gradients") in line, line
    assert _line("acceptance.py", "the loss") in line, line
    assert ended - started <= 30 + 10, output  # 30 s of the job, up to 10 s to start it
    again = subprocess.run([sys.executable, "-m", "launcher.hang", str(tmp_path)],
                           capture_output=True, text=True, env=clean_environ(), cwd=REPO_ROOT)
    assert again.stdout.splitlines()[0] == line


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_rank_that_never_reaches_backward(backend, tmp_path):
    """DDP's gradient all_reduce goes from C++ into the group: every DDP records its
    backward (the script builds its own), so the line names it and where the others called
    backward."""
    status, output, ended = _run(mpiexec(2), [str(SCRIPTS / "backward.py"), backend,
                                              str(tmp_path)])
    assert ended - _since(output) <= TIMEOUT_S + BOUND_S, output
    assert status == EXIT_HUNG, output
    line = _lines(output, 0)[0]
    assert _lines(output, 1) == [line], output
    call = r"all_reduce #(\d+) \(DDP gradients\)"
    found = re.fullmatch(
        rf"hang: rank 1 \(vm\) never entered {call}: it is at "
        rf"{re.escape(_line('backward.py', 'the spin'))} in <module> \(stack: [^)]+\); "
        rf"rank 0 \(vm\) waits in {call} at {re.escape(_line('backward.py', 'the backward'))}"
        r": it does not reach the collective the others wait in", line)
    assert found and found.group(1) == found.group(2), line
