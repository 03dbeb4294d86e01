"""The node's CMA decision (launcher/mpi/cma.py): the pure rule with faked evidence, the probe with
real processes, and the wrong-sum guarantee with ranks in separate user namespaces.

``unshare -Ur`` puts each rank in a user namespace of its own, as plain ``ch-run`` (without
--join) and rootless ``apptainer exec`` do; tests/test_host_launchers.py runs the same through
``ch-run`` itself.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.mpi import cma
from launcher.placement.env import detect_environment
from tests.fixtures.host_mpi import IMPI_ENV, OPENMPI_ROOT_ENV
from tests.fixtures.requirements import missing

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.prefix) / "bin" / "mpiexec"
NS = "user:[4026531837]"


def evidence(*reads: str, namespaces: tuple[str, ...] = ()) -> list[cma.Evidence]:
    return [cma.Evidence(r, namespaces[r] if namespaces else NS, read)
            for r, read in enumerate(reads)]


def test_on_when_every_rank_shares_the_namespace_and_read_its_peer():
    decision = cma.decide(evidence("", "", ""), 3)
    assert decision.on and "3 local ranks" in decision.reason


@pytest.mark.parametrize(("found", "size", "scope", "because"), [
    (evidence("", "", namespaces=(NS, "user:[4026532001]")), 2, None, "2 user namespaces"),
    (evidence("", ""), 3, None, "only 2 of 3 local ranks"),
    (evidence("", "EPERM"), 2, 1, "ptrace_scope=1"),
    (evidence("EPERM", "EPERM"), 2, 0, "seccomp"),
    (evidence("", "ENOSYS"), 2, None, "seccomp"),
    (evidence("wrong bytes", ""), 2, None, "other bytes"),
])
def test_off_with_the_reason(found, size, scope, because):
    decision = cma.decide(found, size, scope)
    assert not decision.on and because in decision.reason
    # what UCX's shared memory needs to know too (launcher.mpi.library)
    assert decision.one_namespace == ("namespaces" not in because)


def test_the_line_says_what_off_costs():
    env = detect_environment({}, hostname="n7")
    assert cma.Decision(True, "fine").line(env).endswith("(CMA) on n7: on: fine")
    off = cma.Decision(False, "blocked").line(env)
    assert "(CMA) on n7: off: blocked; cost: " in off and "0.46x" in off and "\n" not in off


def _probe(local_rank: int, size: int, root: str, timeout: float, results) -> None:
    env = detect_environment({"PMI_RANK": str(local_rank), "PMI_SIZE": str(size), "PMI_FD": "9",
                              "MPI_LOCALRANKID": str(local_rank),
                              "MPI_LOCALNRANKS": str(size)}, hostname="n1")
    results.put((local_rank, cma.probe(env, Path(root), timeout)))


def _run_probes(ranks: list[int], size: int, root: Path, timeout: float = 10.0) -> dict:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_probe, args=(r, size, str(root), timeout, results))
                 for r in ranks]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=3 * timeout + 10) for _ in processes)
    for process in processes:
        process.join()
    return found


def test_ranks_in_one_namespace_agree_on_and_leave_nothing_behind(tmp_path):
    decisions = _run_probes([0, 1, 2], 3, tmp_path)
    assert all(d.on for d in decisions.values()), decisions
    assert len(set(decisions.values())) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_never_comes_means_off_not_a_hang(tmp_path):
    decisions = _run_probes([0], 2, tmp_path, timeout=0.5)
    assert not decisions[0].on and "only 1 of 2 local ranks" in decisions[0].reason
    assert list(tmp_path.iterdir()) == []
    decisions = _run_probes([1], 2, tmp_path, timeout=0.5)  # and without local rank 0
    assert not decisions[1].on and "local rank 0 gave no decision" in decisions[1].reason
    assert list(tmp_path.iterdir()) == []


def test_reading_a_live_process_and_a_wrong_address():
    token = os.urandom(32)
    buffer = ctypes.create_string_buffer(token, len(token))
    address = ctypes.addressof(buffer)
    assert cma.read_peer(os.getpid(), address, token) == ""
    assert cma.read_peer(os.getpid(), address, bytes(32)) == "wrong bytes"
    assert cma.read_peer(os.getpid(), 8, token) == "EFAULT"


# -- the wrong-sum guarantee, with real MPI ------------------------------------------------------

#: each rank: the backend's group, then all_reduce at 1 MiB and 16 MiB, every element checked
SUMS = """
import os, torch, torch.distributed as dist
from launcher.placement.env import detect_environment
from launcher.core.errors import LaunchError, report_and_exit
from launcher.group.process_group import process_group
env = detect_environment()
try:
    with process_group(env, "mpi"):
        for words in (1 << 18, 1 << 22):
            tensor = torch.full((words,), float(env.rank + 1))
            dist.all_reduce(tensor)
            right = bool((tensor == env.world_size * (env.world_size + 1) / 2).all())
            print(f"sum rank={env.rank} words={words} {'right' if right else 'WRONG'} "
                  f"UCX_TLS={os.environ.get('UCX_TLS')}", flush=True)
except LaunchError as error:
    report_and_exit(error, env.rank)
