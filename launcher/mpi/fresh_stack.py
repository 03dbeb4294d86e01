"""``MPI_Init_thread`` on a thread of its own, for the bundled MPICH under Slurm's pmi2 server.

MPICH 5.0.2 pads each rank's UCX address to 4 KiB with whatever its stack buffer held, and
puts it through the PMI in hex segments of up to ~1,000 characters, fewer where bytes repeat.
Slurm's pmi2 server reads a PMI-1 line of at most 1,024 bytes: a longer one is misparsed
("mpi/pmi2: value not properly terminated in client request"), its put is never answered and
MPI_Init hangs, or ranks get a corrupt address. Called from the main thread of a rank that has
imported torch, the padding is old stack frames (pointers, strings) and the longest line was
~860 bytes, over the limit now and then in full test runs. A new thread's stack is fresh,
zeroed memory: the padding compresses and the longest line is the address itself (~700 bytes
on one interface, measured 2026-11-26). MPICH allows any thread to start MPI at
MPI_THREAD_MULTIPLE; ``MPI.Is_thread_main()`` is then false in the rank's main thread.
"""

from __future__ import annotations

import threading

#: the init thread's stack: a size no exited thread's cached stack has (glibc reuses those,
#: garbage and all, for requests up to their size), so the thread gets new pages
STACK_BYTES = 9 << 20


def run(start) -> None:
    """``start()`` (what starts MPI) on a new thread; its error raised here."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            start()
        except BaseException as error:  # noqa: BLE001 -- handed to the caller's thread
            errors.append(error)

    previous = threading.stack_size(STACK_BYTES)
    try:
        thread = threading.Thread(target=body, name="ddp-mpi-init")
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if errors:
        raise errors[0]
