#!/bin/sh
# Healthy controller: it answers `scontrol ping`. Healthy node: the controller lists it in a
# usable state (a trailing * would mean "not responding", so it must not follow the state).
set -eu
if [ "${1:-slurmd}" = slurmctld ]; then
    scontrol ping | grep -q 'is UP'
else
    scontrol show node "$(hostname)" -o |
        grep -Eq 'State=(IDLE|ALLOCATED|MIXED|COMPLETING)([+ ]|$)'
fi
