#!/bin/sh
# Entrypoint of a compose cluster node: install this cluster's keys (from the read-only keys
# volume, with the modes ssh insists on), then run sshd in the foreground as PID 1's child.
set -eu
keys=${KEYS_DIR:-/keys}
if [ ! -s "$keys/id_ed25519" ]; then
    echo "node.sh: no cluster keys in $keys" >&2
    echo "HINT: start the cluster with compose (the keygen service makes them) or" \
        "'invoke cluster.up'" >&2
    exit 2
fi
here=$(dirname "$0")
install -d -m 700 /root/.ssh
install -m 600 "$keys/id_ed25519" "$keys/authorized_keys" "$keys/known_hosts" /root/.ssh/
install -m 644 "$keys/id_ed25519.pub" /root/.ssh/
install -m 600 "$here/ssh_config" /root/.ssh/config
install -m 600 "$keys/host_ed25519" /etc/ssh/ddp_host_ed25519_key
install -d -m 755 /run/sshd
rm -f /run/ddp-logged-in  # healthcheck.sh's: a restarted node logs in again before it is healthy
exec /usr/sbin/sshd -D -e -f "$here/sshd_config"
