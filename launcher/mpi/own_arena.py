"""``MPI_Init_thread`` on a thread of its own, and so in a malloc arena of its own, for the
bundled MPICH under Slurm's pmi2 server where its UCX address is not padded.

MPICH 5.0.2 puts 4 KiB from the start of each rank's UCX address into the PMI, in hex segments
of up to ~1,000 characters, fewer where bytes repeat; the address is ~300-700 bytes, the rest is
whatever the heap held after it. Slurm's pmi2 server reads a PMI-1 line of at most 1,024 bytes:
a longer one is misparsed ("mpi/pmi2: value not properly terminated in client request", "invalid
client request") and MPI_Init fails or hangs. ``launcher.mpi.ucx_address`` pads the address with
zeros where it is built (a compiler at bootstrap, the image); this is what is left where it is
not. A new thread allocates from a malloc arena of its own, new where glibc makes one (not one
an exited thread left): what follows the address is then MPI_Init's own allocations, not those
of torch's import. From the main thread of a rank that has imported torch the longest line was
~860 bytes, over the limit now and then in full test runs; from a new thread ~700-820 (the path
the venv is at changes it), and once over it in CI (2026-11-28). MPICH allows any thread to
start MPI at MPI_THREAD_MULTIPLE; ``MPI.Is_thread_main()`` is then false in the rank's main
thread.
"""

from __future__ import annotations

import threading


def run(start) -> None:
    """``start()`` (what starts MPI) on a new thread; its error raised here."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            start()
        except BaseException as error:  # noqa: BLE001 -- handed to the caller's thread
            errors.append(error)

    # the stack's size does not matter (9 MiB of new pages measured the same, 2026-11-28)
    thread = threading.Thread(target=body, name="ddp-mpi-init")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
