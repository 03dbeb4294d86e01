#!/bin/sh
# Healthy = a full ssh login to this node works (sshd up, keys installed, host key trusted).
exec ssh -o ConnectTimeout=2 "$(hostname)" true
