"""ddp launcher: run the same PyTorch DDP entry point under mpirun, srun, torchrun or python.

Data flows one way: environment (``launcher.placement``) -> process group (``launcher.group``)
-> training loop (``launcher.training``) -> checkpoints (``launcher.api.checkpoint``). The
subpackages are layered: each imports only from the layers listed before it in ``LAYERS``
(tests/test_imports.py holds them to it; docs/contributing.md shows them). The modules at
this level are the entry points ``python -m launcher.train|check|env``.

The public API for a training script of your own (docs/api.md)::

    import launcher

    with launcher.distributed() as job:
        ...

``distributed`` and ``Job`` come from ``launcher.api.job``, ``exit_statuses`` from
``launcher.faults.exits``, ``LaunchError`` from ``launcher.core.errors``, ``GlobalBatchSampler``
from ``launcher.training.batches``. They are loaded on first use: importing a submodule (as the
image's interpreter does at start-up to choose the MPI) does not import torch.
"""

__version__ = "0.1.0"

#: the subpackages from the bottom up; a layer imports from the layers before it, never after
#: it, and the layers of one tuple not from each other
LAYERS = (("core",), ("placement",), ("faults",), ("mpi",), ("group",), ("api",),
          ("training", "diagnostics"))

_PUBLIC = {"distributed": "launcher.api.job", "Job": "launcher.api.job",
           "exit_statuses": "launcher.faults.exits", "LaunchError": "launcher.core.errors",
           "GlobalBatchSampler": "launcher.training.batches"}
__all__ = sorted(_PUBLIC)


def __dir__() -> list[str]:
    # the lazy names too, so that tab completion and dir(launcher) show the API
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'launcher' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
