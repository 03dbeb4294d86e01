"""Faults on the compose MPI cluster: a node dies or is cut off, a checkpoint writer dies.

What must hold: no rank hangs (every surviving rank exits non-zero within a minute, saying which
peer is lost), the same training with ``--resume auto`` then completes, and a checkpoint that
was being written when its writer died never becomes the one a run resumes from.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from ddp_tasks import cluster as cl
from tests.fixtures.cluster import Cluster, invoke_run, invoke_run_argv, param_hashes
from tests.fixtures.mpi import REPO_ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.docker]

#: seconds a collective may wait for a peer before the process group gives up
COLLECTIVE_TIMEOUT = 20
#: the promise: every surviving rank is gone this long after the fault
EXIT_WITHIN = 60
RUN_DIR = "/shared/runs/faults"
#: the ranks' process name (mpiexec and its proxies have other names)
PYTHON = "python3?"
#: 3 ranks: 1437 digits / 48 = 29 steps an epoch. Short, so the resumed run ends soon even on a
#: busy machine; the fault still lands mid-run because the ranks are frozen while it happens.
TRAIN = (f"--epochs 2 --global-batch-size 48 --checkpoint-every 5 --log-every 5 "
         f"--timeout-s {COLLECTIVE_TIMEOUT} --run-dir {RUN_DIR}")


def resuming(args: str) -> str:
    """ARGS for the run that resumes after the fault, which is not about timeouts: each
    start-up stage may take --timeout-s + 10 s, and with the faults' 20 s a busy machine that
    started the ranks of a repaired cluster slowly had one wait in MPI_Init past 30 s for the
    others (CI of 2026-11-26). A start-up that hangs still fails, later."""
    return args.replace(f"--timeout-s {COLLECTIVE_TIMEOUT}", "--timeout-s 120")


def start_training(cluster: Cluster, nodes: int, args: str) -> subprocess.Popen:
    return subprocess.Popen(invoke_run_argv(cluster, nodes, "launcher.train", args),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def has_checkpoint(cluster: Cluster) -> bool:
    return cluster.exec("node0", f"ls {RUN_DIR}/checkpoints/ckpt-*.pt").returncode == 0


def ranks_running(cluster: Cluster, hosts) -> list[str]:
    """The hosts among HOSTS where a training rank (a process named python) still runs."""
    return [host for host in hosts
            if cluster.exec(host, f"pgrep -x '{PYTHON}'").returncode == 0]


def freeze(cluster: Cluster, hosts) -> None:
    for host in hosts:
        cluster.check(host, f"kill -STOP $(pgrep -x '{PYTHON}')")


def thaw(cluster: Cluster, hosts) -> None:
    """Let the ranks on HOSTS go on; mpiexec may have ended some already (after a kill)."""
    for host in hosts:
        cluster.exec(host, f"pids=$(pgrep -x '{PYTHON}') && kill -CONT $pids")


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"the launcher still ran {timeout} s after the fault:\n{output}")
    return process.returncode, output


def cut_off(cluster: Cluster, host: str) -> None:
    subprocess.run(["docker", "network", "disconnect", cluster.network,
                    cluster.container(host)], check=True, timeout=60)


def reconnect(cluster: Cluster, host: str) -> None:
    """Back on the network under its name; restarted, because docker names a reconnected
    interface eth1, eth2 ... while the cluster's GLOO_SOCKET_IFNAME says eth0."""
    subprocess.run(["docker", "network", "connect", "--alias", host, cluster.network,
                    cluster.container(host)], check=True, timeout=60)
    subprocess.run(["docker", "restart", "--time", "1", cluster.container(host)], check=True,
                   timeout=60)


def kill(cluster: Cluster, host: str) -> None:
    subprocess.run(["docker", "kill", cluster.container(host)], check=True, timeout=60)


def restart(cluster: Cluster, host: str) -> None:
    subprocess.run(["docker", "start", cluster.container(host)], check=True, timeout=60)


