"""The shell of the batch script that decides what a job's ending means (docs/launching.md,
"Exit codes"): requeue when preempted (75), requeue without the lost nodes when a peer was
lost (3), at most ``max_restarts`` times, and pass every other status on.

The ranks of launcher.train (also under torchrun) write ``exit-status`` and ``lost-nodes`` to
the run directory (``launcher.faults.exit_status``); the script logs each attempt to
``attempts.log`` there, which also counts the restarts. When no rank could say how the step
ended, the records the ranks left in ``ranks/`` (``launcher.faults.rank_record``) tell which ones
ended first without a word: their nodes are lost.
"""

from __future__ import annotations

import shlex

from launcher.core.errors import EXIT_PEER_LOST, EXIT_PREEMPTED
from launcher.core.run_files import (
    EXIT_STATUS_FILE,
    LOGS_DIR,
    LOST_NODES_FILE,
    RANK_RECORDS_DIR,
    SLOW_NODES_FILE,
)
from launcher.faults.rank_record import TOUCH_S

#: launcher.train's --run-dir default and the file launcher.faults.exit_status writes there
TRAIN_RUN_DIR = "runs/train"
ATTEMPTS_LOG = "attempts.log"
#: where the preflight writes the slow nodes, as the script names it
SLOW_NODES = f'"$run_dir/{SLOW_NODES_FILE}"'

#: the job as scontrol names it, for a single job; an array task's is sweep.TASK_JOB in $job
JOB = "$SLURM_JOB_ID"


def _requeue(job: str) -> str:
    return f"""\
# Requeue this job: the next attempt resumes from the last checkpoint. scontrol requeue ends
# this script with SIGTERM (SIGKILL after KillWait): ignored, so the lines after it still run.
requeue() {{
    trap '' TERM
    scontrol requeue "{job}"
}}
"""


def plain_ending() -> str:
    """For a program that writes no status file: 75 requeues, every other status passes on."""
    return f"""\
{_requeue(JOB)}
# {EXIT_PREEMPTED}: the ranks caught the signal and saved a checkpoint. Requeue: the next run
# resumes from it. Exit with scontrol's status, so the job counts as failed only when the
# requeue itself failed. Every other status is passed on.
if [ "$status" -eq {EXIT_PREEMPTED} ]; then
    echo "job $SLURM_JOB_ID preempted (exit {EXIT_PREEMPTED}): requeueing" >&2
    requeue
    exit $?
fi
exit "$status"
"""


def train_prologue(run_dir: str, max_restarts: int, task: bool = False) -> str:
    """The run directory's files, the attempt log and the requeue functions. A ``task`` of a
    sweep runs in ``RUN_DIR/$config`` and is ``$job`` (``sweep.task_lines`` sets both)."""
    job = "$job" if task else JOB
    named = (("status_file", EXIT_STATUS_FILE), ("lost_file", LOST_NODES_FILE),
             ("attempts_log", ATTEMPTS_LOG), ("ranks_dir", RANK_RECORDS_DIR))
    if task:
        files = "\n".join(f'{name}="$run_dir/{file}"' for name, file in named)
        run_dir_line = f'run_dir={shlex.quote(run_dir)}/"$config"'
    else:
        files = "\n".join(f"{name}={shlex.quote(f'{run_dir}/{file}')}" for name, file in named)
        run_dir_line = f"run_dir={shlex.quote(run_dir)}"
    return f"""{run_dir_line}
{files}
# requeues after a lost or slow node, per job (preemptions are not counted)
max_restarts={max_restarts}
# a previous attempt's ending must not decide this one
rm -rf "$status_file" "$lost_file" "$ranks_dir"

# One line per attempt in the run directory, which the ranks make: when, which job and
# attempt, where, what. Not made here: a run directory missing on this host is another path
# inside the container, and this one would be a stray.
log_attempt() {{
    [ -d "$run_dir" ] && echo "$(date -u +%FT%TZ) job {job}" \\
        "attempt $((SLURM_RESTART_COUNT + 1)) on $SLURM_JOB_NODELIST: $*" >> "$attempts_log"
}}

{_requeue(job)}
{_quiet_first(job)}
{_requeue_without(job)}
"""


