#!/bin/sh
# The ssh that Hydra's mpiexec starts its proxies with (HYDRA_LAUNCHER_EXEC, set on every node
# by the compose file): plain ssh, plus a message naming the node when the session to it is
# lost, and an end for mpiexec if it would otherwise wait forever.
#
# Why the message goes to mpiexec's own stderr, not this script's: Hydra reads our stderr
# through a pipe and forwards it, but when a node dies its proxy's control connection closes
# too, and mpiexec then stops at once (`control_cb: assert (!closed) failed`) without reading
# what is left in that pipe, so "which node" was lost in a race. A copy of mpiexec's stderr,
# opened here while mpiexec runs, reaches the user (terminal, log file, `docker exec`) however
# early mpiexec ends. Opened for append, so that a log file is not truncated.
#
# Why the end: mpiexec ends only once every proxy's control connection (node -> node0, plain
# TCP with no keepalive) is closed. A node cut off the network (`docker network disconnect`, a
# dead switch) never closes it, so mpiexec would wait forever after every rank has exited. ssh
# does notice, through ServerAliveInterval (ssh_config), and exits 255. Then, after a grace
# period that lets the surviving ranks hit their own timeouts and say which peer is lost,
# SIGTERM mpiexec if it still runs (it then exits non-zero at once). DDP_SSH_LOST_GRACE_S sets
# the grace (default 20).
launcher=$PPID
if (exec 3>>"/proc/$launcher/fd/2") 2>/dev/null; then
    exec 3>>"/proc/$launcher/fd/2"
else
    exec 3>&2
fi
ssh "$@" 3>&-
status=$?
if [ "$status" -eq 255 ]; then
    host=$2
    [ "$1" = "-x" ] || host=$1
    grace=${DDP_SSH_LOST_GRACE_S:-20}
    echo "ssh-launch: lost the ssh session to $host (ssh exit 255): the node, or the network" \
        "to it, is gone; mpiexec ends in ${grace} s if still running" >&3
    # detached, with no hold on Hydra's pipes nor on the copy of mpiexec's stderr, so this
    # script exits now, mpiexec reaps it, and whoever reads mpiexec's output is not held up
    (
        sleep "$grace"
        if [ "$(cat "/proc/$launcher/comm" 2>/dev/null)" = mpiexec ]; then
            echo "ssh-launch: mpiexec still ran ${grace} s after losing $host: ending it" \
                >>"/proc/$launcher/fd/2"
            kill -TERM "$launcher"
        fi
    ) </dev/null >/dev/null 2>&1 3>&- &
fi
exit "$status"