FAULTS = {"kill": (kill, restart), "disconnect": (cut_off, reconnect)}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_lost_node_ends_every_rank_then_resume_completes(start_compose_mpi, fault):
    cluster = start_compose_mpi(3)
    lost, survivors = "node2", ("node0", "node1")
    inflict, repair = FAULTS[fault]
    lost_ip = cluster.check(lost, "hostname -i").split()[0]
    training = start_training(cluster, 3, TRAIN)
    wait_until(lambda: has_checkpoint(cluster) or training.poll() is not None, 240,
               "the first checkpoint")
    assert training.poll() is None, training.communicate()[0]

    freeze(cluster, cluster.hosts)
    inflict(cluster, lost)
    thaw(cluster, survivors)
    wait_until(lambda: not ranks_running(cluster, survivors), EXIT_WITHIN,
               f"every rank on {survivors} to exit after {fault} of {lost}")
    status, output = finish(training, EXIT_WITHIN)
    assert status != 0, output
    # the output names the lost peer: the survivors by host name, rank or address, or (a
    # node that dies ends the job before the ranks notice) ssh-launch.sh by host name
    assert re.search(rf"{lost}\b|rank 2\b|{re.escape(lost_ip)}\b", output), output

    repair(cluster, lost)
    cl.wait_healthy([cluster.container(lost)], timeout=120)
    resumed = invoke_run(cluster, 3, "launcher.train", resuming(TRAIN))
    assert resumed.returncode == 0, resumed.stdout
    assert re.search(r"resuming from \S+ckpt-\d+\.pt \(step [1-9]", resumed.stdout), \
        resumed.stdout
    hashes = param_hashes(resumed.stdout)
    assert sorted(hashes) == [0, 1, 2] and len(set(hashes.values())) == 1, resumed.stdout


# A watcher inside rank 0's node kills the writer (rank 0, the only python there) while a
# checkpoint's temporary file exists, once an older complete checkpoint is there: it stops the
# writer when the file appears, and kills it only if the file is still there (mid-write), else
# lets it go on and waits for the next one. Shell builtins only in the loop: it must be quick.
KILL_WRITER = f"""
until pid=$(pgrep -x '{PYTHON}'); do sleep 0.1; done
until cd {RUN_DIR}/checkpoints 2>/dev/null; do sleep 0.01; done
while :; do
    complete=
    for f in ckpt-*.pt; do [ -e "$f" ] && complete=1; done
    [ -n "$complete" ] || continue
    for f in .ckpt-*.tmp; do
        [ -e "$f" ] || continue
        kill -STOP "$pid"
        if [ -e "$f" ]; then kill -9 "$pid"; echo "$PWD/$f"; exit 0; fi
        kill -CONT "$pid"
    done
done
"""

NEWEST_VALID = f"""python - <<'EOF'
from pathlib import Path
from launcher.api import checkpoint
newest = checkpoint.newest_valid(Path("{RUN_DIR}/checkpoints"), print)
print("newest", newest.name if newest else None)
EOF"""


def test_checkpoint_of_a_killed_writer_is_never_resumed(start_compose_mpi):
    cluster = start_compose_mpi(2)
    args = TRAIN.replace("--checkpoint-every 5", "--checkpoint-every 1").replace(
        "--global-batch-size 48", "--global-batch-size 64")
    watcher = subprocess.Popen(["docker", "exec", cluster.container("node0"), "sh", "-c",
                                KILL_WRITER], stdout=subprocess.PIPE, text=True)
    training = start_training(cluster, 2, args)
    try:
        killed_in = watcher.communicate(timeout=300)[0].strip()
    finally:
        watcher.kill()
    status, output = finish(training, EXIT_WITHIN)
    assert status != 0, output
    partial_step = int(re.search(r"\.ckpt-(\d+)\.pt", killed_in).group(1))

    assert cluster.exec("node1", f"test -e {killed_in}").returncode == 0, "no partial file"
    newest = cluster.check("node1", NEWEST_VALID)
    step = int(re.search(r"newest ckpt-(\d+)\.pt", newest).group(1))
    assert step < partial_step, f"the half-written step {partial_step} became valid:\n{newest}"

    resumed = invoke_run(cluster, 2, "launcher.train", resuming(args))
    assert resumed.returncode == 0, resumed.stdout
    assert "killed mid-write" in resumed.stdout
    assert f"(step {step}," in resumed.stdout, resumed.stdout
