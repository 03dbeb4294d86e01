"""Where this process is in the job: the one place that reads the launch environment.

``detect_environment()`` reads ``os.environ`` (or a given mapping) and never communicates: no MPI
init, no torch. ``python -m launcher.env [--json]`` prints what it found. Launcher precedence
and the variables read are in ``launcher.placement.detectors`` and docs/environment.md.

Rendezvous address and port: ``MASTER_ADDR``/``MASTER_PORT`` win when set; torchrun sets them;
under Slurm the step's first host and a port derived from the job and step ids
(``launcher.placement.ports.slurm_port``); under mpirun/mpiexec both stay ``None`` and
``launcher.group.rendezvous`` has rank 0 pick and broadcast them; a single process uses 127.0.0.1
and a free port picked at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.core.defaults import PREEMPT_SIGNAL
from launcher.core.errors import LaunchError, report_and_exit
from launcher.placement import settings
from launcher.placement.detection import detect_launcher
from launcher.placement.hostlist import expand_hostlist
from launcher.placement.network import NetworkChoice, choose, loops_back
from launcher.placement.slurm_detector import Slurm
from launcher.placement.variables import Placement, read_int

#: signals that cannot be caught, so cannot announce a preemption
_UNCATCHABLE = {"KILL", "STOP"}

#: any of these: a PMI-1/PMI-2 server or Cray PMI serves the rank (``launch_pmi``)
_PMI_VARIABLES = ("PMI_FD", "PMI_PORT", "PMI_RANK", "PALS_APINFO", "PMI_CONTROL_PORT")


@dataclass(frozen=True, kw_only=True)
class JobEnv(Placement):
    """The placement a detector read (``Placement``'s fields), completed from the rest of the
    environment: the one immutable value every later stage is handed."""

    launcher: str  # "torchrun" | "openmpi" | "mvapich" | "hydra" | "slurm" | "pals" | "single"
    hostname: str
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES as given
    image: str | None = None  # DDP_IMAGE: identity of the project's container image
    preempt_signal: str = PREEMPT_SIGNAL  # DDP_PREEMPT_SIGNAL, a name without "SIG"
    pmi: str = "none"  # what the launcher offers MPI: "pmix" | "pmi" (PMI-1/PMI-2) | "none"
    library_path: tuple[str, ...] = ()  # LD_LIBRARY_PATH's directories, in order
    mpi4py_request: str | None = None  # MPI4PY_LIBMPI / MPI4PY_MPIABI as the user set them
    mpi_impl: str = "auto"  # DDP_MPI_IMPL: --backend mpi compiled ("cxx"), "python" or "auto"
    mpi_cxx_dir: str | None = None  # DDP_MPI_CXX_DIR: where the compiled mpi backend is built
    ifname: str | None = None  # GLOO_SOCKET_IFNAME as the user set it (--ifname)
    nccl_dump_signal: str | None = None  # NCCL_PROXY_DUMP_SIGNAL: the number NCCL would catch
    network: NetworkChoice | None = None  # the interface used, chosen at start-up

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def node_name(self) -> str:
        """This rank's node as the scheduler names it: several slurmd on one host share one
        hostname, so the node list's entry wins where there is one (what ``--exclude`` takes)."""
        if 0 <= self.node_rank < len(self.hosts):
            return self.hosts[self.node_rank]
        return self.hostname


@dataclass(frozen=True)
class BuildTools:
    """What building the compiled mpi backend reads (``python -m launcher.mpi.cxx``, before any
    rank exists); ``JobEnv`` takes its ``mpi_cxx_dir`` from here, so each is read once."""

    #: DDP_MPI_CXX_DIR: where the compiled backend is put and found (None: ``<venv>/lib/ddp-ext``)
    mpi_cxx_dir: str | None = None
    #: CXX: the C++ compiler the build runs
    compiler: str = "c++"


def build_tools(environ: Mapping[str, str] | None = None) -> BuildTools:
    """``BuildTools`` read from ``environ`` (default: ``os.environ``)."""
    if environ is None:
        environ = os.environ
    return BuildTools(mpi_cxx_dir=environ.get("DDP_MPI_CXX_DIR") or None,
                      compiler=environ.get("CXX", "c++"))


def parse_signal(value: str, variable: str = "DDP_PREEMPT_SIGNAL") -> str:
    """``USR1``, ``SIGUSR1`` or ``usr1`` -> ``"USR1"``; anything else raises LaunchError."""
    name = value.strip().upper().removeprefix("SIG")
    if name in _UNCATCHABLE or not hasattr(signal.Signals, f"SIG{name}"):
        raise LaunchError(
            f"{variable}={value!r} is not a signal this process can catch",
            hint=f"set {variable} to a signal name such as USR1, USR2 or TERM, the one your "
            "scheduler sends before preemption (sbatch --signal=USR1@120; without 'B:' it "
            "reaches every rank, not only the batch shell)",
        )
    return name


def launch_pmi(environ: Mapping[str, str]) -> str:
    """The process-management interface the launcher serves this rank, from its variables.

    PMIx servers (srun --mpi=pmix, Open MPI's mpirun/prterun) export PMIX_RANK and
    PMIX_NAMESPACE; PMI-1/PMI-2 servers (Hydra, srun --mpi=pmi2) export PMI_RANK and a
    PMI_FD or PMI_PORT to reach them; Cray PMI (PALS, srun --mpi=cray_shasta) finds its peers
    through the PALS_APINFO file and PMI_CONTROL_PORT, and srun's plugin sets no PMI_RANK.
    """
    if "PMIX_RANK" in environ or "PMIX_NAMESPACE" in environ:
        return "pmix"
    if any(name in environ for name in _PMI_VARIABLES):
        return "pmi"
    return "none"


def _mpi4py_request(environ: Mapping[str, str]) -> str | None:
    given = [f"{name}={environ[name]}" for name in ("MPI4PY_LIBMPI", "MPI4PY_MPIABI")
             if environ.get(name, "").strip()]
    return " ".join(given) or None


def _master_port(environ: Mapping[str, str]) -> int | None:
    if not environ.get("MASTER_PORT", "").strip():
        return None
    port = read_int(environ, "MASTER_PORT", "rendezvous", minimum=1)
    if port > 65535:
        raise LaunchError(
            f"MASTER_PORT={environ['MASTER_PORT']!r} is not a TCP port (1-65535)",
            hint="unset MASTER_PORT to let the launcher choose one, or pick a free port "
            "such as 29500",
        )
    return port


def _given_hosts(environ: Mapping[str, str]) -> tuple[str, ...]:
    """DDP_HOSTS: the nodes ``invoke run --hosts`` names; MPI launchers export no node list."""
    if not environ.get("DDP_HOSTS", "").strip():
        return ()
    return tuple(expand_hostlist(environ["DDP_HOSTS"], "DDP_HOSTS"))


def visible_device_count(visible_devices: str | None) -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES lists; None when it is unset (no restriction)."""
    if visible_devices is None:
        return None
    count = 0
    for entry in visible_devices.split(","):
        entry = entry.strip()
        # CUDA stops at the first invalid entry; Slurm writes NoDevFiles when no GPU was given
        if not entry or entry.startswith("-") or entry == "NoDevFiles":
            break
        count += 1
    return count


def local_device_index(env: JobEnv, device_count: int | None = None) -> int:
    """The index of this rank's GPU among the ``device_count`` visible ones (one GPU per rank).

    ``device_count`` is what the caller sees (``torch.cuda.device_count()``); by default the
    entries of CUDA_VISIBLE_DEVICES, and when that is unset too, the local rank is trusted.
    One visible device serves every local rank: per-task binding (``srun --gpus-per-task=1``)
    shows each task its own GPU as device 0. A local rank beyond several visible devices has
    no GPU of its own: LaunchError.
    """
    if device_count is None:
        device_count = visible_device_count(env.visible_devices)
    if device_count is None or env.local_rank < device_count:
        return env.local_rank
    if device_count == 1:
        return 0
    raise LaunchError(
        f"{env.launcher}: local rank {env.local_rank} has no GPU: {device_count} devices visible "
        f"(CUDA_VISIBLE_DEVICES={env.visible_devices!r}) for {env.local_world_size} ranks on "
        f"{env.hostname}",
        hint=f"start at most {device_count} ranks per node (e.g. mpiexec -ppn {device_count}, "
        f"srun --ntasks-per-node={device_count}, torchrun --nproc-per-node={device_count}), "
        "or make more GPUs visible",
    )


def detect_environment(
    environ: Mapping[str, str] | None = None, hostname: str | None = None
) -> JobEnv:
    """This process's place in the job, read from ``environ`` (default: ``os.environ``)."""
    if environ is None:
        environ = os.environ
    detector, placement = detect_launcher(environ)
    read = dataclasses.asdict(placement)
    read.update(master_addr=environ.get("MASTER_ADDR", "").strip() or placement.master_addr,
                master_port=_master_port(environ) or placement.master_port,
                hosts=placement.hosts or _given_hosts(environ))
    return JobEnv(
        **read,
        launcher=detector.name,
        hostname=hostname or socket.gethostname(),
        visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        image=environ.get("DDP_IMAGE") or None,
        preempt_signal=parse_signal(environ.get("DDP_PREEMPT_SIGNAL", PREEMPT_SIGNAL)),
        pmi=launch_pmi(environ) if detector.serves_pmi else "none",
        library_path=tuple(filter(None, environ.get("LD_LIBRARY_PATH", "").split(":"))),
        mpi4py_request=_mpi4py_request(environ),
        mpi_impl=environ.get("DDP_MPI_IMPL", "").strip() or "auto",
        mpi_cxx_dir=build_tools(environ).mpi_cxx_dir,
        ifname=environ.get("GLOO_SOCKET_IFNAME", "").strip() or None,
        nccl_dump_signal=environ.get("NCCL_PROXY_DUMP_SIGNAL", "").strip() or None,
    )


def describe(env: JobEnv, environ: Mapping[str, str]) -> str:
    """A human table of ``env``, with a note when the allocation is not being used."""
    rows = {"launcher": env.launcher, **dataclasses.asdict(env)}
    rows["hosts"] = ",".join(env.hosts) or "-"
    rows["library_path"] = ":".join(env.library_path) or "-"
    rows["network"] = _network_row(env)
    width = max(len(key) for key in rows)
    lines = [f"{key:<{width}}  {'-' if value is None else value}" for key, value in rows.items()]
    if env.launcher == "single" and Slurm.job_id(environ) is not None:
        lines.append(
            "note: inside Slurm job "
            f"{Slurm.job_id(environ)} but not a task of a step (batch script or salloc "
            "shell): one process. Start tasks with srun."
        )
    if env.master_addr is None or env.master_port is None:
        lines.append("note: missing rendezvous address/port are chosen by rank 0 at start-up")
    return "\n".join(lines)


def network_target(env: JobEnv) -> str | None:
    """The host whose route names the interface before any rank has spoken: the rendezvous
    host, unless this node reaches it over loopback (its own name may resolve to 127.0.1.1):
    then another node of the job, when the node list is known."""
    others = [host for host in env.hosts if host != env.hostname]
    if env.master_addr and not (others and loops_back(env.master_addr)):
        return env.master_addr
    return others[0] if others else None


def planned_network(env: JobEnv) -> NetworkChoice | None:
    """The interface start-up will choose, when the rendezvous host is known already."""
    return env.network or choose(env.ifname, network_target(env), env.num_nodes > 1)


def _network_row(env: JobEnv) -> str:
    try:
        planned = planned_network(env)
    except LaunchError as error:
        return f"none: {error.message}"
    if planned is None:
        return "chosen at start-up: the route to rank 0's address"
    return planned.describe()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.env",
        description="Print where this process is in the job, without communicating.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    try:
        env = detect_environment()
    except LaunchError as error:
        report_and_exit(error)
    if args.json:
        record = dataclasses.asdict(env)
        record.update(is_main=env.is_main, is_distributed=env.is_distributed,
                      network=_network_row(env), library_settings=settings.applied())
        print(json.dumps(record, sort_keys=True), flush=True)
    else:
        print(describe(env, os.environ), flush=True)
    sys.exit(0)


