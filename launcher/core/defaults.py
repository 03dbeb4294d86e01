"""Defaults that several parts must agree on, written once. Standard library only: the host side
(``ddp_tasks``) reads them too."""

#: the signal a scheduler sends before preemption, as ``DDP_PREEMPT_SIGNAL`` and
#: ``sbatch --signal`` name it (without "SIG")
PREEMPT_SIGNAL = "USR1"

#: seconds a collective, and each start-up stage, may wait on a peer that no longer beats
TIMEOUT_S = 300.0
