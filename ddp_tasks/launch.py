"""Launch tasks: ``invoke run`` starts N nodes x P ranks now, ``invoke sbatch`` writes a job.

Both are thin: they turn flags into a ``Launch`` and print or run what the pure
builders in ``ddp_tasks.commands`` make of it. docs/launching.md shows examples.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

from invoke.exceptions import Exit

from ddp_tasks import batch_script, commands, sif_file, sif_mount, sweep
from ddp_tasks.batch_script import Batch
from ddp_tasks.launch_spec import Launch
from ddp_tasks.runtimes import ShellText
from ddp_tasks.task_errors import user_errors
from ddp_tasks.task_params import documented
from launcher.core.defaults import PREEMPT_SIGNAL
from launcher.core.errors import LaunchError
from launcher.placement.hostlist import expand_hostlist

LAUNCH, BATCH = Launch(), Batch()
#: help for the task parameters that are not fields, or mean more on the command line
NOTES = {
    "env": "extra variable for every rank, NAME=VALUE",
    "signal": "preemption signal, USR1 or USR2 (default: $DDP_PREEMPT_SIGNAL, else USR1); "
    "sets DDP_PREEMPT_SIGNAL and sbatch --signal",
    "omp_threads": "OMP_NUM_THREADS per rank (default --cpus-per-task, else 1)",
    "master_addr": "MASTER_ADDR, only if rank 0's address cannot be found on its own",
    "master_port": "MASTER_PORT (default: chosen per job at start-up)",
    "ifname": "network interface for gloo/NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)",
    "dry_run": "print the command and exit",
    "script": "where to write the batch script (default JOB_NAME.sbatch)",
    "submit": "also run sbatch and print the job id",
    "directive": "another #SBATCH option, e.g. mem=64G or --qos=high",
    "sweep": "a launcher.train flag and its values, e.g. lr=0.1,0.05: with several, every "
    "combination is one task of a Slurm array job, in RUN_DIR/lr=0.1,...",
    "sweep_file": "a file of --sweep lines (NAME=V1,V2; # comments)",
    "throttle": "for a sweep: at most this many tasks at once (--array=0-N%THROTTLE)",
}
#: task parameters named otherwise than their field
RENAMED = {"prefix": "container_prefix", "bind": "binds", "directive": "directives"}


def _signal(flag: str) -> str:
    """The flag, else the caller's DDP_PREEMPT_SIGNAL: a site that set it keeps it by default."""
    return flag or os.environ.get("DDP_PREEMPT_SIGNAL", PREEMPT_SIGNAL)


def _launch(*, hosts, env, signal, omp_threads, master_addr, master_port, ifname, bind,
            **fields) -> Launch:
    """A Launch from task flags (the flags named here need parsing, ``fields`` do not)."""
    program_env = commands.program_env(
        _signal(signal), omp_threads or fields["cpus_per_task"], master_addr, master_port,
        ifname, commands.parse_env(env or ()),
    )
    return Launch(
        hosts=tuple(expand_hostlist(hosts, "--hosts")) if hosts else (),
        env=program_env,
        binds=tuple(bind or ()),
        **fields,
    )


def _sif_for_charliecloud(launch: Launch) -> tuple[Path, int, str] | None:
    """``(SIF, partition offset, mount point)`` when ch-run is to start from a SIF, else None."""
    if launch.runtime != "charliecloud" or not launch.image.endswith(".sif"):
        return None
    offset, _, digest = sif_mount.partition_of(Path(launch.image))
    return Path(launch.image), offset, sif_file.mount_point(digest)


def _host_path(launch: Launch) -> dict[str, str]:
    """PATH for the command: with ``--runtime none`` the ranks are this venv's Python and its
    MPICH (where ``invoke`` runs from ``.venv/bin`` of an inactive venv, PATH lacks them)."""
    path = os.environ.get("PATH", "")
    if launch.runtime == "none" and sys.prefix != sys.base_prefix:
        path = os.pathsep.join([str(Path(sys.executable).parent), path])
    return {"PATH": path}


