"""Where this process is in the job, read from its environment alone.

Read without communicating: which launcher started this process (one class per launcher in
``detectors``, Slurm's in ``slurm_detector``, the rules across them in ``detection``, strict
reading in ``variables``), the one immutable ``JobEnv`` (``env``), Slurm host lists and ports,
the network interface, /dev/shm and memlock; and the one writer of the environment
(``settings``: what a rank sets for the libraries it loads, and why).

May import: ``launcher.core``. The host side imports ``shm``, ``hostlist`` and ``env`` from
here, so nothing here imports torch at module level.
"""
