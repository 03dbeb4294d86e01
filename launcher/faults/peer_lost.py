"""A peer that stopped answering: recognise the failure and say which ranks and hosts are gone.

A communication failure (a peer died, the network was cut, a collective timed out) comes out of
torch as a ``DistError`` (nccl, the store) or, from gloo, as a RuntimeError whose text names
the C++ line of gloo or c10d that threw it (or, passed on by a callback that torch ran, the
type of what was raised there). ``diagnose`` turns it into one ``PeerLost``
naming the ranks and nodes whose heartbeats stopped (``launcher.faults.heartbeat``). Anything
else is the rank's own failure, whatever its words ("DataLoader timed out after 5 seconds").
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
#: where gloo's transport and c10d throw from, in the text of what they throw (also when a
#: callback passes it on): "[.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection
#: closed by peer", "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting". Not
#: the words: a local error says "timed out" too; and gloo's checks of a call's own arguments
#: ("ProcessGroupGloo::broadcast: invalid root rank: 7") carry no location
_TRANSPORT_LOCATION = re.compile(r"\[[^\]]*(?:/gloo/|/c10d/)[^\]]*\.(?:cc|cpp|h):\d+\]")
#: what torch makes of an exception raised where it runs a callback (DDP's reducer waiting on
#: the Work of a backend written in Python: the mpi backend's waits raise ``PeerLost``): a
#: RuntimeError that names its type, "... when running the callback: PeerLost: ..."
_CALLBACK_ERROR = re.compile(r"when running the callback: (\w+): ")
_COMMUNICATION_ERRORS = {cls.__name__ for cls in (PeerLost, dist.DistError, dist.DistBackendError,
                                                  dist.DistNetworkError, dist.DistStoreError)}


def is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the communication failing (a peer, the network), not this rank's
    own error: a ``DistError``, gloo's transport (a collective, a Work's wait, DDP's
    reducer), or either of them or a lost peer passed on by a callback. The failed call's
    entry in the flight recorder does not tell: a call's own checks of its arguments fail it
    as well."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return bool(_TRANSPORT_LOCATION.search(text)) or any(
        name in _COMMUNICATION_ERRORS for name in _CALLBACK_ERROR.findall(text))


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