def _installed(program: str, env: dict[str, str]) -> None:
    """A LaunchError naming ``program`` when the command's first word is not on its PATH."""
    if not shutil.which(program, path=env["PATH"]):
        raise LaunchError(
            f"{program} is not on PATH",
            hint=f"install it or load your site's module; with --runtime none, run this "
                 f"venv's invoke with {program} installed in it (pip install mpich)")


def _mounted_here(launch: Launch, sif, dry_run: bool):
    """The SIF mounted on this machine for the run (a context); the mount point as image."""
    if sif is None:
        return nullcontext(launch)
    if launch.nodes > 1 or launch.hosts or launch.hostfile:
        raise LaunchError(
            "`invoke run` mounts a SIF for ch-run on this machine only",
            hint="on several nodes use `invoke sbatch --runtime charliecloud --image X.sif` "
                 "(it mounts on every node), or an image directory from `invoke chimage`")
    path, offset, where = sif
    if dry_run:
        print(shlex.join(sif_file.mount_command(str(path), offset, where)))
        return nullcontext(replace(launch, image=where))

    @contextmanager
    def mounted():
        with sif_mount.mounted(path) as root:
            yield replace(launch, image=str(root))

    return mounted()


@documented(Launch, notes=NOTES, renamed=RENAMED, auto_shortflags=False,
            iterable=["bind", "env"])
def run(c, nodes=LAUNCH.nodes, procs_per_node=LAUNCH.procs_per_node, launcher=LAUNCH.launcher,
        mpi=LAUNCH.mpi, runtime=LAUNCH.runtime, pmi=LAUNCH.pmi, hosts="",
        prefix=LAUNCH.container_prefix, hostfile=LAUNCH.hostfile, image=LAUNCH.image,
        gpus_per_node=LAUNCH.gpus_per_node, cpus_per_task=LAUNCH.cpus_per_task, bind=None,
        module=LAUNCH.module, args="", env=None, signal="", omp_threads=0, master_addr="",
        master_port=0, ifname="", dry_run=False):
    """Launch NODES x PROCS_PER_NODE ranks of MODULE with mpirun or srun, in a container or not.

    Exits with the ranks' status: 0 done, 2 user error, 75 preempted after a checkpoint.
    """
    with user_errors():
        launch = _launch(
            nodes=nodes, procs_per_node=procs_per_node, launcher=launcher, mpi=mpi,
            runtime=runtime, pmi=pmi, hosts=hosts, container_prefix=prefix, hostfile=hostfile,
            image=image,
            gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, bind=bind, module=module,
            args=tuple(shlex.split(args)), env=env, signal=signal, omp_threads=omp_threads,
            master_addr=master_addr, master_port=master_port, ifname=ifname,
        )
        commands.launch_segments(launch)  # a bad launch fails before anything is mounted
        sif = _sif_for_charliecloud(launch)
        with _mounted_here(launch, sif, dry_run) as mounted:
            command = commands.render(commands.launch_segments(mounted))
            if dry_run:
                print(command)
                if sif:
                    print(shlex.join(sif_file.unmount_command(mounted.image)))
                return
            env = _host_path(mounted)
            _installed(shlex.split(command)[0], env)
            result = c.run(command, pty=False, warn=True, env=env)
    if result.exited:
        raise Exit(code=result.exited)


def _sweep(specs, file: str, throttle: int) -> sweep.Sweep | None:
    """The sweep of the flags and the file, or None for a single job."""
    if not specs and not file:
        if throttle:
            raise LaunchError("--throttle limits the tasks of a sweep", hint="add --sweep")
        return None
    try:
        text = Path(file).read_text() if file else ""
    except OSError as exc:
        raise LaunchError(f"cannot read --sweep-file {file}: {exc.strerror}",
                          hint="pass a file of NAME=V1,V2 lines") from None
    return sweep.parse_sweep(specs or (), text, throttle)


