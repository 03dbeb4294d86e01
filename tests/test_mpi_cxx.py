"""The compiled mpi backend's build and its fallback to the Python one (launcher/mpi/cxx.py).

What the backend computes is tested with the Python one's tests (tests/test_mpi_backend.py,
both implementations); training hashes in tests/test_train.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from mpi4py import MPI

from launcher.core.errors import LaunchError
from launcher.mpi import cxx as mpi_cxx
from launcher.mpi import ucx_address, waiting
from launcher.placement.env import detect_environment
from tests.fixtures.mpi import REPO_ROOT, clean_environ, run_mpi

HASH = re.compile(r"param-sha256 rank=(\d+) ([0-9a-f]{64})")
needs_build = pytest.mark.skipif(not mpi_cxx.built_path().exists(),
                                 reason="the compiled mpi backend is not built "
                                        "(python -m launcher.mpi.cxx)")


def test_both_implementations_poll_yield_and_sleep_alike():
    """The Python wait (launcher/mpi/waiting.py) copies the compiled one's constants: a change
    to either without the other would make the two backends load a shared node differently."""
    source = "".join(path.read_text() for path in mpi_cxx.SOURCES)

    def constant(name: str) -> str:
        return re.search(rf"constexpr (?:int|auto) {name} = (.+);", source).group(1)

    assert constant("kPollsBeforeYield") == str(waiting.POLLS_BEFORE_YIELD)
    assert constant("kMaxPause") == \
        f"std::chrono::microseconds({round(waiting.MAX_PAUSE_S * 1e6)})"


@pytest.fixture
def empty_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(mpi_cxx, "_module", None)
    return tmp_path


def test_not_built_falls_back_to_python_in_one_line(empty_dir, monkeypatch):
    # the directory as a rank gets it: DDP_MPI_CXX_DIR read into JobEnv
    monkeypatch.setenv("DDP_MPI_CXX_DIR", str(empty_dir))
    choice = mpi_cxx.choose("auto", detect_environment().mpi_cxx_dir)
    assert choice.name == "mpi4py"
    assert choice.reason == (f"the Python mpi backend: the compiled mpi backend is not built in "
                             f"{empty_dir} (./scripts/bootstrap.sh or python -m launcher.mpi.cxx "
                             "builds it)")
    assert "\n" not in choice.reason


def test_built_for_another_torch_falls_back_naming_both_versions(empty_dir):
    (empty_dir / "ddp_mpi_cxx_0123456789abcdef.json").write_text(json.dumps({"torch": "2.9.0"}))
    choice = mpi_cxx.choose("auto", str(empty_dir))
    assert choice.name == "mpi4py"
    assert f"built for torch 2.9.0, this is {torch.__version__}" in choice.reason


def test_asking_for_the_compiled_backend_where_it_cannot_run_is_an_error(empty_dir):
    with pytest.raises(LaunchError, match="not built") as caught:
        mpi_cxx.choose("cxx", str(empty_dir))
    assert "DDP_MPI_IMPL" in caught.value.hint


def test_unknown_implementation_is_an_error():
    with pytest.raises(LaunchError, match="DDP_MPI_IMPL='fast' is not one of auto, cxx"):
        mpi_cxx.choose("fast")


def test_python_is_taken_when_asked_for():
    assert mpi_cxx.choose("python").name == "mpi4py"


def test_the_build_reads_directory_and_compiler_where_jobenv_does(monkeypatch, tmp_path):
    monkeypatch.setenv("DDP_MPI_CXX_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "clang++")
    assert mpi_cxx._build_tools() == (str(tmp_path), "clang++")


def test_no_compiler_is_one_error_line(tmp_path):
    environ = clean_environ({"CXX": "no-such-compiler", "DDP_MPI_CXX_DIR": str(tmp_path)})
    result = subprocess.run([sys.executable, "-m", "launcher.mpi.cxx"], capture_output=True,
                            text=True, timeout=60, env=environ, cwd=REPO_ROOT)
    assert result.returncode != 0
    assert result.stderr.splitlines() == ["launcher.mpi.cxx: error: no C++ compiler "
                                          "(no-such-compiler)", "HINT: apt-get install g++"]
    assert not list(tmp_path.iterdir())


def test_a_build_that_fails_leaves_the_other_built(tmp_path):
    """No MPICH where --mpi-prefix points: the backend's build fails in one error line and its
    HINT, and the padding, which needs no MPICH, is built all the same."""
    environ = clean_environ({"DDP_MPI_CXX_DIR": str(tmp_path)})
    result = subprocess.run([sys.executable, "-m", "launcher.mpi.cxx", "--mpi-prefix",
                             str(tmp_path / "nothing")], capture_output=True, text=True,
                            timeout=120, env=environ, cwd=REPO_ROOT)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"ucx_address: built: {ucx_address.path(str(tmp_path))}"]
    assert result.stderr.splitlines() == [
        f"launcher.mpi.cxx: error: mpi_cxx did not build: no MPICH to build the mpi backend "
        f"against in {tmp_path / 'nothing'} (needs include/mpi.h and lib/libmpi.so.12)",
        "HINT: pip install mpich (the project's [mpich] extra), or pass --mpi-prefix"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        ucx_address.path(str(tmp_path)).name]


@needs_build
def test_the_file_alone_builds_as_the_images_build_stage_does(tmp_path):
    """docker/Dockerfile copies cxx.py, ucx_address.py, ext_files.py and the C++ alone and runs
    the file: no project to read variables with, so the defaults, whatever is set."""
    names = ["cxx.py", *(path.name for path in mpi_cxx.SOURCES), "ucx_address.py",
             "ucx_address.cpp", "ext_files.py"]
    copied = re.search(r"^COPY (launcher/mpi/cxx\.py[^\n]*(?:\\\n[^\n]*)*) /tmp/mpi-cxx/$",
                       (REPO_ROOT / "docker" / "Dockerfile").read_text(), re.MULTILINE)
    assert sorted(copied.group(1).replace("\\\n", " ").split()) == \
        sorted(f"launcher/mpi/{name}" for name in names)
    for name in names:
        (tmp_path / name).write_bytes((REPO_ROOT / "launcher" / "mpi" / name).read_bytes())
    environ = clean_environ({"DDP_MPI_CXX_DIR": str(tmp_path / "elsewhere")})
    result = subprocess.run([sys.executable, str(tmp_path / "cxx.py")], capture_output=True,
                            text=True, timeout=60, env=environ, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"ucx_address: up to date: {ucx_address.path()}",
                                          f"mpi_cxx: up to date: {mpi_cxx.built_path()}"]


def test_the_build_key_changes_with_the_source_and_torch(monkeypatch):
    name = mpi_cxx.module_name()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert mpi_cxx.module_name() != name


@needs_build
def test_a_second_build_with_nothing_changed_compiles_nothing():
    """Nothing written: the same files, untouched (a bound on the time failed on a slow day)."""
    built = (ucx_address.path(), mpi_cxx.built_path())
    before = [(path.stat().st_ino, path.stat().st_mtime_ns) for path in built]
    result = subprocess.run([sys.executable, "-m", "launcher.mpi.cxx"], capture_output=True,
                            text=True, timeout=120, env=clean_environ(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"ucx_address: up to date: {built[0]}",
                                          f"mpi_cxx: up to date: {built[1]}"]
    assert [(path.stat().st_ino, path.stat().st_mtime_ns) for path in built] == before


@needs_build
def test_the_compiled_backend_runs_on_mpi4pys_library():
    choice = mpi_cxx.choose("auto")
    assert choice.name == mpi_cxx.BACKEND_NAME, choice.reason
    assert mpi_cxx.loaded().library_version() == MPI.Get_library_version()
    assert torch.__version__.split("+")[0] == mpi_cxx.loaded().TORCH_VERSION


@needs_build
@pytest.mark.mpi
def test_launcher_check_says_which_implementation_runs():
    result = run_mpi(2, ["-m", "launcher.check", "--backend", "mpi"], timeout=120)
    assert result.returncode == 0, result.output
    assert f"mpi: rank 0 runs the compiled mpi backend ({mpi_cxx.built_path()})" in result.stdout
    fallback = run_mpi(2, ["-m", "launcher.check", "--backend", "mpi"], timeout=120,
                       env={"DDP_MPI_CXX_DIR": str(REPO_ROOT / "nonexistent")})
    assert fallback.returncode == 0, fallback.output
    assert "mpi: rank 0 runs the Python mpi backend: the compiled mpi backend is not built" \
        in fallback.stdout


@needs_build
@pytest.mark.mpi
def test_training_ends_with_the_same_hash_on_both_implementations(tmp_path):
    """``launcher.train --backend mpi``, 2 ranks, the same seed: the compiled backend (required
    here: DDP_MPI_IMPL=cxx fails where it cannot run) and the Python one agree to the bit."""
    flags = ["-m", "launcher.train", "--data-dir", str(tmp_path / "data"), "--backend", "mpi",
             "--global-batch-size", "16", "--max-steps", "30", "--log-every", "10",
             "--checkpoint-every", "0"]
    digests = {}
    for impl in ("cxx", "python"):
        result = run_mpi(2, [*flags, "--run-dir", str(tmp_path / impl)], timeout=240,
                         env={"DDP_MPI_IMPL": impl})
        assert result.returncode == 0, result.output
        found = dict(HASH.findall(result.stdout))
        assert sorted(found) == ["0", "1"] and len(set(found.values())) == 1, result.output
        digests[impl] = found["0"]
    assert digests["cxx"] == digests["python"]


#: a rank's compiled group: its progress thread's sleeps while the caller's thread runs 400
#: synchronous all_reduces, then while one asynchronous all_reduce is handed to it
_WAKE_UPS = """
import os, sys, time, torch, torch.distributed as dist, launcher
from launcher.mpi import cxx

