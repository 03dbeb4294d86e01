#!/bin/sh
# The ssh that Hydra's mpiexec starts its proxies with (HYDRA_LAUNCHER_EXEC, set on every node
# by the compose file): plain ssh, plus an end for mpiexec when the session to a node is lost.
#
# Why: mpiexec ends only once every proxy's control connection (node -> node0, plain TCP with no
# keepalive) is closed. A node cut off the network (`docker network disconnect`, a dead switch)
# never closes it, so mpiexec would wait forever after every rank has exited. ssh does notice,
# through ServerAliveInterval (ssh_config), and exits 255. Then, after a grace period that lets
# the surviving ranks hit their own timeouts and say which peer is lost, SIGTERM mpiexec if it
# still runs (it then exits non-zero at once). DDP_SSH_LOST_GRACE_S sets the grace (default 20).
ssh "$@"
status=$?
launcher=$PPID
if [ "$status" -eq 255 ]; then
    host=$2
    [ "$1" = "-x" ] || host=$1
    grace=${DDP_SSH_LOST_GRACE_S:-20}
    echo "ssh-launch: lost the ssh session to $host (ssh exit 255): mpiexec ends in ${grace} s" \
        "if still running" >&2
    # detached, with no hold on Hydra's pipes, so this script exits now and mpiexec reaps it
    (
        sleep "$grace"
        if [ "$(cat "/proc/$launcher/comm" 2>/dev/null)" = mpiexec ]; then
            echo "ssh-launch: mpiexec still ran ${grace} s after losing $host: ending it" \
                >"/proc/$launcher/fd/2"
            kill -TERM "$launcher"
        fi
    ) </dev/null >/dev/null 2>&1 &
fi
exit "$status"
