"""The SIF, for real: built here without Apptainer (``invoke sif --builder native``), read with
the reference tool (``siftool``, from sylabs/sif, the library Apptainer reads SIFs with), and run:
its system partition mounted read-only with squashfuse at the partition's offset, ranks started
from it by ``ch-run`` under ``srun --mpi=pmi2``, ``srun --mpi=pmix`` and Hydra's ``mpiexec``.

What Apptainer itself would do with the file (``apptainer exec``) cannot run here (no Apptainer
for Debian 12): its in-image half is checked instead, by sourcing ``/.singularity.d/env/*.sh``
in order and running ``/.singularity.d/actions/test`` as Apptainer's actions do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_tasks import image_commands as ic
from ddp_tasks import sif_content, sif_file, sif_mount
from launcher.core.errors import LaunchError
from tests.fixtures.docker import COLD_BUILD_TIMEOUT
from tests.fixtures.golden import golden
from tests.fixtures.mpi import mpiexec_path
from tests.fixtures.sif import build_sif
from tests.fixtures.tasks_cli import on_path
from tests.test_host_launchers import (
    COMPILED,
    MPICH,
    OPENMPI,
    RUN_TIMEOUT,
    SCRATCH,
    TRAIN,
    _user_env,
    ch_run,
    equal_hashes,
    passed_check,
    run_host,
)

pytestmark = pytest.mark.timeout(COLD_BUILD_TIMEOUT)

INVOKE = [sys.executable, "-m", "invoke"]
DIGEST = re.compile(r"^system partition sha256 ([0-9a-f]{64})$", re.MULTILINE)


def _siftool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["siftool", *args], capture_output=True, timeout=120, check=True)


# -- pure builders -----------------------------------------------------------------------------


def test_native_dry_run_golden():
    result = subprocess.run([*INVOKE, "sif", "--builder", "native", "--dry-run"], cwd=ic.ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    golden("sif_native_dry_run.txt", result.stdout)


def test_the_docker_env_script_restates_env_as_apptainer_does(tmp_path):
    """PATH is the image's; every other variable keeps a value the host gives; quoting holds."""
    script = tmp_path / "10-docker2singularity.sh"
    script.write_text(sif_content.docker_env_script(
        ["PATH=/opt/x/bin:/usr/bin:/bin", "A=image", "B=image", 'ODD=a "q" $HOME `x` \\', "NONE"]))
    shown = subprocess.run(
        ["/bin/sh", "-c", f'. {script}; printf "%s|" "$PATH" "$A" "$B" "$ODD" "$NONE"'],
        env={"PATH": "/host/bin", "B": "host"}, capture_output=True, text=True, check=True)
    assert shown.stdout == '/opt/x/bin:/usr/bin:/bin|image|host|a "q" $HOME `x` \\||'


def test_definition_sections_lose_their_indentation():
    sections = sif_content.definition_sections(ic.apptainer_def("cpu").read_text())
    assert sections["runscript"].splitlines()[-1] == 'exec python -m launcher.train "$@"'
    assert "python -m launcher.check" in sections["test"]
    assert sif_content.definition_labels(ic.apptainer_def("cpu").read_text())[
        "io.ddp.flavor"] == "cpu"


def test_missing_tools_are_one_error_naming_the_debian_packages(tmp_path):
    result = subprocess.run([*INVOKE, "-r", str(ic.ROOT), "sif", "--builder", "native"],
                            env={"PATH": str(tmp_path)}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: building a SIF without Apptainer needs mksquashfs, "
                               "siftool"), result.stderr
    assert lines[1].startswith("HINT: apt-get install siftool squashfs-tools"), result.stderr
    assert "Traceback" not in result.stderr


def test_a_file_that_is_no_sif_is_refused(tmp_path):
    (tmp_path / "x.sif").write_bytes(b"\0" * sif_file.HEAD_BYTES)
    with pytest.raises(LaunchError, match="not a SIF file"):
        sif_mount.read_descriptors(tmp_path / "x.sif")


#: srun as the batch script's mount lines use it, on this one node: its options dropped
ONE_NODE_SRUN = '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n'


@pytest.mark.parametrize(("signal", "step_ends"), [("USR1", False), ("TERM", False),
                                                  ("USR1", True)])
