# The Slurm cluster's one image: the project image plus Debian's Slurm (slurmctld, slurmd, the
# client commands) and munge. The same image runs the controller and the nodes; which daemon
# starts is the entrypoint's argument (docker/slurm/entrypoint.sh). No key is baked in: the
# compose file's keygen service makes the munge key per cluster.
#   docker build -f docker/slurm.Dockerfile --build-arg BASE_IMAGE=ddp:cpu -t ddp-slurm:cpu docker
ARG BASE_IMAGE=ddp:cpu
FROM ${BASE_IMAGE}
# slurmd, slurmctld and munged's set-up need root (job steps run as whoever submits)
# hadolint ignore=DL3002
USER 0
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      slurmctld slurmd slurm-client munge \
 && rm -rf /var/lib/apt/lists/* /etc/munge/munge.key \
 && mkdir -p /var/spool/slurmctld /var/spool/slurmd /run/munge \
 && chown munge:munge /run/munge
COPY slurm/entrypoint.sh slurm/healthcheck.sh /opt/ddp/slurm/
ENTRYPOINT ["/opt/ddp/slurm/entrypoint.sh"]
CMD ["slurmd"]
