"""One recorded call (``launcher.faults.flight_recorder``): the raw record the hot path keeps,
the ``Entry`` it is read back as, and whether an nccl call's kernel has finished."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from launcher.faults import call_site

#: a raw record's fields, kept as a list on the hot path (no strings made per call); ``DONE``:
#: on a GPU ring, what says whether the call's kernel has finished (None once it has)
SEQ, OP, NBYTES, DTYPE, CODE, LASTI, START, END, STATE, NOTE, DONE = range(11)
ON_GPU = "on the GPU"


def gpu_done(result):
    """How to ask whether an nccl call's kernel has finished: its Work where it returned one
    (``async_op=True``: the current stream does not wait for it before ``wait()``), else an
    event on the current stream, which a synchronous call made wait for its kernel. The event
    costs ~12 µs a call on an H200 host, reused from a pool of the ring's size as much: the
    price is in recording it (benchmarks/README.md, "Flight recorder")."""
    if result is not None:
        return getattr(result, "is_completed", None)
    import torch

    event = torch.cuda.Event()
    event.record()
    return event.query


def on_gpu(raw: list) -> bool:
    """Whether the call's kernel is still running; forgets how to ask once it is not, which
    frees an async op's Work."""
    done = raw[DONE]
    if done is None or raw[END] is None:
        return False
    if done():
        raw[DONE] = None
        return False
    return True


@dataclass
class Entry:
    """One call, as ``snapshot`` and ``current`` give it: where a rank waits while ``end_ns``
    is None."""

    #: the call's number in its group, from 1 (the same call has the same number on every rank
    #: that made the same calls)
    seq: int
    op: str
    group: str
    #: the first tensor's size in bytes and dtype (None and empty when the call takes none)
    nbytes: int | None
    dtype: str
    #: the caller outside torch and launcher, ``file:line``, and its function
    where: str
    function: str
    start_ns: int
    end_ns: int | None
    #: "running", "done", "issued" (an async op returned its Work), "failed", or "on the GPU"
    #: (an nccl call returned, its kernel has not finished)
    state: str
    #: what the call is for, when a caller other than the user's code says (``DDP gradients``)
    note: str | None = None

    @property
    def under_way(self) -> bool:
        """Whether the rank waits in this call: running, failed out of a wait, or its kernel
        still on the GPU."""
        return self.state in ("running", "failed", ON_GPU)

    def label(self) -> str:
        return f"{self.op} #{self.seq}" + (f" ({self.note})" if self.note else "")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, raw: list, group: str) -> Entry:
        """From a ring's raw record (its fields: ``SEQ`` to ``NOTE``), kept raw on the hot
        path: no strings made per call."""
        seq, op, nbytes, dtype, code, lasti, start, end, state, note, _ = raw
        return cls(seq, op, group, nbytes,
                   "" if dtype is None else str(dtype).removeprefix("torch."),
                   "?" if code is None else call_site.where(code, lasti),
                   "?" if code is None else code.co_name, start, end,
                   "running" if end is None else ON_GPU if on_gpu(raw) else state, note)
