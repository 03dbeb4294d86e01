"""The files the ranks leave in the run directory for the batch script of ``invoke sbatch``:
the contract between ``launcher.faults.exit_status`` and ``launcher.check --preflight`` on the rank
side and ``ddp_tasks.batch_endings`` on the host. Standard library only, so that the host's
tasks read the names without importing torch."""

#: how the job ended: one line, the status and why (``launcher.faults.exit_status``)
EXIT_STATUS_FILE = "exit-status"
#: the nodes of the ranks a lost peer's survivors named, one per line
LOST_NODES_FILE = "lost-nodes"
#: the nodes ``launcher.check --preflight`` found slow, one per line (the batch script's name)
SLOW_NODES_FILE = "slow-nodes"
#: one file per running rank, left behind by a rank that ended without Python seeing it
#: (``launcher.faults.rank_record``): killed, its node lost, or crashed by a fatal signal
RANK_RECORDS_DIR = "ranks"
#: every rank's stdout and stderr, ``rank-R.log`` each (``launcher.core.rank_output``)
LOGS_DIR = "logs"
