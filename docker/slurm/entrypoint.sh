#!/bin/sh
# Entrypoint of the Slurm cluster's containers: install this cluster's munge key, start munged,
# then run ROLE (slurmctld or slurmd) in the foreground, logging to stderr (docker logs).
# Any other command runs as it is, after munge, e.g. a shell for debugging.
set -eu
keys=${KEYS_DIR:-/keys}
if [ ! -s "$keys/munge.key" ]; then
    echo "entrypoint.sh: no munge key in $keys" >&2
    echo "HINT: start the cluster with compose (its keygen service makes the key) or" \
        "'invoke cluster.up --slurm'" >&2
    exit 2
fi
install -o munge -g munge -m 400 "$keys/munge.key" /etc/munge/munge.key
install -d -o munge -g munge -m 755 /run/munge
runuser -u munge -- /usr/sbin/munged
case ${1:-slurmd} in
slurmctld) exec /usr/sbin/slurmctld -D -i ;;
slurmd) exec /usr/sbin/slurmd -D ;;
*) exec "$@" ;;
esac
