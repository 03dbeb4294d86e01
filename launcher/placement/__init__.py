"""Where this process is in the job, read from its environment alone.

Where this process is in the job, read without communicating: which launcher started it
(``detectors``), the one immutable ``JobEnv`` (``env``), Slurm host lists and ports, the network
interface, /dev/shm and memlock.

May import: ``launcher.core``. The host side imports ``shm``, ``hostlist`` and ``env`` from
here, so nothing here imports torch at module level.
"""