def test_the_batch_mount_outlives_the_preemption_signal_and_leaves_nothing(tmp_path, signal,
                                                                          step_ends):
    """The batch script's mount lines, run by bash with srun standing in on this node. Slurm
    sends the preemption signal to every step, the mount's too: its squashfuse must not die of
    it (the ranks are writing their checkpoint from the image). At the script's exit, or when
    Slurm ends the step first (TERM to its processes: a requeue), the mount and its directory,
    the job's and attempt's own, are gone."""
    sif_mount.require({**sif_mount.MOUNT_TOOLS, "mksquashfs": "squashfs-tools"}, "this test")
    content, image, bin_dir = tmp_path / "content", tmp_path / "image.sqfs", tmp_path / "bin"
    content.mkdir()
    (content / "f").write_text("from the image\n")
    subprocess.run(["mksquashfs", str(content), str(image), "-quiet", "-noappend"], check=True,
                   timeout=60)
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(ONE_NODE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    lines = sif_file.batch_mount_lines(str(image), 0, str(tmp_path / "ddp-sif-x"), signal)
    step = 'kill -{0} "$serve"; pkill -{0} -f "^squashfuse -f .* $sif_mount$"'
    script = "\n".join([*lines, "serve=$!", 'cat "$sif_mount/f"', step.format(signal),
                        "sleep 1", 'cat "$sif_mount/f"', 'echo "mounted at $sif_mount"',
                        *([step.format("TERM"), 'wait "$serve"', 'ls -d "$sif_mount"']
                          if step_ends else []), ""])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": on_path(bin_dir),
                               "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "1"})
    report = done.stdout + done.stderr
    assert done.stdout.count("from the image") == 2, report
    assert f"mounted at {tmp_path}/ddp-sif-x-42.0" in done.stdout, report
    if step_ends:  # gone before the script's own end
        assert "ls: cannot access" in done.stderr, report
    else:
        assert done.returncode == 0, report
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("ddp-sif")] == []


# -- the file ----------------------------------------------------------------------------------


def test_siftool_lists_the_objects_apptainer_reads(cpu_sif):
    """A definition, the JSON metadata and the primary system partition: squashfs, amd64."""
    listing = _siftool("list", str(cpu_sif.path)).stdout.decode()
    types = [line.rsplit("|", 1)[1].strip() for line in listing.splitlines()
             if re.match(r"^\d+\s+\|", line)]
    assert types == ["Def.FILE", "JSON.Generic", "JSON.Generic", "FS (Squashfs/*System/amd64)"]
    names = [d.name for d in sif_mount.read_descriptors(cpu_sif.path)]
    assert names[:3] == ["Singularity", sif_content.INSPECT_METADATA, sif_content.OCI_CONFIG]
    definition = _siftool("dump", "1", str(cpu_sif.path)).stdout.decode()
    assert definition.startswith("Bootstrap: docker-daemon\nFrom: ")


def test_invoke_sif_prints_the_size_and_the_partitions_digest(cpu_sif):
    printed = DIGEST.search(cpu_sif.output).group(1)
    assert f"{cpu_sif.path}: {cpu_sif.path.stat().st_size} bytes" in cpu_sif.output
    _, _, digest = sif_mount.partition_of(cpu_sif.path)
    dumped = subprocess.run(f"siftool dump 4 {cpu_sif.path} | sha256sum", shell=True,
                            capture_output=True, text=True, check=True, timeout=300)
    assert printed == digest == dumped.stdout.split()[0]


def test_the_same_image_gives_the_same_partition(cpu_sif, sif_image, tmp_path):
    again = build_sif(sif_image, tmp_path / "again.sif")
    assert DIGEST.search(again.output).group(1) == DIGEST.search(cpu_sif.output).group(1)


def test_the_labels_record_the_image_it_came_from(cpu_sif, dockerd, sif_image):
    image = dockerd.images.get(sif_image)
    metadata = json.loads(_siftool("dump", "2", str(cpu_sif.path)).stdout)
    labels = metadata["data"]["attributes"]["labels"]
    assert labels["io.ddp.sif.source-image"] == image.id
    assert image.labels.items() <= labels.items()
    assert metadata["type"] == "container"


# -- the SIF's own environment, as Apptainer sets it up ----------------------------------------


