#!/bin/sh
# Healthy = a full ssh login to this node worked (sshd up, keys installed, host key trusted)
# and sshd still runs. The login is tried until it first works, then only sshd's pid is
# checked: Docker probes every few seconds for the node's whole life (PROBE_INTERVAL in
# ddp_tasks/compose_spec.py), and a login (its key exchange, ~0.07 CPU-s) every second on
# each of 3 nodes took a tenth of a 2-core machine.
# node.sh removes the marker when the node (re)starts.
marker=/run/ddp-logged-in
if [ -e "$marker" ]; then
    exec kill -0 "$(cat /run/sshd.pid)"
fi
ssh -o ConnectTimeout=2 "$(hostname)" true && touch "$marker"
