"""MPI under torch: which libmpi, CMA, the mpi backend (Python, compiled), segments.

Which libmpi a rank loads (``library``, also run at interpreter start-up by the image's
``.pth`` line), whether single-copy transfers work (``cma``), the torch.distributed backend on
mpi4py (``backend``: its set-up; ``operations``: the group, its ops in ``reductions`` and
``movement``; ``buffers``, ``waiting``), the same compiled (``cxx``, its C++ in ``cxx.cpp`` and
the parts it includes: ``cxx_types.h``, ``cxx_work.h``, ``cxx_queue.h``, ``cxx_build.h``,
``cxx_backend.h``),
MPICH's shared-memory segments, and its UCX address padded for Slurm's pmi2 (``ucx_address``).

May import: ``launcher.core``, ``launcher.placement``, ``launcher.faults``.
"""
