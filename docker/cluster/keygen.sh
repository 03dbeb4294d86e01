#!/bin/sh
# Makes one cluster's secrets in the keys volume, once, at start-up: nothing secret is baked
# into the image, and every cluster (every `compose up` with a fresh volume) gets its own.
#   ssh    a user key pair for root plus one host key that all nodes share, so known_hosts
#          is written here and host keys are checked strictly
#   munge  the key that Slurm's daemons use to authenticate each other
# Usage: keygen.sh ssh|munge ...  (the keys volume is mounted at $KEYS_DIR, default /keys)
set -eu
keys=${KEYS_DIR:-/keys}
umask 077
for what in "$@"; do
    case $what in
    ssh)
        if [ ! -s "$keys/id_ed25519" ]; then
            ssh-keygen -q -t ed25519 -N '' -C "root@ddp-cluster" -f "$keys/id_ed25519"
            ssh-keygen -q -t ed25519 -N '' -C "ddp-cluster-host" -f "$keys/host_ed25519"
            cp "$keys/id_ed25519.pub" "$keys/authorized_keys"
            # any name: the key belongs to this cluster only and is only trusted inside it
            printf '* %s\n' "$(cut -d' ' -f1,2 "$keys/host_ed25519.pub")" >"$keys/known_hosts"
        fi
        ;;
    munge)
        if [ ! -s "$keys/munge.key" ]; then
            dd if=/dev/urandom of="$keys/munge.key" bs=1024 count=1 status=none
        fi
        ;;
    *)
        echo "keygen.sh: unknown key kind '$what'" >&2
        echo "HINT: pass ssh and/or munge" >&2
        exit 2
        ;;
    esac
done
ls -l "$keys"