"""


def _separate_namespaces_work() -> bool:
    return (shutil.which("unshare") is not None and
            subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode == 0)


def _run_in_separate_namespaces(extra: dict[str, str], mpiexec: Path = MPIEXEC,
                                timeout: float = 300) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MPIR_CVAR", "OMPI_"))}
    done = subprocess.run([str(mpiexec), "-n", "2", "unshare", "-Ur", sys.executable, "-c", SUMS],
                          env={**environ, **extra, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def user_namespaces() -> None:
    """Separate user namespaces per rank, as plain ch-run makes them (CI must have them)."""
    if not _separate_namespaces_work():
        missing("unshare -Ur (unprivileged user namespaces) is not available on this machine")


@pytest.mark.usefixtures("user_namespaces")
def test_separate_user_namespaces_turn_cma_off_and_sum_right():
    status, output = _run_in_separate_namespaces({})
    assert status == 0, output
    assert output.count("(CMA) on ") == 1 and "off: the 2 local ranks are in 2 user" in output
    assert output.count(" right UCX_TLS=^posix") == 4 and "WRONG" not in output, output
    # UCX's POSIX shared memory is opened through /proc, which fails across user namespaces
    assert "UCX  ERROR" not in output, output


@pytest.mark.usefixtures("user_namespaces")
def test_cma_forced_on_across_namespaces_is_a_clear_error_never_a_wrong_sum():
    """The user's MPIR_CVAR_CH4_CMA_ENABLE=1 wins over the probe; MPICH 5.0.2 then returns
    wrong sums, and the backend's transfer check must stop every rank before any is used."""
    status, output = _run_in_separate_namespaces({"MPIR_CVAR_CH4_CMA_ENABLE": "1"})
    assert "WRONG" not in output, output
    if status == 0:  # a kernel or MPI that copes: then every sum is right
        assert output.count(" right") == 4, output
        return
    assert "(CMA) on " not in output  # the user's setting: not probed
    for rank in (0, 1):
        assert output.count(f"[rank {rank}] error: MPI delivered wrong data") == 1, output
        assert f"[rank {rank}] HINT: " in output
    assert "Traceback" not in output and " right" not in output


@pytest.mark.usefixtures("user_namespaces")
def test_a_host_intel_mpi_bound_in_keeps_its_own_rules_and_sums_right(impi_prefix):
    """A host MPI keeps its own single-copy settings: Intel MPI copes with ranks in separate
    user namespaces by itself (a rootless Apptainer with Intel's library bound in)."""
    status, output = _run_in_separate_namespaces(
        {**IMPI_ENV, "LD_LIBRARY_PATH": str(impi_prefix / "lib")},
        impi_prefix / "bin" / "mpiexec.hydra")
    assert status == 0 and "(CMA) on " not in output, output  # not probed: not the bundled one
    assert output.count(" right UCX_TLS=None") == 4 and "WRONG" not in output, output


@pytest.mark.usefixtures("user_namespaces")
@pytest.mark.parametrize(("prefix", "decided"), [("openmpi4_prefix", True),
                                                 ("openmpi_prefix", False)])
def test_a_host_open_mpi_bound_in_sums_right_across_user_namespaces(request, prefix, decided):
    """Open MPI 4.1.8 warns that CMA is not available and falls back to a mechanism whose
    4 MiB all_reduce never completes: the launcher turns vader's single copy off ("none").
    Open MPI 5 copes by itself and is left alone."""
    prefix = request.getfixturevalue(prefix)
    status, output = _run_in_separate_namespaces(
        {**OPENMPI_ROOT_ENV, "LD_LIBRARY_PATH": str(prefix / "lib")},
        prefix / "bin" / "mpiexec", timeout=120)
    assert status == 0 and output.count(" right ") == 4 and "WRONG" not in output, output
    assert ("off: the 2 local ranks are in 2 user" in output) == decided, output
    assert "btl_vader_single_copy_mechanism" not in output  # Open MPI 4's warning


def test_the_job_key_is_the_launch_daemons_not_a_runtimes_between(tmp_path):
    """Ranks under one launcher daemon share a key even with a runtime process between it and
    them (apptainer's starter); another daemon, another key."""
    proxy = tmp_path / "hydra_pmi_proxy"  # the name is what counts: a copy of sh
    shutil.copy("/bin/sh", proxy)
    key = (f"{shlex.quote(sys.executable)} -c 'from launcher.mpi import cma; "
           "from launcher.placement.env import detect_environment; "
           "print(cma.job_key(detect_environment({})))'")
    # "; true": the shell must stay the parent instead of exec'ing its last command
    script = f"{key}; sh -c \"{key}; true\"; true"
    keys = [subprocess.run([str(proxy), "-c", script], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout.split() for _ in range(2)]
    assert len(set(keys[0])) == 1 and keys[0][0].startswith("single-"), keys
    assert keys[0][0] != keys[1][0]


@pytest.mark.mpi
def test_a_run_says_nothing_of_cma_when_on_and_the_check_says_it_either_way():
    """Every mpiexec run used to print the node's CMA line; now only an "off" (a cost to act
    on) is printed by every run, and launcher.check shows the decision whichever it is."""
    from tests.fixtures.mpi import run_mpi

    check = run_mpi(2, ["-m", "launcher.check", "--backend", "mpi"], timeout=120)
    assert check.returncode == 0, check.output
    [line] = [x for x in check.stderr.splitlines() if "(CMA) on " in x]
    if ": on: " in line:  # and whether torch's large buffers are in huge pages, which it copies
        assert sum(x.startswith("huge pages: ") for x in check.stderr.splitlines()) == 1
    plain = run_mpi(2, ["-c", "import launcher\nwith launcher.distributed('mpi') as job:\n"
                        "    job.print('up')"], timeout=120)
    assert plain.returncode == 0 and plain.stdout == "up\n", plain.output
    printed = [x for x in plain.stderr.splitlines() if "(CMA) on " in x]
    assert printed == ([] if ": on: " in line else [line]), plain.stderr
