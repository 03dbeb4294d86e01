"""The one-line diagnosis of a hang (launcher.faults.hang_diagnosis), from what ranks say."""

from __future__ import annotations

from launcher.faults.hang_diagnosis import (
    BUSY,
    ELSEWHERE,
    ENDED,
    NO_ANSWER,
    WAITING,
    Where,
    diagnose,
    ranks_text,
)


def _calls(count: int, last: tuple[str, str] | None = None) -> list:
    history = [["world", seq, "all_reduce", "s.py:8"] for seq in range(1, count + 1)]
    if last is not None:
        history.append(["world", count + 1, *last])
    return history


def _waiting(rank: int, seq: int = 4, op: str = "all_reduce", where: str = "s.py:8") -> Where:
    history = _calls(seq - 1, (op, where))
    return Where(rank, "n0", WAITING, {"op": op, "seq": seq, "where": where,
                                       "state": "running"}, history)


def test_ranks_are_named_in_runs():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([0, 2, 3, 4, 7]) == "ranks 0, 2-4, 7"


def test_a_different_collective_at_the_same_number():
    wheres = [_waiting(0), _waiting(1, op="barrier", where="s.py:11"), _waiting(2), _waiting(3)]
    assert diagnose(wheres) == (
        "hang: rank 1 (n0) is in barrier #4 at s.py:11; ranks 0, 2-3 wait in all_reduce #4 at "
        "s.py:8: collectives called in a different order")


def test_a_divergence_that_completed_is_still_the_cause():
    """MPI let rank 1's barrier meet the others' all_reduce; rank 1 then ended."""
    ended = Where(1, "n1", ENDED, {"op": "barrier", "seq": 4, "where": "s.py:11",
                                   "state": "done"}, _calls(3, ("barrier", "s.py:11")),
                  at="s.py:3")
    line = diagnose([_waiting(0, seq=5, op="barrier", where="s.py:11"), ended])
    assert line.startswith("hang: rank 1 (n1) called barrier #4 at s.py:11 where rank 0 (n0) "
                           "called all_reduce #4 at s.py:8: collectives called in a different "
                           "order; now rank 1 (n1) ended at s.py:3"), line


def test_a_rank_elsewhere_is_named_with_its_place_and_stack():
    spinning = Where(1, "n1", ELSEWHERE, {"op": "all_reduce", "seq": 3, "where": "s.py:8",
                                          "state": "done"}, _calls(3), at="s.py:20",
                     function="spin", stack="runs/x/hang/rank-1.txt")
    assert diagnose([_waiting(0), spinning]) == (
        "hang: rank 1 (n1) never entered all_reduce #4: it is at s.py:20 in spin (stack: "
        "runs/x/hang/rank-1.txt); rank 0 (n0) waits in all_reduce #4 at s.py:8: it does not "
        "reach the collective the others wait in")


def test_a_rank_that_cannot_answer():
    line = diagnose([_waiting(0), Where(1, "n1", NO_ANSWER)])
    assert line.startswith("hang: rank 1 (n1) does not answer"), line


def test_fewer_calls_on_one_rank():
    line = diagnose([_waiting(0), _waiting(1, seq=3)])
    assert line == ("hang: rank 1 (n0) waits in all_reduce #3 at s.py:8; rank 0 (n0) waits in "
                    "all_reduce #4 at s.py:8: the ranks made different numbers of calls")


def test_a_long_call_everywhere_or_a_busy_rank_is_no_hang():
    assert diagnose([_waiting(0), _waiting(1)]) is None
    writing = Where(0, "n0", BUSY, {"op": "all_reduce", "seq": 3, "where": "s.py:8",
                                    "state": "done"}, _calls(3), at="ckpt.py:5")
    assert diagnose([writing, _waiting(1)]) is None
