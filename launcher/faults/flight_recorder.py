"""The flight recorder: the last collectives and point-to-point calls of each process group, on
every rank and every backend, so that a hang can say who was where (``launcher.faults.hang_watch``).

``install()`` wraps the collective and point-to-point functions of ``torch.distributed`` (the
API a training script and ``launcher`` call, whatever the backend: gloo, nccl, mpi, mpi4py).
Each call leaves one ``Entry`` in its group's ring of ``CAPACITY``: its sequence number in the
group, the operation, the first tensor's size in bytes and dtype, the calling Python frame
outside torch and ``launcher`` (``file:line``), when it started and ended. A call that is under
way has no end yet: that is where a rank waits.

DDP's reducer calls the process group from C++, past these functions: each backward's gradient
all-reduces are recorded as one ``all_reduce #N (DDP gradients)`` from the line that called
backward, for every DDP, by ``launcher.faults.ddp_steps``.

Why a wrapper and not torch's own Flight Recorder: torch 2.13 has one for gloo and nccl
(``TORCH_FR_BUFFER_SIZE``, ``torch._C._distributed_c10d._dump_fr_trace``), but not for a
backend written in Python such as the mpi4py one, its gloo entries stay "scheduled" with no
start or end, and the frames it keeps end inside torch.

The cost, measured by ``python -m benchmarks.flight_recorder`` (benchmarks/README.md) on this
project's 2-core VM: 0.4 µs for the wrapper, about 1 µs on a 4 KiB all_reduce, 12-19 µs on a
DDP step; an nccl call ~12 µs more for its CUDA event (an H200 host).
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from launcher.faults import call_site
from launcher.faults.record_entry import DONE, END, START, STATE, Entry, gpu_done, on_gpu

#: entries kept per process group
CAPACITY = 64

#: the wrapped functions: name -> (index of the tensor argument, index of the group argument);
#: None where there is none. The rest of torch.distributed calls these, or is not a collective
_CALLS: dict[str, tuple[int | None, int | None]] = {
    "all_reduce": (0, 2), "all_reduce_coalesced": (None, 2), "broadcast": (0, 2),
    "reduce": (0, 3), "all_gather": (1, 2), "all_gather_into_tensor": (1, 2),
    "reduce_scatter": (0, 3), "reduce_scatter_tensor": (1, 3), "all_to_all_single": (1, 4),
    "all_to_all": (None, 2), "gather": (0, 3), "scatter": (0, 3), "barrier": (None, 0),
    "monitored_barrier": (None, 0), "all_gather_object": (None, 2),
    "broadcast_object_list": (None, 2), "gather_object": (None, 3),
    "scatter_object_list": (None, 3), "send": (0, 2), "recv": (0, 2), "isend": (0, 2),
    "irecv": (0, 2), "batch_isend_irecv": (None, None),
}


class Ring:
    """One process group's last calls; ``gpu``: the group's collectives run on the GPU past the
    call (nccl), so each call keeps a way to ask whether its kernel has finished; ``live``:
    False once the recorder forgot it (a caller that keeps a ring, ``ddp_steps``, asks)."""

    __slots__ = ("name", "count", "entries", "gpu", "live")

    def __init__(self, name: str, gpu: bool = False):
        self.name = name
        self.count = 0
        self.entries: deque[list] = deque(maxlen=CAPACITY)
        self.gpu = gpu
        self.live = True


_rings: dict[str | None, Ring] = {}
_originals: dict[str, object] = {}
#: the thread that makes the recorded calls (others' calls, e.g. a checkpoint thread's, too)
_lock = threading.Lock()


def _key(group) -> str | None:
    """The ring's key of ``group``: None for the default group, else its name. Never the
    group itself: a ring that held it would keep its threads alive past destroy_process_group
    (and a default group captured before init would never compare equal)."""
    if group is None or group is dist.GroupMember.WORLD:
        return None
    return str(getattr(group, "group_name", id(group)))


def ring_of(group) -> Ring:
    """The ring of ``group`` (None or WORLD: the default group), made on its first call (the
    lock only then: a dict lookup is atomic)."""
    key = _key(group)
    ring = _rings.get(key)
    if ring is None:
        with _lock:
            ring = _rings.get(key)
            if ring is None:
                ring = _rings[key] = Ring("world" if key is None else key, _on_nccl(group))
    return ring


def _forget() -> None:
    for ring in _rings.values():
        ring.live = False
    _rings.clear()


def _on_nccl(group) -> bool:
    try:
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # no group yet
        return False


#: the wrapper's body: written out per function with the function's own parameters (no
#: ``*args, **kwargs`` to pack and unpack, no argument looked up by position: ~0.2 µs a call)
_BODY = """
def recorded({parameters}):
    ring = rings_get(None) if {group} is None else None
    if ring is None:
        ring = ring_of({group})
    frame = frame_of(1)
    code = frame.f_code
    if kinds_get(code) == 0:  # called from the user's code: the common case
        lasti = frame.f_lasti
    else:
        code, lasti = caller(frame)
    ring.count += 1
    # nbytes, not shape: a torch.Size made and kept costs ~0.4 µs a call
    raw = [ring.count, name, {tensor}.nbytes, {tensor}.dtype, code, lasti, clock(), None,
           "done", None, None]
    ring.entries.append(raw)
    try:
        result = original({arguments})
    except BaseException:
        raw[7], raw[8] = clock(), "failed"
        raise
    raw[7] = clock()
    if result is not None:
        raw[8] = "issued"
    if ring.gpu:
        raw[10] = gpu_done(result)
    return result
