"""A peer that stopped answering: recognise the failure and say which ranks and hosts are gone.

A communication failure (a peer died, the network was cut, a collective timed out) comes out of
torch as a RuntimeError full of C++ locations. ``diagnose`` turns it into one ``PeerLost``
naming the ranks and nodes whose heartbeats stopped (``launcher.faults.heartbeat``).
"""

from __future__ import annotations

import re

import torch.distributed as dist

from launcher.core.errors import PeerLost
from launcher.faults import hang_watch, heartbeat
from launcher.placement.env import JobEnv

#: each rank's host name, set in the store at the rendezvous
HOST_KEY = "ddp/host"
#: what torch and gloo put around the one useful clause: "[/path/pair.cc:553] " and
#: "Got the following error when running the callback: RuntimeError: " (repeated)
_NOISE = re.compile(
    r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*|Got the following error when running the callback: \w+: "
)
_COMMUNICATION_WORDS = re.compile(
    r"gloo|nccl|timed out|timeout|connection|socket|peer|broken pipe", re.IGNORECASE
)


def is_communication_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMMUNICATION_WORDS.search(str(exc)))


def first_line(exc: BaseException) -> str:
    """The one useful clause of a torch error, without C++ locations and frame dumps."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _NOISE.sub("", line).split(". This is typically")[0]


def diagnose(env: JobEnv, backend: str, exc: BaseException,
             beat: heartbeat.Heartbeat | None = None,
             watch: hang_watch.HangWatch | None = None) -> PeerLost:
    """``exc`` explained by ``beat``, this rank's heartbeats (``launcher.faults.heartbeat``):
    which ranks fell silent; ``watch``, the hang watch, first says whether the ranks are alive
    but not meeting. Beats outlive a broken group and a stopped peer alike, so no store is
    asked."""
    failed = (f"rank {env.rank} on {env.node_name} lost contact in the {backend} process "
              f"group{hang_watch.in_call()} ({first_line(exc)})")
    if beat is None:
        return PeerLost(failed, heartbeat.HINT)
    if watch is not None:
        watch.await_verdict()  # ranks alive but not meeting, or ended: one line, exit 4
    silent = beat.settle()
    if not silent:
        return PeerLost(f"{failed}: every rank still beats", heartbeat.HINT)
    return beat.lost(failed, silent)
