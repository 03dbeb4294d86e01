"""MPI under torch: which libmpi, CMA, the mpi4py backend, segments.

Which libmpi a rank loads (``library``, also run at interpreter start-up by the image's
``.pth`` line), whether single-copy transfers work (``cma``), the torch.distributed backend on
mpi4py (``backend``: its set-up; ``operations``, ``buffers``, ``waiting``) and MPICH's
shared-memory segments.

May import: ``launcher.core``, ``launcher.placement``, ``launcher.faults``.
"""
