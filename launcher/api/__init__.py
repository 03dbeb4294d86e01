"""The public API (launcher.distributed, Job) and its checkpoint files.

The public API a training script of its own uses (``job``: ``launcher.distributed``, ``Job``,
``launcher.exit_statuses`` from ``launcher.faults.exits``) and its checkpoint files.

May import: every layer below (``core``, ``placement``, ``faults``, ``mpi``, ``group``).
"""
