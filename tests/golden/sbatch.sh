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

run_dir=runs/train
status_file=runs/train/exit-status
lost_file=runs/train/lost-nodes
attempts_log=runs/train/attempts.log
ranks_dir=runs/train/ranks
# requeues after a lost or slow node, per job (preemptions are not counted)
max_restarts=3
# a previous attempt's ending must not decide this one
rm -rf "$status_file" "$lost_file" "$ranks_dir"

# One line per attempt in the run directory, which the ranks make: when, which job and
# attempt, where, what. Not made here: a run directory missing on this host is another path
# inside the container, and this one would be a stray.
log_attempt() {
    [ -d "$run_dir" ] && echo "$(date -u +%FT%TZ) job $SLURM_JOB_ID" \
        "attempt $((SLURM_RESTART_COUNT + 1)) on $SLURM_JOB_NODELIST: $*" >> "$attempts_log"
}

# Requeue this job: the next attempt resumes from the last checkpoint. scontrol requeue ends
# this script with SIGTERM (SIGKILL after KillWait): ignored, so the lines after it still run.
requeue() {
    trap '' TERM
    scontrol requeue "$SLURM_JOB_ID"
}

# The nodes that went quiet first (their ranks killed, or the node lost), when no rank could
# say: the ranks' records left in $ranks_dir (launcher.faults.rank_record). A record's first
# line is its node; more lines are a traceback (a fatal signal ended the rank); a node's newest
# record is when it was last known alive (one rank per node touches its record). Silent nodes
# from before the first crash, or from 30 s before the last record, are lost (a
# survivor may crash, or hang until srun's --wait ends it, when its peer dies). Prints the
# crashes; none lost when nobody can tell. One pass over the records by one awk: O(ranks) reads,
# no process per record (16,000 records: 0.2 s, against 52 s with three processes per record).
quiet_first() {
    find "$ranks_dir" -type f -printf '%T@ %p\n' 2> /dev/null | awk -v gap=30 \
        -v job="$SLURM_JOB_ID" '
        {
            path = substr($0, index($0, " ") + 1); lines = 0; node = ""; second = ""
            while ((getline text < path) > 0 && ++lines <= 2) {
                if (lines == 1) node = text; else second = text
            }
            close(path)
            if (lines > 1) {
                printf "job %s: rank %s on %s: %s (traceback: %s)\n", job,
                    substr(path, match(path, /[^\/]*$/)), node, second, path > "/dev/stderr"
                if (first == "" || $1 < first) first = $1
                crashed[node] = 1
            }
            if (!(node in at) || $1 > at[node]) at[node] = $1
            if ($1 > last) last = $1
        }
        END {
            limit = first != "" ? first : last - gap
            for (n in at) if (!(n in crashed) && at[n] <= limit) print n
        }' | sort -u | paste -sd,
}

# Requeue without the nodes $1 (comma-separated; none when empty) because of $2: exits the
# script, or returns 1 when this job used all its restarts (counted in the attempt log, so a
# log that cannot be written means no requeue).
requeue_without() {
    local restarts excluded
    restarts=$(grep -c "^[^ ]* job $SLURM_JOB_ID .*: restart [0-9]* of " "$attempts_log" \
        2> /dev/null)
    if [ "${restarts:-0}" -ge "$max_restarts" ]; then
        log_attempt "$2; all $max_restarts restarts used"
        return 1
    fi
    log_attempt "$2: restart $((restarts + 1)) of $max_restarts${1:+ without $1}" || return 1
    echo "job $SLURM_JOB_ID: $2: requeueing${1:+ without $1}" >&2
    [ -z "$1" ] || excluded=$(scontrol show job "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*')
    excluded=${excluded#ExcNodeList=}
    [ "$excluded" != "(null)" ] || excluded=
    requeue || exit
    # only a pending job takes a new ExcNodeList: after the requeue, before it starts again
    [ -z "$1" ] || scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="${excluded:+$excluded,}$1"
    exit
}

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
    lost=$(paste -sd, "$lost_file" 2> /dev/null)
elif [ "$status" -ne 0 ] && lost=$(quiet_first) && [ -n "$lost" ]; then
    echo "job $SLURM_JOB_ID: exit $status and no rank said why; the ranks on $lost ended" \
        "first without a word (killed, or the node lost): exit 3" >&2
    status=3
fi
# each rank's own output, whole, beside the job log's (launcher.core.rank_output)
[ "$status" -eq 0 ] || [ ! -d "$run_dir/logs" ] ||
    echo "job $SLURM_JOB_ID: each rank's output: $run_dir/logs/rank-R.log" >&2
case $status in
    75)
        # the ranks caught the signal and saved a checkpoint: requeue, the next run resumes
        # from it. Exit with scontrol's status: the job fails only when the requeue failed.
        log_attempt "exit 75 (preempted): requeue"
        echo "job $SLURM_JOB_ID preempted (exit 75): requeueing" >&2
        requeue
        exit $?
        ;;
    3)
        # a peer was lost: requeue without the nodes the survivors named or that went quiet
        # first (none: with the same nodes excluded as before); once the restarts are used
        # up, pass it on
        requeue_without "$lost" "exit 3, lost ${lost:-a node nobody named}"
        ;;
esac
log_attempt "exit $status: passed on"
exit "$status"
