"""Which of /proc/self/maps' files are MPICH segments whose names can go."""

from __future__ import annotations

from launcher.mpi.segments import mapped

MAPS = """\
7f00a000-7f00b000 rw-s 00000000 00:1a 41 /dev/shm/mpich_shm_b08c446_0
7f00b000-7f00c000 rw-s 00000000 00:1a 41 /dev/shm/mpich_shm_b08c446_0
7f00c000-7f00d000 rw-s 00000000 00:1a 42 /dev/shm/mpich_shm_347bf65e_0 (deleted)
7f00d000-7f00e000 rw-s 00000000 00:1a 43 /dev/shm/ch-run_shm-15306
7f00e000-7f00f000 r-xp 00000000 08:01 44 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00f000-7f010000 rw-p 00000000 00:00 0
"""


def test_only_named_mpich_segments_of_dev_shm():
    assert mapped(MAPS) == ["/dev/shm/mpich_shm_b08c446_0"]
