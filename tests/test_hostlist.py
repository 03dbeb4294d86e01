"""Slurm host lists and task counts, against tables and against the real ``scontrol``."""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from launcher.core.errors import LaunchError
from launcher.placement.hostlist import expand_hostlist, expand_tasks_per_node

# (host list, expansion): the expansions are what Slurm 22.05's scontrol printed
HOSTLISTS = [
    ("n01", ["n01"]),
    ("localhost", ["localhost"]),
    ("n[01-03]", ["n01", "n02", "n03"]),
    ("nid[00001-00003]", ["nid00001", "nid00002", "nid00003"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("a[9-10]", ["a9", "a10"]),
    ("a[1-02]", ["a1", "a2"]),  # width comes from the lower bound
    ("a[01-1]", ["a01"]),
    ("linux[1,2]", ["linux1", "linux2"]),  # Lightning#14896 read this as "linux[1"
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("a,b[001,003-004],c", ["a", "b001", "b003", "b004", "c"]),  # Megatron-Bridge#3830
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    ("a[0-1]-b-[3-4]", ["a0-b-3", "a0-b-4", "a1-b-3", "a1-b-4"]),
    ("n[1-2],m[3-4]x[5-6]", ["n1", "n2", "m3x5", "m3x6", "m4x5", "m4x6"]),
    ("gpu-node-01.cluster.example", ["gpu-node-01.cluster.example"]),  # dashes and dots
    ("login-1,compute-[1-2]", ["login-1", "compute-1", "compute-2"]),
    ("x-y.z,a-[1-2]", ["x-y.z", "a-1", "a-2"]),
    ("[1-2]", ["1", "2"]),
    ("a b", ["a", "b"]),  # whitespace separates like a comma
    ("a,,b,", ["a", "b"]),
    ("a[1,1],a1", ["a1", "a1", "a1"]),  # duplicates are kept
]

# accepted by no Slurm: scontrol prints "Invalid hostlist" for each
INVALID = ["a[1-2]b", "a[2-1]", "a[]", "a[x-y]", "a[1-2].x", "a[1-2]-", "a[1--2]", "a[-1]"]

# scontrol turns these into odd names ("a]", "a1-2]"); a host name never holds a bracket, so
# they are refused instead
UNBALANCED = ["a[1-2", "a1-2]", "a[1[2]]", "a]b[1]", "[", "]"]


@pytest.mark.parametrize("text, hosts", HOSTLISTS)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", INVALID + UNBALANCED + ["", " , "])
def test_bad_hostlist_names_variable_and_hint(text):
    with pytest.raises(LaunchError) as info:
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    assert "SLURM_STEP_NODELIST" in info.value.message
    assert "scontrol show hostnames" in info.value.hint


def test_huge_range_is_refused_not_expanded():
    with pytest.raises(LaunchError, match="more than"):
        expand_hostlist("n[1-999999999]")
    with pytest.raises(LaunchError, match="more than"):
        expand_hostlist("n[1-2000]x[1-2000]")


@pytest.mark.parametrize(
    "text, counts",
    [
        ("1", [1]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4,2(x2)", [4, 2, 2]),
        ("8(x1)", [8]),
        ("1,2,3", [1, 2, 3]),
    ],
)
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "2x3", "(x3)", "-1", "2(x3", "a"])
def test_bad_tasks_per_node(text):
    with pytest.raises(LaunchError) as info:
        expand_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE")
    assert "SLURM_STEP_TASKS_PER_NODE" in info.value.message
    assert info.value.hint


def _random_hostlists(count: int, seed: int = 14896) -> list[str]:
    """Host lists of the valid grammar: prefixes with dashes and dots, 0-2 bracket groups."""
    rng = random.Random(seed)
    lists = []
    for _ in range(count):
        entries = []
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(["n", "node-", "gpu.a", "r", "x-y.z", "c"])
            for group in range(rng.randint(0, 2)):
                if group:
                    name += rng.choice(["", "-", "x", ".n"])
                parts = []
                for _ in range(rng.randint(1, 3)):
                    low, width = rng.randint(0, 120), rng.choice([1, 2, 3, 5])
                    high = low + rng.randint(0, 4)
                    parts.append(f"{low:0{width}d}" + (f"-{high}" if high > low else ""))
                name += f"[{','.join(parts)}]"
            entries.append(name)
        lists.append(rng.choice([",", " "]).join(entries))
    return lists


def _scontrol(conf, text: str) -> tuple[list[str], str]:
    result = subprocess.run(
        ["scontrol", "show", "hostnames", text],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split(), result.stderr


@pytest.mark.slurm
def test_same_as_scontrol(slurm_conf):
    """Every table form and 60 random ones expand exactly as ``scontrol show hostnames``."""
    forms = [text for text, _ in HOSTLISTS] + _random_hostlists(60)
    for text in forms:
        hosts, stderr = _scontrol(slurm_conf, text)
        assert not stderr, f"{text!r}: {stderr}"
        assert expand_hostlist(text) == hosts, text


@pytest.mark.slurm
@pytest.mark.parametrize("text", INVALID)
def test_scontrol_refuses_what_we_refuse(slurm_conf, text):
    hosts, stderr = _scontrol(slurm_conf, text)
    assert "Invalid hostlist" in stderr and not hosts
