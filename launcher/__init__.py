"""ddp launcher: run the same PyTorch DDP entry point under mpirun, srun, torchrun or python.

Data flows one way: environment (``launcher.env``) -> process group
(``launcher.process_group``) -> training loop (``launcher.train``) -> checkpoints
(``launcher.checkpoint``).

The public API for a training script of your own (docs/api.md)::

    import launcher

    with launcher.distributed() as job:
        ...

``distributed``, ``Job`` and ``exit_statuses`` come from ``launcher.job``, ``LaunchError``
from ``launcher.errors``, ``GlobalBatchSampler`` from ``launcher.batches``. They are loaded on
first use: importing a submodule (as the image's interpreter does at start-up to choose the
MPI) does not import torch.
"""

__version__ = "0.1.0"

_PUBLIC = {"distributed": "launcher.job", "Job": "launcher.job",
           "exit_statuses": "launcher.job", "LaunchError": "launcher.errors",
           "GlobalBatchSampler": "launcher.batches"}
__all__ = sorted(_PUBLIC)


def __dir__() -> list[str]:
    # the lazy names too, so that tab completion and dir(launcher) show the API
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'launcher' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
