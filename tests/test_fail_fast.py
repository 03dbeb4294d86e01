"""One rank raises, every rank ends within seconds, the cause named: the fault matrix.

{mpiexec, srun --mpi=pmi2, torchrun} x {gloo, mpi} x {model build, step 5, evaluation,
checkpoint write}, with ``tests.faulty_model`` raising on one rank. torchrun offers no MPI, so
torchrun x mpi is refused before anything starts (``test_check``'s
``test_mpi_under_torchrun_stops_every_rank_at_once_with_the_cause``) and is not in the matrix.

Each rank runs inside a shell that prints its exit status and the time, so the test sees every
rank's status, not only the launcher's. Where MPI runs (under mpiexec always, since the
rendezvous goes through MPI; under srun with the mpi backend) the failing rank calls MPI_Abort
and the launcher kills every process, shells included, the way MPI jobs end: there the
launcher's own exit status and end are what can be seen. The launcher ends after its last rank,
so its end, measured from the fault, bounds every rank's in every cell; where each rank could
record its own end, each is checked too, and then no rank may be missing.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher.core.errors import EXIT_RANK_FAILED, EXIT_USER_ERROR
from launcher.faults.failfast import ACK_WAIT_S
from tests.fixtures.by_hand import run_by_hand, write_script
from tests.fixtures.gpu import nccl_ranks, needs_gpu
from tests.fixtures.host_mpi import OPENMPI_ROOT_ENV
from tests.fixtures.left_behind import LeftBehind, hydra_held, hydra_held_code, processes_marked
from tests.fixtures.mpi import REPO_ROOT, clean_environ, mpiexec_path
from tests.fixtures.rank_exits import FAILURE_ENDS_WITHIN_S, RECORD, rank_exits
from tests.fixtures.scheduling import uses

#: a collective waits this long for a peer: a run that relied on it would fail the test
TIMEOUT_S = 120


@dataclass(frozen=True)
class Fault:
    at: str
    rank: int
    kind: str
    flags: tuple[str, ...] = ("--checkpoint-every", "0")


FAULTS = {
    "model-build": Fault("build", 1, "RuntimeError"),
    "step-5": Fault("step:5", 1, "ValueError"),
    "evaluation": Fault("eval", 1, "ValueError"),
    # rank 0 writes checkpoints
    "checkpoint-write": Fault("checkpoint", 0, "RuntimeError", ("--checkpoint-every", "3")),
}


def _train_args(run_dir: Path, data_dir: Path, backend: str, fault: Fault) -> list[str]:
    return ["-m", "launcher.train", "--model", "tests.faulty_model:factory", "--backend",
            backend, "--run-dir", str(run_dir), "--data-dir", str(data_dir), "--epochs", "1",
            "--global-batch-size", "64", "--threads", "1", "--timeout-s", str(TIMEOUT_S),
            *fault.flags]


def _fault_env(fault: Fault) -> dict[str, str]:
    """The fault to raise, and a mark of its own in every rank's environment: the processes of
    this job, told apart from those of tests running beside it (``_no_rank_left``)."""
    return {"FAULT_AT": fault.at, "FAULT_RANK": str(fault.rank),
            "DDP_TEST_MARK": uuid.uuid4().hex}


def _mpiexec(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(mpiexec_path()), "-n", "2", "sh", "-c", RECORD, "sh",
                           sys.executable, *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S + 60, env=clean_environ(env), cwd=REPO_ROOT)


def _torchrun(args: list[str], env: dict[str, str], ranks: int = 2
              ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(ranks), "--no-python", "sh", "-c", RECORD, "sh",
                           sys.executable, *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S + 60, env=clean_environ(env), cwd=REPO_ROOT)


def _launched(run) -> tuple[subprocess.CompletedProcess, float]:
    """``run()``'s result and the wall-clock moment the launcher had ended (``time.time``,
    the clock ``tests.faulty_model`` stamps the fault with)."""
    result = run()
    return result, time.time()


def _check(result: subprocess.CompletedProcess, launcher_ended: float, fault: Fault,
           run_dir: Path, every_rank_recorded: bool, mpich_runs: bool = False) -> None:
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    stderr = result.stderr
    injected = re.search(r"fault injected at ([\d.]+)", stderr)
    assert injected, output
    fault_at = float(injected.group(1))
    assert launcher_ended - fault_at < FAILURE_ENDS_WITHIN_S, \
        f"the launcher ended {launcher_ended - fault_at:.1f} s after the fault\n{output}"
    exits = rank_exits(stderr)
    if every_rank_recorded:
        assert set(exits) == {0, 1}, output
    for rank, (status, ended) in exits.items():
        assert status == EXIT_RANK_FAILED, f"rank {rank} exited {status}\n{output}"
        assert ended - fault_at < FAILURE_ENDS_WITHIN_S, output
    failing, other = fault.rank, 1 - fault.rank
    # the failing rank: its traceback, once, down to the user's frame
    assert stderr.count(f"[rank {failing}] Traceback") == 1, output
    assert f"[rank {failing}] {fault.kind}: injected fault" in stderr, output
    assert 'tests/faulty_model.py", line' in stderr, output
    # every other rank: one line naming the rank, its host and the exception
    line = re.search(rf"\[rank {other}\] error: rank {failing} on (\S+) failed with "
                     rf"{fault.kind}: injected fault", stderr)
    assert line, output
    assert f"[rank {other}] Traceback" not in stderr, output
    assert "frame #" not in stderr and "Exception raised from" not in stderr, output
    # nothing of the job left in /dev/shm, whether MPI_Abort or a kill ended it
    mapped = re.search(r"fault rank maps /dev/shm: (.*)", stderr).group(1).split()
    if mpich_runs:
        assert any("/mpich_shm_" in path for path in mapped), output
    assert not [path for path in mapped if os.path.exists(path)], output
    # what the batch script reads (launcher.faults.exit_status)
    written = (run_dir / "exit-status").read_text()
    assert written == f"{EXIT_RANK_FAILED} a rank failed: the job's log names it\n", output
    # no half-written checkpoint, not even a temporary file
    checkpoints = run_dir / "checkpoints"
    assert not list(checkpoints.glob("*")) if checkpoints.exists() else True, output


LAUNCHERS = [
    pytest.param("mpiexec", "gloo", marks=pytest.mark.mpi),
    pytest.param("mpiexec", "mpi", marks=pytest.mark.mpi),
    pytest.param("srun", "gloo", marks=[pytest.mark.slurm, uses("slurm_cluster")]),
    pytest.param("srun", "mpi", marks=[pytest.mark.slurm, uses("slurm_cluster")]),
    pytest.param("torchrun", "gloo"),
]


@pytest.mark.parametrize("where", list(FAULTS))
@pytest.mark.parametrize("launcher, backend", LAUNCHERS)
def test_one_rank_raises_every_rank_ends_naming_it(request, tmp_path, data_dir, launcher,
                                                   backend, where):
    fault = FAULTS[where]
    run_dir = tmp_path / "run"
    args = _train_args(run_dir, data_dir, backend, fault)
    env = _fault_env(fault)
    started = time.monotonic()
    if launcher == "mpiexec":
        result, ended = _launched(lambda: _mpiexec(args, env))
    elif launcher == "torchrun":
        result, ended = _launched(lambda: _torchrun(args, env))
    else:
        slurm = request.getfixturevalue("slurm_cluster")
        result, ended = _launched(lambda: slurm.srun(
            ["-n", "2", "--mpi=pmi2", "sh", "-c", RECORD, "sh", sys.executable, *args],
            timeout=TIMEOUT_S + 60, cwd=REPO_ROOT, env=env))
    assert time.monotonic() - started < TIMEOUT_S, "a rank waited for the collective timeout"
    if launcher == "mpiexec":
        assert result.returncode == EXIT_RANK_FAILED, result.stderr
    else:
        assert result.returncode != 0
    if launcher == "torchrun":  # the agent's summary shows the cause, not "error_file: <N/A>"
        root = result.stderr.partition("Root Cause (first observed failure):")[2]
        assert f"{fault.kind}: injected fault" in root and "<N/A>" not in root, result.stderr
    mpi_runs = launcher == "mpiexec" or backend == "mpi"
    _check(result, ended, fault, run_dir, not mpi_runs, mpich_runs=backend == "mpi")
    _no_rank_left(env)


def _no_rank_left(env: dict[str, str], within_s: float = 10) -> None:
    """No rank process of the job started with ENV is left (killed ones may take a moment to
    be reaped)."""
    deadline = time.monotonic() + within_s
    while (left := processes_marked(env["DDP_TEST_MARK"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"ranks still running: {left}"


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_open_mpi_mpirun_aborts_the_world_naming_the_cause(tmp_path, data_dir, openmpi_prefix,
                                                           backend):
    """Open MPI's mpirun (PMIx), the host's MPI on LD_LIBRARY_PATH: the same ending."""
    fault = FAULTS["step-5"]
    env = {**_fault_env(fault), **OPENMPI_ROOT_ENV,
           "LD_LIBRARY_PATH": str(openmpi_prefix / "lib")}
    mpirun = [str(openmpi_prefix / "bin" / "mpirun"), "-n", "2", "--oversubscribe"]
    result, ended = _launched(lambda: subprocess.run(
        [*mpirun, sys.executable, *_train_args(tmp_path / "run", data_dir, backend, fault)],
        capture_output=True, text=True, timeout=TIMEOUT_S + 60, env=clean_environ(env),
        cwd=REPO_ROOT))
    assert result.returncode == EXIT_RANK_FAILED, result.stderr
    _check(result, ended, fault, tmp_path / "run", every_rank_recorded=False)
    _no_rank_left(env)


@pytest.mark.mpi
def test_an_aborted_job_leaves_no_topology_file_of_hydras(tmp_path):
    """Hydra's proxy writes the node's topology to /tmp/hydra_hwloc_xmlfile_* and removes it
    as it ends, but MPI_Abort kills it first: every failed job left one file per node, until
    the ranks removed it before their abort (launcher.faults.exits.end_process)."""
    code = ("from mpi4py import MPI; from launcher.faults import exits; "
            "from launcher.mpi import segments; " + hydra_held_code(tmp_path)
            + "segments.unlink_mapped(MPI.COMM_WORLD); exits.end_process(4)")
    left = LeftBehind()
    result = subprocess.run([str(mpiexec_path()), "-n", "2", sys.executable, "-c", code],
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                            env=clean_environ({"DDP_TEST_MARK": left.mark}))
    left.check()
    assert result.returncode == 4, result.stderr
    held = hydra_held(tmp_path)
    assert len(held) == 1, result.stdout
    assert not any(os.path.exists(path) for path in held)


def test_a_taken_rendezvous_port_stops_every_rank_at_once(tmp_path):
    """Another program listens on the rendezvous port: rank 0 cannot bind it, rank 1 would
    talk to that program; both stop within seconds, each naming the cause. Seconds after
    starting up: a process that only imports what a rank imports before its rendezvous (torch
    with it), started beside them, says how long that takes on this machine now (on a loaded
    2-core one, up to 15 s; the CI of a slow day took 23 s in all, the import of the training
    module alone, without torch, 2 s)."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)  # accepts, never answers: torch's own client would hang for good
        port = squatter.getsockname()[1]
        ranks = []
        started = time.monotonic()
        for rank in (0, 1):
            env = clean_environ({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(port)})
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "launcher.train", "--backend", "gloo", "--run-dir",
                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env, cwd=REPO_ROOT))
        # what starting a rank alone costs now, beside them: the bound is for what follows
        startup = subprocess.run([sys.executable, "-c", "import launcher.training.train, "
                                  "launcher.group.process_group"],
                                 env=clean_environ(), cwd=REPO_ROOT, timeout=TIMEOUT_S)
        started_alone = time.monotonic() - started
        outputs = [process.communicate(timeout=TIMEOUT_S) for process in ranks]
        elapsed = time.monotonic() - started
    assert startup.returncode == 0
    for rank, (process, (_, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == EXIT_USER_ERROR, stderr
        assert f"[rank {rank}] HINT: set MASTER_PORT to a port free on 127.0.0.1" in stderr
        assert "frame #" not in stderr and "Traceback" not in stderr, stderr
    assert "address already in use" in outputs[0][1], outputs[0][1]
    assert "answers, but not as rank 0's rendezvous store" in outputs[1][1], outputs[1][1]
    assert elapsed - started_alone < FAILURE_ENDS_WITHIN_S, (elapsed, started_alone)


def test_a_single_process_ends_with_the_same_status_and_its_traceback(tmp_path, data_dir):
    fault = Fault("step:5", 0, "ValueError")
    result = subprocess.run([sys.executable, *_train_args(tmp_path / "run", data_dir, "gloo",
                                                          fault)],
                            capture_output=True, text=True, timeout=TIMEOUT_S,
                            env=clean_environ(_fault_env(fault)), cwd=REPO_ROOT)
    assert result.returncode == EXIT_RANK_FAILED, result.stderr
    assert result.stderr.count("[rank 0] Traceback") == 1, result.stderr
    assert "[rank 0] ValueError: injected fault at step 5" in result.stderr, result.stderr


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("where", ["step-5", "evaluation"])
def test_nccl_one_rank_raises_every_rank_ends(tmp_path, data_dir, where):
    """The same ending with NCCL, one rank per GPU (two where two GPUs are visible)."""
    ranks = nccl_ranks()
    fault = FAULTS[where] if ranks == 2 else Fault(FAULTS[where].at, 0, FAULTS[where].kind)
    run_dir = tmp_path / "run"
    env = _fault_env(fault)
    result, ended = _launched(lambda: _torchrun(_train_args(run_dir, data_dir, "nccl", fault),
                                                env, ranks))
    if ranks == 2:
        _check(result, ended, fault, run_dir, every_rank_recorded=True)
    else:
        assert rank_exits(result.stderr)[0][0] == EXIT_RANK_FAILED, result.stderr
        assert f"[rank 0] {fault.kind}: injected fault" in result.stderr, result.stderr
    _no_rank_left(env)


#: every rank raises at the same step; each counts the acks it sends while it is failing, and
#: says when it ends after it began to fail
EVERY_RANK_RAISES = """
import math, os, sys, time
import torch, torch.distributed as dist
from launcher.faults import failfast, side_channel
acks, failing = [], []
send, fail, end = side_channel.SideChannel.send, failfast.Watchdog.fail, os._exit
def counted(self, dest, kind, payload=b""):
    if kind == failfast.ACK_KIND and failing:
        acks.append(dest)
    return send(self, dest, kind, payload)
def failing_now(self, exc):
    failing.append(time.monotonic())
    return fail(self, exc)
def ending(status):
    after = time.monotonic() - failing[0] if failing else math.nan
    print(f"[rank {os.environ['RANK']}] acks sent while failing: {len(acks)}, ended "
          f"{after:.2f} s after failing", file=sys.stderr, flush=True)
    end(status)
side_channel.SideChannel.send, failfast.Watchdog.fail, os._exit = counted, failing_now, ending
import launcher
with launcher.distributed(backend="gloo", timeout_s=30) as job:
    dist.all_reduce(torch.ones(1))
    raise ValueError("shape mismatch in the model (every rank)")
"""


def test_when_every_rank_fails_none_acknowledges_and_none_waits(tmp_path):
    """The commonest bug, on every rank at once: each rank prints its own traceback and ends,
    sending no ack to the others (N - 1 each: N^2 connections at scale), nor waiting for one
    (ACK_WAIT_S)."""
    ranks = run_by_hand([str(write_script(tmp_path, EVERY_RANK_RAISES))], 4)
    for rank, (status, output) in enumerate(ranks):
        assert status == EXIT_RANK_FAILED, output
        ended = re.search(rf"\[rank {rank}\] acks sent while failing: (\d+), ended (\S+) s",
                          output)
        assert ended and ended.group(1) == "0", output
        assert float(ended.group(2)) < ACK_WAIT_S, output
