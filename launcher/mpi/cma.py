"""Whether MPI's single-copy transfers (CMA) can work between the ranks of this node.

MPICH and Open MPI copy large intra-node messages with ``process_vm_readv`` (cross-memory
attach). The kernel allows it only between processes that may ptrace each other: not across
user namespaces (one ``ch-run`` or rootless ``apptainer exec`` per rank), not under Docker's
default seccomp profile, not with Yama's ``ptrace_scope`` >= 1 between siblings. Where it is
refused, MPICH 5.0.2's non-blocking collectives complete with WRONG data; where it works,
turning it off costs half the bandwidth (benchmarks/README.md, "The container's cost").

So each node decides from evidence, before MPI starts (``probe``): every local rank publishes
its user namespace, its pid and the address of a buffer of random bytes in a small file under
``/dev/shm/ddp-cma-KEY/`` (the host's, shared by the containers of one node), reads the next
local rank's buffer with ``process_vm_readv`` and writes what it saw. Local rank 0 decides
(``decide``: on only when every rank is in one user namespace and every read returned the
right bytes), writes the decision for the others, and removes the directory once each rank
has removed its own files. A rank that does not show up within ``TIMEOUT_S`` makes the node's
decision "off", never a hang; the files go in every case.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.core.atomic import write_atomic
from launcher.placement.env import JobEnv

#: seconds local rank 0 waits for the others' evidence; theirs for its decision is longer, so
#: that rank 0 always decides first and no rank decides alone
TIMEOUT_S = 20.0
#: what CMA off costs, from benchmarks/README.md ("The container's cost")
COST = ("large intra-node messages are copied twice, all_reduce of 2 ranks at 0.46x the "
        "speed at 16 MiB and 0.63x at 1 MiB (benchmarks/README.md)")
#: processes that start a job's ranks on a node, one per job and node: their pid names the job
LAUNCH_DAEMONS = ("hydra_pmi_proxy", "slurmstepd", "prted", "orted", "prterun", "mpirun",
                  "mpiexec", "mpiexec.hydra", "torchrun")
_POLL_S = 0.005
_TOKEN_BYTES = 64


@dataclass(frozen=True)
class Evidence:
    """What one local rank saw: its user namespace, and ``read`` empty when the next local
    rank's buffer came back with the right bytes, else why not (``EPERM``, ``wrong bytes``)."""

    local_rank: int
    user_ns: str
    read: str


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: str
    #: False where the node's ranks were found in several user namespaces
    one_namespace: bool = True

    def line(self, env: JobEnv) -> str:
        """The node's one line: the decision, why, and what off costs."""
        head = f"MPI single-copy transfers (CMA) on {env.hostname}: "
        return head + (f"on: {self.reason}" if self.on else f"off: {self.reason}; cost: {COST}")


def decide(evidence: list[Evidence], local_size: int, ptrace_scope: int | None = None,
           waited_s: float = TIMEOUT_S) -> Decision:
    """The node's decision from every local rank's ``evidence`` (pure)."""
    if len(evidence) < local_size:
        return Decision(False, f"only {len(evidence)} of {local_size} local ranks reported "
                        f"within {waited_s:g} s (not all of them run the launcher's Python)")
    namespaces = {e.user_ns for e in evidence}
    if len(namespaces) > 1:
        return Decision(False, f"the {local_size} local ranks are in {len(namespaces)} user "
                        "namespaces (one container per rank: ch-run without --join, rootless "
                        "apptainer without --sharens); run them in one", one_namespace=False)
    failed = sorted({e.read for e in evidence if e.read})
    if failed:
        if "EPERM" in failed and ptrace_scope:
            why = f"Yama ptrace_scope={ptrace_scope} forbids it"
        elif {"EPERM", "ENOSYS"} & set(failed):
            why = "blocked by a seccomp profile (Docker's default) or the kernel"
        else:
            why = "the kernel refused or returned other bytes"
        return Decision(False, f"process_vm_readv between local ranks failed "
                        f"({', '.join(failed)}): {why}")
    return Decision(True, f"{local_size} local ranks in one user namespace read each other's "
                    "memory")


