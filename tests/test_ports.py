"""Rendezvous ports outside the ephemeral range: a Slurm step's, distinct per job and step, and a
free one drawn at random."""

from __future__ import annotations

import socket

import pytest

from launcher.placement import ports
from launcher.placement.ports import LINUX_EPHEMERAL_RANGE, SLURM_PORTS, ephemeral_range, slurm_port


@pytest.mark.parametrize("ephemeral", [(32768, 60999), (10000, 20000), (1024, 65000),
                                       (40000, 40000)])
def test_slurm_ports_stay_outside_the_ephemeral_range(ephemeral):
    low, high = ephemeral
    allowed = [p for p in range(SLURM_PORTS[0], SLURM_PORTS[1] + 1) if not low <= p <= high]
    ports = {slurm_port(str(job), "0", ephemeral) for job in range(1000, 1000 + len(allowed))}
    assert ports == set(allowed)  # every allowed port, consecutive jobs never share one
    steps = {slurm_port("4242", str(step), ephemeral) for step in range(200)}
    assert len(steps) == 200 and steps <= set(allowed)  # steps of one job never share one
    assert slurm_port("7", "0", ephemeral) == slurm_port(str(7 + len(allowed)), "0", ephemeral)
    assert slurm_port("123_4", "0", ephemeral) == slurm_port("1234", "0", ephemeral)


def test_slurm_port_reads_this_nodes_ephemeral_range(tmp_path, monkeypatch):
    sysctl = tmp_path / "ip_local_port_range"
    sysctl.write_text("20000\t65535\n")
    assert ephemeral_range(sysctl) == (20000, 65535)
    assert ephemeral_range(tmp_path / "missing") == LINUX_EPHEMERAL_RANGE
    monkeypatch.setattr(ports.ephemeral_range, "__defaults__", (sysctl,))
    assert SLURM_PORTS[0] <= slurm_port("99", "0") < 20000


def test_a_free_port_is_drawn_outside_the_ephemeral_range_and_is_free():
    ephemeral = (12000, 65000)  # leaves 10000-11999 and 65001-65535
    drawn = {ports.free_port(ephemeral) for _ in range(200)}
    assert all(10000 <= p < 12000 or 65000 < p <= 65535 for p in drawn)
    assert len(drawn) > 100  # drawn at random, not one port for everyone



def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        # the taken port drawn first, then the lowest ports in turn
        draws = iter([taken - SLURM_PORTS[0], *range(49)])
        monkeypatch.setattr(ports.random, "randrange", lambda span: next(draws))
        assert SLURM_PORTS[0] <= ports.free_port((65535, 65535)) < SLURM_PORTS[0] + 49


def test_a_given_port_inside_the_ephemeral_range_is_warned_of():
    line = ports.ephemeral_warning(40000, (32768, 60999))
    assert "MASTER_PORT=40000" in line and "(32768-60999)" in line and "below 32768" in line
    assert ports.ephemeral_warning(29500, (32768, 60999)) is None
    assert ports.ephemeral_warning(61000, (32768, 60999)) is None
    assert ports.ephemeral_warning(32768, (32768, 60999)) is not None  # the range's own ends
