"""The Slurm step's rendezvous port: outside the ephemeral range, distinct per job and step."""

from __future__ import annotations

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