# -- the effect: evidence from the node's ranks ------------------------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def read_peer(pid: int, address: int, expected: bytes) -> str:
    """Read ``len(expected)`` bytes at ``address`` in process ``pid``: "" when they are
    ``expected``, else why not (the errno's name, or "wrong bytes")."""
    libc = ctypes.CDLL(None, use_errno=True)
    local = ctypes.create_string_buffer(len(expected))
    mine = _IoVec(ctypes.addressof(local), len(expected))
    theirs = _IoVec(address, len(expected))
    done = libc.process_vm_readv(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
    if done < 0:
        return errno.errorcode.get(ctypes.get_errno(), "error")
    return "" if local.raw[:done] == expected else "wrong bytes"


def ptrace_scope() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    return None


def job_key(env: JobEnv) -> str:
    """A name the local ranks of one job share and no other job on the node has: the pid and
    start time of the nearest ancestor that launched the ranks (Hydra's proxy, slurmstepd, Open
    MPI's prted), so that a runtime between it and the rank (apptainer's starter) does not
    matter, and files a killed probe left behind never meet a later job with the same pid."""
    pid = os.getppid()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if name in LAUNCH_DAEMONS:
            return f"{env.launcher}-{pid}-{fields[19]}"  # field 22 of stat(5): its start time
        pid = int(fields[1])
    return f"{env.launcher}-{env.job_id or ''}-{env.master_port or ''}-{os.getppid()}"


def _wait_for(path: Path, deadline: float) -> dict | None:
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads(path.read_text())
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)


def _write(path: Path, record: dict) -> None:
    write_atomic(path, json.dumps(record).encode())


def probe(env: JobEnv, root: Path = Path("/dev/shm"), timeout: float = TIMEOUT_S) -> Decision:
    """This node's decision, agreed by its ``env.local_world_size`` ranks (module docstring)."""
    rank, size = env.local_rank, env.local_world_size
    directory = root / f"ddp-cma-{job_key(env)}"
    token = os.urandom(_TOKEN_BYTES)
    buffer = ctypes.create_string_buffer(token, len(token))
    user_ns = os.readlink("/proc/self/ns/user")
    start = time.monotonic()
    mine = [directory / f"rank{rank}", directory / f"read{rank}"]
    try:
        _write(mine[0], {"pid": os.getpid(), "address": ctypes.addressof(buffer),
                         "token": token.hex()})
        peer = _wait_for(directory / f"rank{(rank + 1) % size}", start + timeout)
        read = ("no peer" if peer is None else
                read_peer(peer["pid"], peer["address"], bytes.fromhex(peer["token"])))
        _write(mine[1], {"user_ns": user_ns, "read": read, "pid": os.getpid()})
        if rank == 0:
            return _decide_for_node(directory, size, start + timeout, timeout)
        # rank 0 decides by its own deadline; this one waits longer, so both agree
        record = _wait_for(directory / "decision", start + 2 * timeout)
        if record is None or record["pids"][rank] != os.getpid():
            return Decision(False, f"local rank 0 gave no decision within {2 * timeout:g} s")
        return Decision(record["on"], record["reason"], record["one_namespace"])
    finally:
        for path in mine:
            path.unlink(missing_ok=True)
        del buffer  # readers are done: the decision exists only after every read
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        else:  # rank 0 never came: the last one out removes the directory
            with contextlib.suppress(OSError):
                directory.rmdir()


def node_decision(env: JobEnv) -> Decision:
    """``probe``, with "off" when the probe itself cannot run (no writable /dev/shm)."""
    try:
        return probe(env)
    except OSError as error:
        return Decision(False, f"could not compare the local ranks ({error})")


def _decide_for_node(directory: Path, size: int, deadline: float, timeout: float) -> Decision:
    reports = [_wait_for(directory / f"read{r}", deadline) for r in range(size)]
    evidence = [Evidence(r, report["user_ns"], report["read"])
                for r, report in enumerate(reports) if report is not None]
    decision = decide(evidence, size, ptrace_scope(), timeout)
    pids = [report["pid"] if report else 0 for report in reports]
    _write(directory / "decision", {"on": decision.on, "reason": decision.reason,
                                    "one_namespace": decision.one_namespace, "pids": pids})
    # the others remove their own files once they have read it; then the directory can go
    others = {f"rank{r}" for r in range(1, size)} | {f"read{r}" for r in range(1, size)}
    while time.monotonic() < deadline + timeout and others & {p.name for p in
                                                              directory.iterdir()}:
        time.sleep(_POLL_S)
    return decision
