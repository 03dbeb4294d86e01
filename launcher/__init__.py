"""ddp launcher: run the same PyTorch DDP entry point under mpirun, srun, torchrun or python.

Data flows one way: environment (``launcher.env``) -> process group
(``launcher.process_group``) -> training loop (``launcher.train``) -> checkpoints
(``launcher.checkpoint``).
"""

__version__ = "0.1.0"
