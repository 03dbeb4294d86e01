"""The flight recorder (launcher.flight_recorder) in a real one-rank gloo group."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from launcher.core.errors import PeerLost
from launcher.faults import ddp_steps, gpu_waits, hang_watch, heartbeat, record_entry
from launcher.faults import flight_recorder as fr
from launcher.placement.ports import free_port
from tests.fixtures.mpi import json_objects, run_mpi


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    fr.install()
    yield
    fr.uninstall()
    dist.destroy_process_group()


def _line(marker: str) -> int:
    with open(__file__) as source:
        return next(n for n, text in enumerate(source, 1)
                    if marker in text and "_line(" not in text)


def test_each_call_is_recorded_with_its_caller(group):
    tensor = torch.ones(4, 2)
    dist.all_reduce(tensor)  # first call
    dist.barrier()  # second call
    entries = fr.snapshot()
    assert [(e["seq"], e["op"], e["state"]) for e in entries] == [
        (1, "all_reduce", "done"), (2, "barrier", "done")]
    first = entries[0]
    assert first["nbytes"] == 4 * 2 * 4 and first["dtype"] == "float32"
    assert first["where"].endswith(f"test_flight_recorder.py:{_line('# first call')}")
    assert first["function"] == "test_each_call_is_recorded_with_its_caller"
    assert first["start_ns"] <= first["end_ns"]


def test_object_collectives_count_once(group):
    gathered = [None]
    dist.all_gather_object(gathered, {"a": 1})
    assert [e["op"] for e in fr.snapshot()] == ["all_gather_object"]


def test_a_call_under_way_is_current(group, monkeypatch):
    entered, release = threading.Event(), threading.Event()

    def blocking(*args, **kwargs):
        entered.set()
        release.wait(10)

    monkeypatch.setattr(dist, "broadcast", fr._wrap("broadcast", blocking, 0, 2))
    caller = threading.Thread(target=lambda: dist.broadcast(torch.zeros(3), 0))
    caller.start()
    entered.wait(10)
    try:
        now = fr.current()
        assert (now.op, now.seq, now.state, now.end_ns) == ("broadcast", 1, "running", None)
    finally:
        release.set()
        caller.join()
    assert fr.current().state == "done"


def test_only_the_last_entries_stay(group):
    tensor = torch.ones(1)
    for _ in range(fr.CAPACITY + 5):
        dist.all_reduce(tensor)
    seqs = [e["seq"] for e in fr.snapshot()]
    assert len(seqs) == fr.CAPACITY and seqs[-1] == fr.CAPACITY + 5


def _as_on_a_gpu(finished: list[bool]) -> fr.Ring:
    """The default group's ring as an nccl group's keeps it: its calls, one per item, each
    with a kernel that has finished or not (CUDA events here, and here there is no GPU)."""
    for _ in finished:
        dist.all_reduce(torch.ones(1))
    ring = fr.ring_of(None)
    ring.gpu = True
    for raw, done in zip(ring.entries, finished, strict=True):
        raw[record_entry.DONE] = lambda done=done: done
    return ring


def test_an_nccl_call_is_waited_in_until_its_kernel_finishes(group):
    """The oldest call whose kernel runs is where the rank waits, however many it made since
    (the GPU runs them in order); a finished kernel is not asked again."""
    ring = _as_on_a_gpu([True, False, False])
    entry, waited = fr.waiting_on_gpu()
    assert (entry.seq, entry.state) == (2, record_entry.ON_GPU) and waited >= 0
    assert fr.current().label() == "all_reduce #2"
    assert hang_watch.in_call().startswith(" in all_reduce #2 at ")
    assert ring.entries[0][record_entry.DONE] is None
    ring.entries[1][record_entry.DONE] = ring.entries[2][record_entry.DONE] = lambda: True
    assert fr.waiting_on_gpu() is None and fr.current().label() == "all_reduce #3"


def test_an_nccl_call_past_the_timeout_is_a_wait_past_it(group):
    """The thread that waits for nccl's calls hands one past the timeout to the heartbeats,
    which (none here) end the rank naming the call."""
    _as_on_a_gpu([False])
    lost = []
    waits = gpu_waits.GpuWaits(0.01, 0, lost.append)
    try:
        deadline = time.monotonic() + 5 * heartbeat.BEAT_S
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        waits.stop()
    assert len(lost) == 1 and isinstance(lost[0], PeerLost)
    assert lost[0].message.startswith("all_reduce on the GPU did not complete within")
    assert "(this is rank 0 in all_reduce #1 at " in lost[0].message


@pytest.fixture
def recorded_ddp(group):
    ddp_steps.install()
    yield
    ddp_steps.uninstall()


def _steps() -> list[dict]:
    return [entry for entry in fr.snapshot() if entry["note"] == ddp_steps.NOTE]


def test_a_ddp_backward_is_one_entry_from_the_backward_line(recorded_ddp):
    model = DistributedDataParallel(torch.nn.Linear(3, 2))  # a script's own DDP
    loss = model(torch.ones(4, 3)).sum()
    assert _steps() == []  # its forward and loss are not in it
    loss.backward()  # the backward
    [step] = _steps()
    assert (step["op"], step["state"]) == ("all_reduce", "done")
    assert step["nbytes"] == (3 * 2 + 2) * 4 and step["dtype"] == "float32"
    assert step["where"].endswith(f"test_flight_recorder.py:{_line('# the backward')}")
    assert fr.current().label() == f"all_reduce #{step['seq']} (DDP gradients)"


def test_only_a_backward_that_syncs_is_recorded(recorded_ddp):
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    with model.no_sync():  # accumulating: DDP reduces nothing
        model(torch.ones(4, 3)).sum().backward()
    with torch.no_grad():
        model(torch.ones(4, 3))
    assert _steps() == []
    model(torch.ones(4, 3)).sum().backward()
    assert len(_steps()) == 1


def test_a_ddp_records_into_the_rings_of_the_recorder_installed_now(recorded_ddp):
    """Each DDP keeps its ring (one Python call less per backward); a recorder installed again
    (for a new process group) empties the rings, and the DDP's next backward is in the new
    one, not in a ring nobody reads."""
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    model(torch.ones(4, 3)).sum().backward()
    assert [step["seq"] for step in _steps()] == [1]
    fr.install()
    assert _steps() == []
    model(torch.ones(4, 3)).sum().backward()
    assert [step["seq"] for step in _steps()] == [1]


def test_the_entry_ends_when_the_last_bucket_is_reduced(recorded_ddp):
    """A communication hook whose result comes 0.3 s after backward asked for it: the entry
    is under way until then, so a rank that waits for a peer there is seen waiting."""
    model = DistributedDataParallel(torch.nn.Linear(3, 2))

    def late(_state, bucket):
        future = torch.futures.Future()
        threading.Timer(0.3, future.set_result, args=(bucket.buffer(),)).start()
        return future

    model.register_comm_hook(None, late)
    model(torch.ones(4, 3)).sum().backward()
    [step] = _steps()
    assert step["end_ns"] - step["start_ns"] >= 0.3e9, step


def test_launcher_trains_timed_hook_keeps_ddps_own_weights_and_every_ddp_is_recorded():
    """3 ranks (gloo): ``launcher.train``'s timed hook gives the same weights, bit for bit, as
    DDP's own reducer, which multiplies by 1/3 where torch's allreduce_hook divides by 3 (the
    last bit differs); both DDPs, built by the script, record each backward once."""
    result = run_mpi(3, [str(Path(__file__).parent / "ddp_steps_worker.py")], timeout=120)
    assert result.returncode == 0, result.output
    ranks = json_objects(result.stdout)
    assert len(ranks) == 3, result.output
    for rank in ranks:
        assert rank["own"] == rank["hooked"], rank
        assert rank["steps"] == 10, rank
