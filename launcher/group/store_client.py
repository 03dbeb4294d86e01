"""A client of rank 0's rendezvous store (``launcher.group.rendezvous``): wait quietly until
something listens, then bounded attempts that tell a late store from another program holding the
port; and whether torchrun's agent serves the store already."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from launcher.core.errors import LaunchError
from launcher.faults.c10d_log import quiet_c10d
from launcher.faults.peer_lost import first_line
from launcher.placement.env import JobEnv

#: seconds of one attempt to reach rank 0's store; a store answers within milliseconds
CONNECT_ATTEMPT_S = 3.0


def agent_store_listens(env: JobEnv) -> bool:
    """Whether torchrun's agent already serves the store at the rendezvous address: it binds
    it before it starts the workers (TORCHELASTIC_USE_AGENT_STORE), and a rank 0 that binds it
    again gets an error logged by torch (which then joins as a client anyway). Ranks started
    by hand with RANK and MASTER_PORT (no agent: no TORCHELASTIC_RUN_ID) host it themselves."""
    if env.launcher != "torchrun" or env.job_id is None:
        return False
    try:
        socket.create_connection((env.master_addr, env.master_port), timeout=1).close()
    except OSError:
        return False
    return True


def connect(env: JobEnv, timeout: timedelta) -> dist.Store:
    """A client of rank 0's store, once something listens at its address (until ``timeout``).

    Waiting for the listener happens here, quietly: torch's client logs every failed attempt
    with a C++ stack. What then answers gets bounded attempts: torch's own client retries for
    its whole timeout when that is not a store, and hangs for good when it accepts and never
    replies. Only an attempt that timed out is made again (rank 0's store, slow on a loaded
    node); a reply that is not a store's, or none at all, is named at once.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            socket.create_connection((env.master_addr, env.master_port), timeout=1).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rank {env.rank}: nothing listens at {env.master_addr}:{env.master_port} "
                    f"after {timeout.total_seconds():.0f} s ({exc}): rank 0 did not start the "
                    "rendezvous (look at its error), or this node cannot reach it",
                    hint=port_hint(env)) from None
            time.sleep(0.2)
    while True:
        outcome = _attempt(env)
        if isinstance(outcome, dist.Store):
            outcome.set_timeout(timeout)
            return outcome
        # a store that answers late (rank 0 on a loaded node) times out; a program that is
        # not a store hangs the attempt or answers with something else
        if not _timed_out(outcome) or time.monotonic() > deadline:
            raise _foreign_listener(env, outcome)


def _attempt(env: JobEnv) -> dist.Store | Exception | None:
    """One bounded try at rank 0's store: the store, torch's error, or None when what answers
    accepted and never replied (torch's client would then wait for good)."""
    outcome: list = []

    def attempt() -> None:
        try:
            outcome.append(dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                         is_master=False,
                                         timeout=timedelta(seconds=CONNECT_ATTEMPT_S)))
        except (RuntimeError, ValueError) as exc:
            outcome.append(exc)

    # a store answers the first try; anything else would be logged with a C++ stack per retry
    with quiet_c10d():
        thread = threading.Thread(target=attempt, name="ddp-rendezvous", daemon=True)
        thread.start()
        thread.join(CONNECT_ATTEMPT_S + 3)
    return outcome[0] if outcome else None


def _timed_out(outcome: Exception | None) -> bool:
    return outcome is not None and "timed out" in first_line(outcome).lower()


def _foreign_listener(env: JobEnv, error: Exception | None) -> LaunchError:
    what = first_line(error) if error is not None else "accepted, then no reply"
    return LaunchError(
        f"rank {env.rank}: {env.master_addr}:{env.master_port} answers, but not as rank 0's "
        f"rendezvous store ({what}): another program holds the port, so rank 0 could not "
        "start the rendezvous there",
        hint=port_hint(env),
    )


def port_hint(env: JobEnv) -> str:
    return (f"set MASTER_PORT to a port free on {env.master_addr} in every rank's environment "
            "(under Slurm the port is derived from the job and step ids, outside the node's "
            "ephemeral range: run the step again, it gets another)")
