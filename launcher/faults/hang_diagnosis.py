"""A hang in one line: from what each rank says of itself, who is where and why they do not meet.

Each rank's ``Where`` (``launcher.faults.hang_watch`` gathers them) holds its kind ("waiting" in a
collective, "elsewhere" outside any, "ended", "no answer" when it could not say), its current or
last call from the flight recorder and its recent calls. ``diagnose`` decides, in this order:

1. the first call number at which the ranks' calls differ (another operation, or the same one
   from another line): collectives called in a different order;
2. ranks that are not waiting (ended, elsewhere, not answering) while the others wait;
3. ranks that wait in calls of different numbers (a rank made fewer calls);
4. all wait in the same call, or wait for ranks busy in a span the others wait for by design
   (``BUSY``: a checkpoint write inside ``launcher.faults.agreement.agree``): a long but
   legitimate call (None: the wait goes on).

Standard library only: ``python -m launcher.hang`` reads the files again anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

WAITING, ELSEWHERE, ENDED, NO_ANSWER = "waiting", "elsewhere", "ended", "no answer"
#: outside any collective in a span the others wait for by design (a checkpoint write)
BUSY = "busy"


@dataclass
class Where:
    """What one rank says of itself (or what the asking rank knows of one that cannot say)."""

    rank: int
    node: str
    kind: str
    #: its current call (waiting) or last one: op, seq, where, state (empty: none recorded)
    call: dict = field(default_factory=dict)
    #: its recent calls of each group: [group, seq, op, where]
    history: list = field(default_factory=list)
    #: where its main thread is (or where it ended), ``file:line``, and the function
    at: str = "?"
    function: str = "?"
    #: the file with its stacks and calls
    stack: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Where:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 2-15``."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _who(group: list[Where]) -> str:
    """``rank 1 (n1)`` or ``ranks 0, 2-3`` (nodes named for one rank only)."""
    text = ranks_text([w.rank for w in group])
    return f"{text} ({group[0].node})" if len(group) == 1 else text


def _label(call: dict) -> str:
    """``all_reduce #4``, or ``all_reduce #4 (DDP gradients)`` for a call with a note."""
    note = call.get("note")
    return f"{call['op']} #{call['seq']}" + (f" ({note})" if note else "")


def _call(call: dict) -> str:
    return f"{_label(call)} at {call['where']}"


def _groups(items: list[Where], key) -> list[list[Where]]:
    """``items`` grouped by ``key``, the largest group last (the majority is named last)."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return sorted(groups.values(), key=lambda g: (len(g), -g[0].rank))


def _divergence(wheres: list[Where]) -> tuple[int, list[list[Where]], dict] | None:
    """The first call number of a group at which ranks made different calls: the number, the
    ranks grouped by call, and each rank's call there."""
    calls: dict[tuple[str, int], dict[int, tuple[str, str]]] = {}
    for w in wheres:
        for group, seq, op, where in w.history:
            calls.setdefault((group, seq), {})[w.rank] = (op, where)
    for (_group, seq), by_rank in sorted(calls.items(), key=lambda item: item[0][1]):
        if len(set(by_rank.values())) > 1:
            involved = [w for w in wheres if w.rank in by_rank]
            return seq, _groups(involved, lambda w, calls=by_rank: calls[w.rank]), by_rank
    return None


def _waiting_text(waiting: list[Where]) -> str:
    parts = [f"{_who(g)} {'waits' if len(g) == 1 else 'wait'} in {_call(g[0].call)}"
             for g in _groups(waiting, lambda w: (w.call["op"], w.call["seq"],
                                                   w.call["where"]))]
    return "; ".join(parts)


def _other_text(w: Where, waiting: list[Where]) -> str:
    last = f" after {_call(w.call)}" if w.call else ""
    if w.kind == ENDED:
        return f"{_who([w])} ended at {w.at}{last}"
    if w.kind == ELSEWHERE:
        into = f" {_label(waiting[0].call)}" if waiting else ""
        stack = f" (stack: {w.stack})" if w.stack else ""
        return f"{_who([w])} never entered{into}: it is at {w.at} in {w.function}{stack}"
    if w.kind == BUSY:
        return f"{_who([w])} is busy at {w.at} in {w.function} (inside an agreement){last}"
    return (f"{_who([w])} does not answer (stopped, or in a C call holding the GIL); "
            f"its last call: {_call(w.call) if w.call else 'none recorded'}")


_WHY = {ENDED: "it left the job while the others wait",
        ELSEWHERE: "it does not reach the collective the others wait in",
        NO_ANSWER: "it cannot say where it is",
        BUSY: "the others wait for it"}


def diagnose(wheres: Sequence[Where]) -> str | None:
    """The diagnosis line, ``hang: ...``; None when every rank waits in the same call."""
    wheres = sorted(wheres, key=lambda w: w.rank)
    waiting = [w for w in wheres if w.kind == WAITING and w.call]
    others = [w for w in wheres if w not in waiting]
    now = "; ".join([_other_text(w, waiting) for w in others]
                    + ([_waiting_text(waiting)] if waiting else []))
    found = _divergence(wheres)
    if found is not None:
        seq, groups, by_rank = found
        *minority, majority = groups
        current = all(w.call.get("seq") == seq and w.kind == WAITING
                      for g in groups for w in g)
        def said(g: list[Where], one: str, many: str) -> str:
            op, where = by_rank[g[0].rank]
            return f"{_who(g)} {one if len(g) == 1 else many} {op} #{seq} at {where}"
        if current:
            parts = [said(g, "is in", "are in") for g in minority]
            return (f"hang: {'; '.join(parts)}; {said(majority, 'waits in', 'wait in')}: "
                    "collectives called in a different order")
        parts = [said(g, "called", "called") for g in minority]
        return (f"hang: {'; '.join(parts)} where {said(majority, 'called', 'called')}: "
                f"collectives called in a different order; now {now}")
    if others and all(w.kind == BUSY for w in others):
        return None  # a checkpoint write, an agreement: the wait goes on
    if others:
        why = {_WHY.get(w.kind, "") for w in others}
        return f"hang: {now}: {why.pop() if len(why) == 1 else 'ranks do not meet'}"
    if len({(w.call["op"], w.call["seq"]) for w in waiting}) > 1:
        return f"hang: {now}: the ranks made different numbers of calls"
    return None