#: what --nodes means for a batch job, beside the Launch field's count
NODES_RANGE = ("a count, or MIN-MAX (2-3): the job starts on as many as are free, and a "
               "requeue after a lost node may continue on fewer")


#: what srun can start: --runtime docker is for `invoke run` (the compose cluster) only
SBATCH_NOTES = {
    "runtime": "apptainer (`apptainer exec` per rank), charliecloud (`ch-run`), pyxis (srun "
    "--container-image), podman-hpc or none (python on the host) (default apptainer)",
    "image": "the runtime's image: apptainer ddp-cpu.sif, charliecloud ddp-cpu (a directory "
    "from `invoke chimage`, or a SIF from `invoke sif`, mounted on every node), pyxis "
    "ddp+cpu.sqsh, podman-hpc ddp:cpu (the defaults)",
}


@documented(Launch, Batch, notes={**NOTES, **SBATCH_NOTES, "nodes": NODES_RANGE}, renamed=RENAMED,
            auto_shortflags=False, iterable=["bind", "env", "directive", "setup", "sweep"])
def sbatch(c, nodes=str(LAUNCH.nodes), procs_per_node=LAUNCH.procs_per_node, runtime=LAUNCH.runtime,
           pmi=LAUNCH.pmi, image=LAUNCH.image, gpus_per_node=LAUNCH.gpus_per_node,
           cpus_per_task=LAUNCH.cpus_per_task, bind=None, module=LAUNCH.module, args="",
           env=None, signal="", signal_seconds=BATCH.signal_seconds, omp_threads=0, ifname="",
           job_name=BATCH.job_name, time=BATCH.time, partition=BATCH.partition,
           account=BATCH.account, output=BATCH.output, directive=None, setup=None, script="",
           max_restarts=BATCH.max_restarts, preflight=BATCH.preflight, sweep=None,
           sweep_file="", throttle=0, submit=False):
    """Write a Slurm batch script that runs MODULE with srun and requeues itself on preemption.

    launcher.train gets `--resume auto` so a requeued job continues from its last checkpoint.
    With --sweep, one array job: a task per configuration, each requeued alone.
    """
    with user_errors():
        nodes, max_nodes = batch_script.node_range(nodes)
        launch = _launch(
            nodes=nodes, procs_per_node=procs_per_node, launcher="srun", runtime=runtime,
            pmi=pmi, image=image, gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task,
            bind=bind, module=module, args=commands.with_resume(module, tuple(shlex.split(args))),
            env=env,
            signal=signal, omp_threads=omp_threads, master_addr="", master_port=0,
            ifname=ifname, hosts="",
        )
        sif = _sif_for_charliecloud(launch)
        if sif:
            # every node mounts the partition before the ranks start, and unmounts at exit
            setup = [*(setup or ()), *sif_file.batch_mount_lines(
                str(sif[0].resolve()), *sif[1:], ignore=_signal(signal))]
            # the ranks' image: the mount point, as the script's shell expands it
            launch = replace(launch, image=ShellText(f'"{sif_file.IN_SCRIPT}"'))
        text = batch_script.batch_script(launch, batch_script.Batch(
            job_name=job_name, time=time, partition=partition, account=account,
            signal=_signal(signal),
            signal_seconds=signal_seconds, output=output, directives=tuple(directive or ()),
            setup=tuple(setup or ()), max_restarts=max_restarts, max_nodes=max_nodes,
            preflight=preflight,
        ), _sweep(sweep, sweep_file, throttle))
    path = Path(script or f"{job_name}.sbatch")
    path.write_text(text)
    path.chmod(0o755)
    print(path)
    if submit:
        result = c.run(shlex.join(batch_script.submit_argv(str(path))), pty=False, hide="out")
        print(f"submitted job {result.stdout.strip().split(';')[0]}")


TASKS = [run, sbatch]
