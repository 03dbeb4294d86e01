"""A real Slurm cluster (munged, slurmctld, slurmd) on this host, for the tests that need
srun/sbatch (``tests.fixtures.slurm``) and the benchmarks that time them.

Everything lives in one directory: a per-cluster munge key and socket, slurm.conf
(``ddp_tasks.slurm_conf``), state, spool and logs, so a site's own munged/Slurm (if any) keeps
running untouched beside it, and the clients only find this cluster through SLURM_CONF. A
cluster of several nodes runs each as its own ``slurmd`` on this host (its own port, spool,
pid and log file). Starting it needs root and the programs of ``INSTALL_HINT``.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ddp_tasks.slurm_conf import short_hostname
from launcher.core.errors import LaunchError

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "scontrol", "scancel", "squeue")
INSTALL_HINT = "run ./scripts/bootstrap.sh --system (installs slurm-wlm and munge), as root"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
START_TIMEOUT = 60


def missing_programs() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]


def client_env(conf: Path) -> dict[str, str]:
    """The caller's environment pointed at ``conf``.

    SLURM_*/PMI_* from an outer job are dropped: srun inside an allocation would otherwise
    try to run its steps in that allocation instead of on this cluster.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PMIX_"))}
    env["SLURM_CONF"] = str(conf)
    return env


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a pytest killed hard (pytest-timeout's thread method os._exit()s,
    # skipping fixture teardown) must not leave daemons behind
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _prepare_munge(base: Path) -> Path:
    """A munge directory owned by the munge user holding a fresh per-cluster key."""
    try:
        munge_user = pwd.getpwnam("munge")
    except KeyError:
        raise LaunchError("no 'munge' user on this machine", hint=INSTALL_HINT) from None
    directory = base / "munge"
    directory.mkdir(mode=0o755, exist_ok=True)
    key = directory / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    for path in (directory, key):
        os.chown(path, munge_user.pw_uid, munge_user.pw_gid)
    return directory


@dataclass
class JobResult:
    job_id: int
    state: str
    exit_code: str  # Slurm's "STATUS:SIGNAL", e.g. "0:0"


class SlurmCluster:
    """The daemons of one running cluster plus the client helpers the tests use."""

    def __init__(self, base: Path, conf: Path, nodes: tuple[str, ...] = ()):
        self.base = base
        self.conf = conf
        self.env = client_env(conf)
        #: the node names slurm.conf declares (this host's name for a one-node cluster)
        self.nodes = nodes or (short_hostname(),)
        self.node = self.nodes[0]
        self._procs: dict[str, subprocess.Popen] = {}

    # lifecycle

    def start(self) -> None:
        munge_dir = _prepare_munge(self.base)
        self._spawn("munged", ["munged", "--foreground",
                               f"--socket={munge_dir / 'munge.socket'}",
                               f"--key-file={munge_dir / 'munge.key'}",
                               f"--pid-file={munge_dir / 'munged.pid'}",
                               f"--log-file={munge_dir / 'munged.log'}",
                               f"--seed-file={munge_dir / 'munged.seed'}"], user="munge")
        self._wait_for(lambda: (munge_dir / "munge.socket").exists(), "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D"])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self._wait_for(self._nodes_idle, f"nodes {','.join(self.nodes)} idle in sinfo")

    def slurmd_pid(self, node: str) -> int:
        """The pid of ``node``'s slurmd: what it starts (the job's ranks there) inherits
        what is done to it, e.g. a CPU quota."""
        return self._procs[f"slurmd-{node}"].pid

    def _spawn(self, name: str, argv: list[str], user: str | None = None) -> None:
        with open(self.base / "log" / f"{name}.out", "wb") as log:
            self._procs[name] = subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, user=user,
                group=user, extra_groups=[] if user else None, preexec_fn=_die_with_parent)

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead:
                self.stop()
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n"
                                   f"{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"timed out after {START_TIMEOUT}s waiting for {what}\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        out = self._client(["sinfo", "-h", "-N", "-o", "%T"], timeout=15, check=False)
        return out.returncode == 0 and out.stdout.split() == ["idle"] * len(self.nodes)

    def stop(self) -> None:
        if self._procs.get("slurmctld") and self._procs["slurmctld"].poll() is None:
            self.cancel_all()
        # reverse start order: munged last, the Slurm daemons still need it while shutting down
        for name in reversed(list(self._procs)):
            proc = self._procs.pop(name)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)

    @contextmanager
    def mpi_default(self, plugin: str):
        """The site's ``MpiDefault`` (none, pmi2, pmix) while the block runs: what srun uses
        without ``--mpi``. srun reads slurm.conf itself; slurmd is told to re-read it too."""
        text = self.conf.read_text()
        self._replace_conf(re.sub(r"^MpiDefault=.*$", f"MpiDefault={plugin}", text, flags=re.M))
        self.scontrol(["reconfigure"])
        try:
            yield
        finally:
            self._replace_conf(text)
            self.scontrol(["reconfigure"])

    def _replace_conf(self, text: str) -> None:
        """Write slurm.conf whole, by a rename: slurmd re-reads it on its own time after a
        reconfigure, and a file written in place can be empty at that moment, which ends
        slurmd ("ClusterName needs to be specified"; seen in a full run, 2026-11-28)."""
        staged = self.conf.with_name(self.conf.name + ".new")
        staged.write_text(text)
        os.replace(staged, self.conf)

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for path in sorted([*(self.base / "log").glob("*"), self.base / "munge" / "munged.log"]):
            if path.is_file():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    # clients

    def _client(self, argv: list[str], timeout: float, check: bool = True,
                cwd: Path | str | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode}\n"
                                 f"{result.stdout}{result.stderr}\n{self.logs()}")
        return result

    def srun(self, args: list[str], timeout: float = 120, cwd: Path | str | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``srun ARGS`` to completion; the caller checks returncode/stdout/stderr.
        ``env`` adds variables (srun passes its whole environment to the tasks)."""
        try:
            return self._client(["srun", *args], timeout=timeout, check=False, cwd=cwd, env=env)
        except subprocess.TimeoutExpired:
            # the killed srun leaves its tasks running: free the node for the next test
            self.cancel_all()
            raise

    def sbatch(self, script: Path | str, args: list[str] = (),
               cwd: Path | str | None = None, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` and return its job id (``env`` adds variables, as for srun)."""
        out = self._client(["sbatch", "--parsable", *args, str(script)], timeout=30, cwd=cwd,
                           env=env)
        return int(out.stdout.strip().split(";")[0])

    def scontrol(self, args: list[str], timeout: float = 30) -> str:
        return self._client(["scontrol", *args], timeout=timeout).stdout

    def job_fields(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (values with spaces are not split correctly)."""
        line = self.scontrol(["show", "job", "-o", str(job_id)])
        return dict(item.split("=", 1) for item in line.split() if "=" in item)

    def wait_job(self, job_id: int, timeout: float = 120) -> JobResult:
        """Poll until the job reaches a terminal state; on timeout cancel it and fail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in TERMINAL_STATES:
                return JobResult(job_id, fields["JobState"], fields.get("ExitCode", ""))
            time.sleep(0.5)
        self._client(["scancel", str(job_id)], timeout=30, check=False)
        raise AssertionError(f"job {job_id} not finished after {timeout}s: "
                             f"{self.job_fields(job_id)}\n{self.logs()}")

    def cancel_all(self) -> None:
        """Cancel every job (all of them are this test run's: the cluster is private)."""
        self._client(["scancel", "--full", "--user", "root"], timeout=30, check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queue = self._client(["squeue", "-h", "-o", "%i"], timeout=15, check=False)
            if queue.returncode != 0 or not queue.stdout.strip():
                return
            time.sleep(0.5)