def switches(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        return int(next(line for line in status if line.startswith("voluntary_ctxt")).split()[1])

with launcher.distributed(backend="mpi"):
    before = set(os.listdir("/proc/self/task"))
    group = dist.new_group(backend=cxx.BACKEND_NAME)
    threads = sorted(set(os.listdir("/proc/self/task")) - before)
    t = torch.ones(1024)
    dist.all_reduce(t, group=group)
    start = [switches(tid) for tid in threads]
    for _ in range(400):
        dist.all_reduce(t, group=group)
    synchronous = [switches(tid) for tid in threads]
    dist.all_reduce(t, group=group, async_op=True).wait()
    # a switch is counted when the thread sleeps again, which may come after wait() returns
    deadline = time.monotonic() + 5
    while True:
        handed = [switches(tid) for tid in threads]
        if handed != synchronous or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    line = (f"wake-ups {len(threads)} {max(b - a for a, b in zip(start, synchronous))} "
            f"{max(b - a for a, b in zip(synchronous, handed))}")
    sys.stdout.write(line + "\\n")  # one write: the two ranks' lines are not interleaved
"""


@needs_build
@pytest.mark.mpi
def test_an_op_run_in_the_callers_thread_wakes_no_progress_thread():
    """Each synchronous op on an idle group runs in the caller's thread; its end once woke the
    idle progress thread (one condition variable for both), which cost a context switch per
    call and the core that MPI's progress needed (benchmarks/README.md: "a wake-up per
    call"). Counted from the kernel, not timed: the thread new_group started sleeps no more
    often during 400 such calls than by chance, and does wake for an op handed to it."""
    result = run_mpi(2, ["-c", _WAKE_UPS], timeout=120, env={"DDP_MPI_IMPL": "cxx"})
    assert result.returncode == 0, result.output
    counts = re.findall(r"^wake-ups (\d+) (\d+) (\d+)$", result.stdout, re.MULTILINE)
    assert len(counts) == 2, result.output
    for threads, synchronous, handed in counts:
        assert int(threads) >= 1 and int(synchronous) < 20 and int(handed) >= 1, result.output
