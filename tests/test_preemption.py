"""The preemption flag with real signals sent to this process (one rank: no process group),
and the warning when NCCL would take the signal over."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import pytest
import torch

from launcher.api import job
from launcher.core.errors import EXIT_INTERRUPTED, LaunchError
from launcher.faults.preemption import PreemptionWatch, nccl_clash
from launcher.group.process_group import DistContext
from launcher.placement.env import detect_environment

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, sent", [
    ("USR1", signal.SIGUSR1), ("SIGUSR2", signal.SIGUSR2), ("USR1", signal.SIGTERM),
])
def test_signal_sets_the_flag(name, sent):
    with PreemptionWatch(name) as watch:
        assert not watch.agreed(CPU)
        os.kill(os.getpid(), sent)
        assert watch.received == sent
        assert watch.agreed(CPU)


def test_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatch("USR1"):
        assert signal.getsignal(signal.SIGUSR1) is not before
    assert signal.getsignal(signal.SIGUSR1) is before


def test_other_signals_are_left_alone():
    with PreemptionWatch("USR2"):
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_unknown_signal_name():
    with pytest.raises(LaunchError, match="unknown preemption signal 'BOGUS'") as info:
        PreemptionWatch("BOGUS")
    assert "DDP_PREEMPT_SIGNAL" in info.value.hint


def test_ctrl_c_stops_with_130_and_wins_over_a_preemption():
    # what SIGINT had before: Python's handler, or SIG_IGN where a shell without job control
    # started the tests in the background (`cmd &` ignores SIGINT in what it starts)
    before = signal.getsignal(signal.SIGINT)
    with PreemptionWatch("USR1") as watch:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: a thread takes it
        deadline = time.monotonic() + 5
        while not watch.interrupted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.agreed(CPU)
        assert watch.stop_status == EXIT_INTERRUPTED
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize(("preempt", "dump", "named", "instead"), [
    ("USR1", "10", "SIGUSR1", "USR2"), ("USR2", "12", "SIGUSR2", "USR1"),
    ("USR1", "0xa", "SIGUSR1", "USR2"), ("USR1", "012", "SIGUSR1", "USR2"),
    ("USR1", "15", "SIGTERM", None), ("USR1", "2", "SIGINT", None),
])
def test_nccls_dump_signal_on_a_caught_signal_is_named(preempt, dump, named, instead):
    line = nccl_clash(preempt, dump)
    assert line.startswith(f"NCCL_PROXY_DUMP_SIGNAL={dump} is {named}, a signal that tells "
                           "this job to save and stop: NCCL takes it over")
    offered = "or preempt with another (DDP_PREEMPT_SIGNAL="
    assert (f"{offered}{instead} and sbatch --signal={instead}@120)" in line if instead
            else offered not in line), line


@pytest.mark.parametrize(("preempt", "dump"), [("USR1", None), ("USR1", "12"), ("USR2", "10"),
                                               ("USR1", "usr1"), ("USR1", "010")])
def test_nccls_dump_signal_elsewhere_is_no_clash(preempt, dump):
    assert nccl_clash(preempt, dump) is None


@pytest.mark.parametrize(("backend", "rank", "warned"), [
    ("nccl", 0, True), ("gloo", 0, False), ("nccl", 1, False)])
def test_rank_0_of_an_nccl_job_warns_of_the_clash_at_start_up(monkeypatch, capsys, backend,
                                                               rank, warned):
    """The wiring in ``launcher.distributed``: the group itself faked (an nccl group needs a
    GPU), everything around it real, SIGUSR1 given to NCCL."""
    @contextmanager
    def group(env, backend_asked, timeout_s, run_dir):
        yield DistContext(env=env, backend=backend, device=CPU, implementation="")

    monkeypatch.setattr(job, "process_group", group)
    env = detect_environment({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                              "NCCL_PROXY_DUMP_SIGNAL": "10"}, hostname="h")
    with job.distributed(backend, env=env) as running:
        assert running.backend == backend
    err = capsys.readouterr().err
    assert ("warning: NCCL_PROXY_DUMP_SIGNAL=10 is SIGUSR1" in err) == warned, err
