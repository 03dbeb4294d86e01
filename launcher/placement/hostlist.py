"""Expand Slurm host lists and task counts the way ``scontrol show hostnames`` does.

Forms (checked against Slurm 22.05's scontrol, see tests/test_hostlist.py):

- ``a,b c`` -- commas and whitespace separate entries; empty entries are dropped.
- ``n[01-03]`` -- a range keeps the width of its lower bound: ``a[098-101]`` gives
  ``a098 .. a101``, ``a[1-02]`` gives ``a1 a2``.
- ``n[1-3,5]``, ``linux[1,2]`` -- comma lists inside brackets.
- ``rack[1-2]-n[01-02]`` -- several bracket groups: the cartesian product, the leftmost group
  varying slowest (``rack1-n01 rack1-n02 rack2-n01 rack2-n02``).
- Duplicates are kept, in order.

Slurm rejects text after the last bracket group (``a[1-2]b``) and so does this module. Where
scontrol turns an unbalanced bracket into odd names (``a[1-2`` gives ``a]``), this module
raises instead: ``[`` and ``]`` never belong in a host name.
"""

from __future__ import annotations

import itertools
import re

from launcher.core.errors import LaunchError

#: more hosts than any real allocation: stops a typo like ``n[1-999999999]`` eating memory
MAX_HOSTS = 1_000_000

_ENTRY = re.compile(r"[^,\s\[]*(?:\[[^\]]*\][^,\s\[]*)*")
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _bad(variable: str, text: str, why: str) -> LaunchError:
    return LaunchError(
        f"{variable}={text!r} is not a Slurm host list: {why}",
        hint=f"compare with `scontrol show hostnames '{text}'`; "
        f"unset {variable} or fix it (e.g. n[001-004] or a,b[1,3-4])",
    )


def _split_entries(text: str, variable: str) -> list[str]:
    """Split at commas and whitespace that are not inside brackets."""
    entries, pos = [], 0
    while pos < len(text):
        if text[pos] in ", \t\n":
            pos += 1
            continue
        match = _ENTRY.match(text, pos)
        end = match.end()
        if end == pos or (end < len(text) and text[end] not in ", \t\n"):
            raise _bad(variable, text, "unbalanced '[' or ']'")
        entries.append(text[pos:end])
        pos = end
    return entries


def _expand_group(body: str, entry: str, variable: str, text: str) -> list[str]:
    values = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if not match:
            raise _bad(variable, text, f"invalid range {part!r} in {entry!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _bad(variable, text, f"range {part!r} in {entry!r} runs backwards")
        if int(high) - int(low) >= MAX_HOSTS:
            raise _bad(variable, text, f"range {part!r} has more than {MAX_HOSTS} hosts")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def _expand_entry(entry: str, variable: str, text: str) -> list[str]:
    if "]" in entry and "[" not in entry:
        raise _bad(variable, text, f"unbalanced ']' in {entry!r}")
    pieces = _GROUP.split(entry)
    # pieces alternates literal text and group bodies: lit, body, lit, body, ..., lit
    literals, bodies = pieces[0::2], pieces[1::2]
    if any(c in lit for lit in literals for c in "[]"):
        raise _bad(variable, text, f"unbalanced '[' or ']' in {entry!r}")
    if bodies and literals[-1]:
        raise _bad(variable, text, f"text {literals[-1]!r} after the last ']' in {entry!r}")
    groups = [_expand_group(body, entry, variable, text) for body in bodies]
    count = 1
    for group in groups:
        count *= len(group)
    if count > MAX_HOSTS:
        raise _bad(variable, text, f"{entry!r} expands to more than {MAX_HOSTS} hosts")
    # literals has one entry more than groups: zip drops the last, added after the join
    return [
        "".join(lit + value for lit, value in zip(literals, combo, strict=False)) + literals[-1]
        for combo in itertools.product(*groups)
    ]


def expand_hostlist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Host names of a Slurm host list, in Slurm's order; ``variable`` names it in errors."""
    hosts: list[str] = []
    for entry in _split_entries(text, variable):
        hosts.extend(_expand_entry(entry, variable, text))
        if len(hosts) > MAX_HOSTS:
            raise _bad(variable, text, f"more than {MAX_HOSTS} hosts")
    if not hosts:
        raise _bad(variable, text, "it names no host")
    return hosts


def expand_tasks_per_node(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Task counts per node from Slurm's compressed form: ``2(x3),1`` gives ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.fullmatch(part.strip())
        if not match:
            raise LaunchError(
                f"{variable}={text!r} is not a Slurm task count list: bad entry {part!r}",
                hint=f"Slurm writes it as counts with repeats, e.g. 2(x3),1; unset {variable} "
                "or fix it",
            )
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise LaunchError(
                f"{variable}={text!r} lists more than {MAX_HOSTS} nodes",
                hint=f"unset {variable} or fix it",
            )
        counts.extend([int(match.group(1))] * repeat)
    return counts