"""


def _wrap(name: str, original, tensor_at: int | None, group_at: int | None):
    """``original`` recorded, with its own signature (``*args, **kwargs`` where it has none
    that ``inspect`` reads)."""
    try:
        parameters = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        parameters = [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                      inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    namespace = {"rings_get": _rings.get, "ring_of": ring_of, "frame_of": sys._getframe,
                 "kinds_get": call_site.kinds.get, "caller": call_site.caller,
                 "clock": time.monotonic_ns, "name": name, "original": original,
                 "gpu_done": gpu_done,
                 "none": _NoTensor}
    declared, passed = [], []
    for index, parameter in enumerate(parameters):
        text = parameter.name
        if parameter.default is not inspect.Parameter.empty:
            namespace[f"default_{index}"] = parameter.default
            text += f"=default_{index}"
        kind = parameter.kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            declared.append(f"*{text}")
            passed.append(f"*{text}")
        elif kind == inspect.Parameter.VAR_KEYWORD:
            declared.append(f"**{text}")
            passed.append(f"**{text}")
        else:
            if kind == inspect.Parameter.KEYWORD_ONLY and "*" not in "".join(declared):
                declared.append("*")
            declared.append(text)
            passed.append(parameter.name if kind != inspect.Parameter.KEYWORD_ONLY
                          else f"{parameter.name}={parameter.name}")
        if kind == inspect.Parameter.POSITIONAL_ONLY and index + 1 < len(parameters) and \
                parameters[index + 1].kind != inspect.Parameter.POSITIONAL_ONLY:
            declared.append("/")
    named = [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    tensor = named[tensor_at] if tensor_at is not None and tensor_at < len(named) else "none"
    group = named[group_at] if group_at is not None and group_at < len(named) else "None"
    exec(_BODY.format(parameters=", ".join(declared), arguments=", ".join(passed),
                      tensor=tensor, group=group), namespace)
    recorded = namespace["recorded"]
    recorded.__name__ = recorded.__qualname__ = name
    recorded.__doc__ = original.__doc__
    recorded.__wrapped__ = original
    return recorded


class _NoTensor:
    """What a call without a tensor argument records: no size, no dtype."""

    nbytes = dtype = None


def begin(ring: Ring, name: str, tensor, note: str, frame) -> list:
    """Record a call that a caller other than the wrapped functions makes (DDP's gradient
    all-reduces, ``launcher.faults.ddp_steps``, which keeps its group's ``ring_of``), placed
    at the first frame outside torch and launcher from ``frame`` (``loss.backward()``'s line,
    launcher.train's included); ``finish`` ends it. What ``_wrap``'s wrapper does inline."""
    code, lasti = call_site.caller(frame)
    ring.count += 1
    raw = [ring.count, name, tensor.nbytes, tensor.dtype, code, lasti, time.monotonic_ns(),
           None, "done", note, True if ring.gpu else None]
    ring.entries.append(raw)
    return raw


def finish(raw: list, failed: bool) -> None:
    # the end last: a call with an end and a DONE is asked (``on_gpu``, from another thread)
    if failed:
        raw[STATE], raw[DONE] = "failed", None
    elif raw[DONE]:  # begun on a GPU ring
        raw[DONE] = gpu_done(None)
    raw[END] = time.monotonic_ns()


def original(name: str):
    """torch.distributed's own ``name``, unrecorded (for a caller that records itself)."""
    return _originals.get(name) or getattr(dist, name)


def install() -> None:
    """Record every call made through ``torch.distributed`` from now on (idempotent), in
    rings emptied for a new process group."""
    _forget()
    for name, (tensor_at, group_at) in _CALLS.items():
        if name in _originals or not hasattr(dist, name):
            continue
        _originals[name] = original = getattr(dist, name)
        setattr(dist, name, _wrap(name, original, tensor_at, group_at))


def uninstall() -> None:
    """Restore torch.distributed's own functions and forget what was recorded."""
    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()
    _forget()


_working = 0


@contextmanager
def working() -> Iterator[None]:
    """Mark a span that the other ranks wait for by design (``launcher.faults.agreement``'s
    body: rank 0 writing a checkpoint): a rank found in one is busy, not hung."""
    global _working
    _working += 1
    try:
        yield
    finally:
        _working -= 1


def is_working() -> bool:
    return _working > 0


def snapshot() -> list[dict]:
    """Every group's entries, oldest first, as plain dicts (for JSON)."""
    return [Entry.of(raw, ring.name).to_dict()
            for ring in list(_rings.values()) for raw in list(ring.entries)]


def current() -> Entry | None:
    """The call this rank waits in: the oldest one still on the GPU (the GPU runs them in
    order), else the newest one not ended; else its last call."""
    gpu = waiting_on_gpu()
    if gpu is not None:
        return gpu[0]
    newest = None
    for ring in list(_rings.values()):
        if not ring.entries:
            continue
        raw = ring.entries[-1]
        if raw[END] is None:
            return Entry.of(raw, ring.name)
        if newest is None or raw[START] > newest[0][START]:
            newest = (raw, ring.name)
    return None if newest is None else Entry.of(*newest)


def waiting_on_gpu() -> tuple[Entry, float] | None:
    """The oldest call whose kernel has not finished, and the seconds since it returned."""
    oldest = None
    for ring in list(_rings.values()):
        if not ring.gpu:
            continue
        for raw in list(ring.entries):
            if on_gpu(raw):
                if oldest is None or raw[END] < oldest[0][END]:
                    oldest = (raw, ring.name)
                break  # this ring's oldest: where its rank waits first
    if oldest is None:
        return None
    return Entry.of(*oldest), (time.monotonic_ns() - oldest[0][END]) / 1e9