def _quiet_first(job: str) -> str:
    return f"""\
# The nodes that went quiet first (their ranks killed, or the node lost), when no rank could
# say: the ranks' records left in $ranks_dir (launcher.faults.rank_record). A record's first
# line is its node; more lines are a traceback (a fatal signal ended the rank); a node's newest
# record is when it was last known alive (one rank per node touches its record). Silent nodes
# from before the first crash, or from {2 * TOUCH_S:.0f} s before the last record, are lost (a
# survivor may crash, or hang until srun's --wait ends it, when its peer dies). Prints the
# crashes; none lost when nobody can tell. One pass over the records by one awk: O(ranks) reads,
# no process per record (16,000 records: 0.2 s, against 52 s with three processes per record).
quiet_first() {{
    find "$ranks_dir" -type f -printf '%T@ %p\\n' 2> /dev/null | awk -v gap={2 * TOUCH_S:g} \\
        -v job="{job}" '
        {{
            path = substr($0, index($0, " ") + 1); lines = 0; node = ""; second = ""
            while ((getline text < path) > 0 && ++lines <= 2) {{
                if (lines == 1) node = text; else second = text
            }}
            close(path)
            if (lines > 1) {{
                printf "job %s: rank %s on %s: %s (traceback: %s)\\n", job,
                    substr(path, match(path, /[^\\/]*$/)), node, second, path > "/dev/stderr"
                if (first == "" || $1 < first) first = $1
                crashed[node] = 1
            }}
            if (!(node in at) || $1 > at[node]) at[node] = $1
            if ($1 > last) last = $1
        }}
        END {{
            limit = first != "" ? first : last - gap
            for (n in at) if (!(n in crashed) && at[n] <= limit) print n
        }}' | sort -u | paste -sd,
}}
"""


def _requeue_without(job: str) -> str:
    return f"""\
# Requeue without the nodes $1 (comma-separated; none when empty) because of $2: exits the
# script, or returns 1 when this job used all its restarts (counted in the attempt log, so a
# log that cannot be written means no requeue).
requeue_without() {{
    local restarts excluded
    restarts=$(grep -c "^[^ ]* job {job} .*: restart [0-9]* of " "$attempts_log" \\
        2> /dev/null)
    if [ "${{restarts:-0}}" -ge "$max_restarts" ]; then
        log_attempt "$2; all $max_restarts restarts used"
        return 1
    fi
    log_attempt "$2: restart $((restarts + 1)) of $max_restarts${{1:+ without $1}}" || return 1
    echo "job {job}: $2: requeueing${{1:+ without $1}}" >&2
    [ -z "$1" ] || excluded=$(scontrol show job "{job}" | grep -o 'ExcNodeList=[^ ]*')
    excluded=${{excluded#ExcNodeList=}}
    [ "$excluded" != "(null)" ] || excluded=
    requeue || exit
    # only a pending job takes a new ExcNodeList: after the requeue, before it starts again
    [ -z "$1" ] || scontrol update JobId="{job}" ExcNodeList="${{excluded:+$excluded,}}$1"
    exit
}}
"""


def preflight_lines(check: str) -> str:
    """Run the preflight ``check``; requeue without the nodes it names."""
    return f"""\
# Preflight: launcher.check measures every node and names the slow ones (none: empty file).
rm -f {SLOW_NODES}
{check} || {{
    status=$?
    log_attempt "preflight failed: exit $status: passed on"
    exit "$status"
}}
if [ -s {SLOW_NODES} ]; then
    requeue_without "$(paste -sd, {SLOW_NODES})" "preflight named slow nodes" ||
        log_attempt "training on them anyway"
fi
"""


def train_ending(job: str = JOB) -> str:
    """What the script does with the step's ``status``; ``job``: as in ``train_prologue``."""
    return f"""\
# A rank that knows how the job ended wrote it to the run directory: it decides, since
# torchrun exits 1 and srun 128 + N (a rank a signal ended) whatever the ranks knew.
if [ "$status" -ne 0 ] && [ -s "$status_file" ]; then
    read -r status reason < "$status_file"
    echo "job {job}: the ranks report exit $status: $reason" >&2
    lost=$(paste -sd, "$lost_file" 2> /dev/null)
elif [ "$status" -ne 0 ] && lost=$(quiet_first) && [ -n "$lost" ]; then
    echo "job {job}: exit $status and no rank said why; the ranks on $lost ended" \\
        "first without a word (killed, or the node lost): exit {EXIT_PEER_LOST}" >&2
    status={EXIT_PEER_LOST}
fi
# each rank's own output, whole, beside the job log's (launcher.core.rank_output)
[ "$status" -eq 0 ] || [ ! -d "$run_dir/{LOGS_DIR}" ] ||
    echo "job {job}: each rank's output: $run_dir/{LOGS_DIR}/rank-R.log" >&2
case $status in
    {EXIT_PREEMPTED})
        # the ranks caught the signal and saved a checkpoint: requeue, the next run resumes
        # from it. Exit with scontrol's status: the job fails only when the requeue failed.
        log_attempt "exit {EXIT_PREEMPTED} (preempted): requeue"
        echo "job {job} preempted (exit {EXIT_PREEMPTED}): requeueing" >&2
        requeue
        exit $?
        ;;
    {EXIT_PEER_LOST})
        # a peer was lost: requeue without the nodes the survivors named or that went quiet
        # first (none: with the same nodes excluded as before); once the restarts are used
        # up, pass it on
        requeue_without "$lost" "exit {EXIT_PEER_LOST}, lost ${{lost:-a node nobody named}}"
        ;;
esac
log_attempt "exit $status: passed on"
exit "$status"
"""
