"""The process group: backend, rendezvous, GPU sharing, start-up bounds.

Which backend (``backends``), the rendezvous address, port and store,
GPU sharing, the bound on each start-up stage, and ``process_group`` that sets it all up and
tears it down.

May import: ``launcher.core``, ``launcher.placement``, ``launcher.faults``, ``launcher.mpi``.
"""
