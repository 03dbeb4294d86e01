"""torchrun --max-restarts: each attempt's ranks meet in the agent's store, which outlives the
attempts, without finding the keys of the attempt before (the side channel's addresses, the
host names, torch's own rendezvous)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.faults.side_addresses import Addresses
from launcher.placement.env import JobEnv
from launcher.placement.variables import restart_count
from tests.fixtures.mpi import REPO_ROOT, clean_environ

# attempt 0: rank 1 dies once the group is up, after the side channel published its port;
# attempt 1 must meet without dialling that dead port
RESTARTED = """\
import os, sys, torch, torch.distributed as dist, launcher
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
# a status directory of the test's own: rank 0's post-mortem of attempt 0 goes there, not /tmp
with launcher.distributed("gloo", timeout_s=30, status_dir=sys.argv[1]) as job:
    if attempt == "0" and job.rank == 1:
        os._exit(1)
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {job.rank}: sum {total.item()}", flush=True)
"""


def test_a_restarted_attempt_meets_again(tmp_path: Path):
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         str(script), str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env=clean_environ(), cwd=REPO_ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # with a status directory, ranks but 0 prefix their lines "[host:rank] " (rank_output)
    assert sorted(re.findall(r"attempt \d rank \d: sum [\d.]+", result.stdout)) == [
        "attempt 1 rank 0: sum 2.0", "attempt 1 rank 1: sum 2.0"], output


def test_a_peer_looked_up_mid_job_is_this_attempts():
    """The side channel's look-up opens a client of its own: it must read the prefix the
    rendezvous wrote this attempt's addresses under (``start_store``), not the one before."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    env = JobEnv(launcher="torchrun", rank=0, world_size=1, local_rank=0, local_world_size=1,
                 node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=server.port,
                 hostname="h")
    for attempt, address in enumerate(["127.0.0.1:1", "127.0.0.1:2"]):
        ours = replace(env, attempt=attempt)
        Addresses(ours).publish(dist.PrefixStore(ours.store_prefix, server), address)
    addresses = Addresses(replace(env, attempt=1))
    assert addresses[0] == "127.0.0.1:2"
    addresses.close()


def test_the_restart_count_is_read_strictly():
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restart_count({}) == 0  # ranks started by hand with RANK
    with pytest.raises(LaunchError, match="TORCHELASTIC_RESTART_COUNT='x'"):
        restart_count({"TORCHELASTIC_RESTART_COUNT": "x"})