def _in_sif(root: Path, script: str) -> subprocess.CompletedProcess:
    """``/bin/sh -c SCRIPT`` in the mounted SIF, from a bare host environment."""
    return subprocess.run(["ch-run", str(root), "--", "/bin/sh", "-c", script],
                          env={**_user_env(), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)


def test_a_shell_sourcing_the_env_scripts_gets_the_images_environment(sif_root, dockerd,
                                                                      sif_image):
    shown = _in_sif(sif_root, 'for s in /.singularity.d/env/*.sh; do . "$s"; done; env -0')
    assert shown.returncode == 0, shown.stderr
    seen = dict(item.split("=", 1) for item in shown.stdout.split("\0") if "=" in item)
    for item in dockerd.images.get(sif_image).attrs["Config"]["Env"]:
        name, value = item.split("=", 1)
        if name == "PATH":  # %environment puts the venv first again
            assert seen["PATH"].endswith(value) and seen["PATH"].startswith("/opt/ddp/venv/bin")
        elif name == "DDP_IMAGE":  # with the source image's id, which launcher.check compares
            assert seen[name] == f"{value} {dockerd.images.get(sif_image).id[:19]}", seen[name]
        else:
            assert seen[name] == value, name
    assert "/.singularity.d/libs" in seen["LD_LIBRARY_PATH"]
    labels = json.loads((sif_root / ".singularity.d/labels.json").read_text())
    assert dockerd.images.get(sif_image).labels.items() <= labels.items()


def test_the_sifs_test_section_passes(sif_root):
    """What ``apptainer test ddp-cpu.sif`` runs: the action, then the definition's %test."""
    result = _in_sif(sif_root, "/.singularity.d/actions/test")
    assert result.returncode == 0 and "check passed" in result.stdout, (
        f"{result.stdout}\n{result.stderr}")


# -- ranks from the SIF, under the host's launchers --------------------------------------------


@pytest.mark.runtime
@pytest.mark.slurm
@pytest.mark.parametrize("plugin, library, libmpi, implementation", [
    # the compiled backend is built against the image's MPICH; with Open MPI chosen it would
    # load a second libmpi beside mpi4py's, so the Python one runs (launcher/mpi/cxx.py)
    ("pmi2", MPICH, "/opt/ddp/venv/lib/libmpi.so.12", COMPILED),
    ("pmix", OPENMPI, "/opt/ddp/openmpi/lib/libmpi.so.40", "the Python mpi backend"),
])
def test_srun_starts_ranks_from_the_sif(slurm_cluster, sif_root, tmp_path, plugin, library,
                                        libmpi, implementation):
    ch = ch_run(sif_root, tmp_path)
    check = slurm_cluster.srun(["-n", "2", f"--mpi={plugin}", *ch, "python", "-m",
                                "launcher.check", "--backend", "mpi"], timeout=RUN_TIMEOUT,
                               env=_user_env())
    passed_check(check, library, libmpi, "pmix" if plugin == "pmix" else "pmi")
    # passed: every rank runs the same implementation (a mix is one of the check's problems)
    assert f"mpi: rank 0 runs {implementation}" in check.stdout, check.stdout
    equal_hashes(slurm_cluster.srun(["-n", "2", f"--mpi={plugin}", *ch, "python", "-m",
                                     "launcher.train", *TRAIN], timeout=RUN_TIMEOUT,
                                    env=_user_env()))


@pytest.mark.runtime
@pytest.mark.mpi
def test_hydra_mpiexec_starts_ranks_from_the_sif(sif_root, tmp_path, dockerd, sif_image):
    mpiexec = [str(mpiexec_path()), "-n", "2", *ch_run(sif_root, tmp_path), "python", "-m"]
    check = run_host([*mpiexec, "launcher.check", "--backend", "mpi"])
    passed_check(check, MPICH, "/opt/ddp/venv/lib/libmpi.so.12", "pmi")
    assert f"mpi: rank 0 runs {COMPILED}" in check.stdout, check.stdout
    # the footer holds what every rank agrees on: the build, the SIF's source image id
    built = dockerd.images.get(sif_image).id[:19]
    assert re.search(rf"^image: \S+ {built}$", check.stdout, re.M), check.stdout
    equal_hashes(run_host([*mpiexec, "launcher.train", *TRAIN]))


@pytest.mark.runtime
@pytest.mark.mpi
def test_invoke_run_charliecloud_runs_straight_from_the_sif(cpu_sif, tmp_path):
    """``invoke run --runtime charliecloud --image ddp-cpu.sif``: mounted, run, unmounted."""
    _, _, digest = sif_mount.partition_of(cpu_sif.path)
    path = on_path(Path(sys.executable).parent)
    result = run_host([*INVOKE, "-r", str(ic.ROOT), "run", "--runtime", "charliecloud",
                       "--procs-per-node", "2", "--image", str(cpu_sif.path), "--bind",
                       f"{tmp_path}:{SCRATCH}", "--args", " ".join(TRAIN)], {"PATH": path})
    equal_hashes(result)
    assert not Path(sif_file.mount_point(digest)).exists(), "the mount was left behind"


@pytest.mark.runtime
@pytest.mark.slurm
def test_sbatch_charliecloud_mounts_the_sif_on_each_node_and_unmounts(slurm_cluster, cpu_sif,
                                                                      tmp_path):
    """The batch script of ``invoke sbatch --runtime charliecloud --image ddp-cpu.sif``."""
    script, output = tmp_path / "job.sbatch", tmp_path / "job.out"
    written = subprocess.run(
        [*INVOKE, "-r", str(ic.ROOT), "sbatch", "--runtime", "charliecloud", "--image",
         str(cpu_sif.path), "--procs-per-node", "2", "--pmi", "pmix", "--bind",
         f"{tmp_path}:{SCRATCH}", "--module", "launcher.check", "--args", "--backend mpi",
         "--script", str(script)], capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    job = slurm_cluster.sbatch(script, ["--output", str(output)], env=_user_env())
    result = slurm_cluster.wait_job(job, timeout=RUN_TIMEOUT)
    text = output.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", "0:0"), text
    assert "check passed" in text and "Open MPI v" in text, text
    _, _, digest = sif_mount.partition_of(cpu_sif.path)
    mounted = Path(sif_file.mount_point(digest))
    assert list(mounted.parent.glob(f"{mounted.name}-{job}.*")) == [], "the job left its mount"


def _sbatch_script(tmp_path: Path, sif: Path, name: str, train_args: str) -> Path:
    script = tmp_path / f"{name}.sbatch"
    subprocess.run(
        [*INVOKE, "-r", str(ic.ROOT), "sbatch", "--runtime", "charliecloud", "--image",
         str(sif), "--procs-per-node", "2", "--bind", f"{tmp_path}:{SCRATCH}",
         "--job-name", name, "--output", str(tmp_path / "%x-%j.out"), "--script", str(script),
         "--directive", "comment=ddp-test", "--setup", "echo setup line ran",
         "--args", f"--backend mpi {train_args} --data-dir {SCRATCH}/data"],
        check=True, capture_output=True, text=True, timeout=60)
    return script


@pytest.mark.runtime
@pytest.mark.slurm
def test_sbatch_from_the_sif_requeues_and_resumes_to_the_same_model(slurm_cluster, cpu_sif,
                                                                    tmp_path):
    """USR1 -> every rank checkpoints and exits 75 -> the script requeues -> the job resumes
    and ends with the weights of an uninterrupted job. Slurm sends USR1 to the SIF's mount
    step too: the mount outlives it, and each attempt's mount is gone at its end."""
    train = "--epochs 40 --checkpoint-every 20 --log-every 20"
    whole = slurm_cluster.sbatch(
        _sbatch_script(tmp_path, cpu_sif.path, "whole", f"{train} --run-dir {SCRATCH}/whole"),
        env=_user_env())
    assert slurm_cluster.wait_job(whole, timeout=RUN_TIMEOUT).state == "COMPLETED", \
        (tmp_path / f"whole-{whole}.out").read_text()
    whole_out = (tmp_path / f"whole-{whole}.out").read_text()
    expected = equal_hashes(subprocess.CompletedProcess([], 0, whole_out, ""))
    assert "setup line ran" in whole_out

    job_id = slurm_cluster.sbatch(
        _sbatch_script(tmp_path, cpu_sif.path, "cut", f"{train} --run-dir {SCRATCH}/cut"),
        env=_user_env())
    assert slurm_cluster.job_fields(job_id)["Comment"] == "ddp-test"  # --directive reached sbatch
    deadline = time.monotonic() + RUN_TIMEOUT
    while not list((tmp_path / "cut" / "checkpoints").glob("ckpt-*.pt")):
        assert time.monotonic() < deadline, "the job saved no checkpoint"
        assert slurm_cluster.job_fields(job_id)["JobState"] in {"PENDING", "RUNNING"}
        time.sleep(0.2)
    # what Slurm does --signal-seconds before the time limit, now: USR1 to every step
    subprocess.run(["scancel", "--signal=USR1", str(job_id)], env=slurm_cluster.env,
                   check=True, timeout=30)
    result = slurm_cluster.wait_job(job_id, timeout=RUN_TIMEOUT)
    output = (tmp_path / f"cut-{job_id}.out").read_text()
    assert result.state == "COMPLETED", output
    assert slurm_cluster.job_fields(job_id)["Restarts"] == "1", output
    assert f"job {job_id} preempted (exit 75): requeueing" in output
    assert re.search(r"resuming from \S+ckpt-\d+\.pt \(step [1-9]", output), output
    assert "Transport endpoint is not connected" not in output, output
    assert equal_hashes(subprocess.CompletedProcess([], 0, output, "")) == expected
    _, _, digest = sif_mount.partition_of(cpu_sif.path)
    left = list(Path(sif_file.mount_point(digest)).parent.glob(
        f"{Path(sif_file.mount_point(digest)).name}-{job_id}.*"))
    assert left == [], "an attempt left its mount point behind"
