#!/bin/bash
# Written by `invoke sbatch`; docs/launching.md explains each line.
#SBATCH --job-name=ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --partition=gpu
#SBATCH --account=proj42
#SBATCH --signal=USR2@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

status_file=runs/train/exit-status
rm -f "$status_file"  # a previous attempt's ending must not decide this one
srun --nodes 2 --ntasks-per-node 4 --gpus-per-node 4 --cpus-per-task 8 --mpi=pmi2 --kill-on-bad-exit=0 --wait=60 \
    --export=ALL,APPTAINERENV_PYTHONUNBUFFERED=1,APPTAINERENV_OMP_NUM_THREADS=8,APPTAINERENV_DDP_PREEMPT_SIGNAL=USR2,APPTAINER_SHARENS=true \
    apptainer exec --nv --bind /scratch ddp-cpu.sif \
    python -m launcher.train --resume auto --epochs 3
status=$?
# A rank that knows how the job ended wrote it to the run directory: it decides, since
# torchrun exits 1 and srun 128 + N (a rank a signal ended) whatever the ranks knew.
if [ "$status" -ne 0 ] && [ -s "$status_file" ]; then
    read -r status reason < "$status_file"
    echo "job $SLURM_JOB_ID: the ranks report exit $status: $reason" >&2
fi
# 75: the ranks caught the signal and saved a checkpoint. Requeue: the next run
# resumes from it. Exit with scontrol's status, so the job counts as failed only when the
# requeue itself failed.
if [ "$status" -eq 75 ]; then
    echo "job $SLURM_JOB_ID preempted (exit 75): requeueing" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit $?
fi
# 3, a peer was lost: passed on, since requeueing without the lost node is
# not done yet; every other status is passed on too.
exit "$status"
