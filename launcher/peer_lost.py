"""A peer that stopped answering: recognise the failure and say which ranks and hosts are gone.

A communication failure (a peer died, the network was cut, a collective timed out) comes out of
torch as a RuntimeError full of C++ locations. ``diagnose`` turns it into one ``PeerLost``
naming the ranks and hosts that no longer answer a roll call through the rendezvous store,
which outlives a broken process group.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.env import JobEnv
from launcher.errors import PeerLost

#: each rank's host name, set in the store at the rendezvous
HOST_KEY = "ddp/host"
#: each rank's node name (``JobEnv.node_name``), set in the store by ``enrol``
NODE_KEY = "ddp/node"
_ALIVE_KEY = "ddp/alive"
_DONE_KEY = "ddp/roll-call-read"
#: how long survivors of a failure wait for each other to answer the roll call
ROLL_CALL_S = 10.0
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


@contextmanager
def quiet_c10d() -> Iterator[None]:
    """c10d's C++ log silenced inside: where a failure is expected or known, each store call
    that fails logs it again with a C++ stack, and the one message this code prints says it
    all. The level is restored on the way out."""
    try:
        libc10 = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        level = ctypes.c_int.in_dll(libc10, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # another build of torch: its noise stays
        yield
        return
    saved, level.value = level.value, 3  # FATAL only
    try:
        yield
    finally:
        level.value = saved


#: what to do after a lost peer, wherever it is reported
HINT = ("look at the named node (died, out of memory, stopped, cut off the network); then run "
        "the same command again: it continues from the last checkpoint (launcher.train's "
        "--resume auto, job.resume in a script of your own)")


def enrol(env: JobEnv, store: dist.Store) -> None:
    """Leave this rank's node name in the store, for a roll call that finds it silent."""
    store.set(f"{NODE_KEY}/{env.rank}", env.node_name)


def diagnose(env: JobEnv, backend: str, store: dist.Store | None,
             exc: BaseException) -> PeerLost:
    with quiet_c10d():
        who, nodes = _roll_call(env, store) if store is not None else (None, ())
    return PeerLost(
        f"rank {env.rank} on {env.node_name} lost contact in the {backend} process group"
        + (f": {who}" if who else "") + f" ({first_line(exc)})",
        hint=HINT, nodes=nodes,
    )


def _roll_call(env: JobEnv, store: dist.Store) -> tuple[str, tuple[str, ...]]:
    """Which ranks still answer through the rendezvous store (hosted by rank 0), and the node
    names of those that do not."""
    try:
        silent = _silent_ranks(env, store)
        hosts = [_host_of(store, rank) for rank in silent]
        store.set(f"{_DONE_KEY}/{env.rank}", "1")
        if env.is_main:
            # the store lives in this process, which exits next: stay until the survivors
            # have read what they need
            answered = [r for r in range(env.world_size) if r not in silent]
            _wait_for(store, [f"{_DONE_KEY}/{r}" for r in answered])
    except Exception:  # any failure means the same: the store is gone
        return (f"rank 0's rendezvous store at {env.master_addr}:{env.master_port} does not "
                f"answer either: rank 0's node is lost, or {env.node_name} is cut off"), ()
    if not silent:
        return "every rank still answers the rendezvous store", ()
    names = ", ".join(f"rank {rank} ({host})" for rank, host in zip(silent, hosts, strict=True))
    return (f"no answer within {ROLL_CALL_S:.0f} s from {names}",
            tuple(dict.fromkeys(h for h in hosts if h != "?")))


def _silent_ranks(env: JobEnv, store: dist.Store) -> list[int]:
    store.set(f"{_ALIVE_KEY}/{env.rank}", env.hostname)
    return _wait_for(store, [f"{_ALIVE_KEY}/{rank}" for rank in range(env.world_size)],
                     missing_as=range(env.world_size))


def _wait_for(store: dist.Store, keys: list[str], missing_as=None) -> list:
    """Wait up to ROLL_CALL_S for ``keys``; the entries of ``missing_as`` (default: the keys)
    whose key did not appear."""
    labels = list(missing_as) if missing_as is not None else keys
    deadline = time.monotonic() + ROLL_CALL_S
    missing = []
    for key, label in zip(keys, labels, strict=True):
        remaining = timedelta(seconds=max(0.1, deadline - time.monotonic()))
        try:
            store.wait([key], remaining)
        except dist.DistStoreError:  # the wait timed out: nobody set that key
            missing.append(label)
    return missing


def _host_of(store: dist.Store, rank: int) -> str:
    """The rank's node name where it enrolled, else its host name from the rendezvous."""
    for key in (f"{NODE_KEY}/{rank}", f"{HOST_KEY}/{rank}"):
        if store.check([key]):
            return store.get(key).decode()
    return "?"
