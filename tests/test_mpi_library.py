"""Which libmpi a rank loads (launcher.mpi.library), with faked launch environments and
libraries in temporary directories. The real launches are in tests/test_host_launchers.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from launcher.core.errors import LaunchError
from launcher.mpi import cma, huge_pages, single_copy
from launcher.mpi import library as mpi_library
from launcher.placement import settings
from launcher.placement.env import detect_environment, launch_pmi
from tests.fixtures.mpi import run_mpi

SLURM_STEP = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
              "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NODEID": "0",
              "SLURM_STEP_TASKS_PER_NODE": "2"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5", "MPI_LOCALRANKID": "1",
         "MPI_LOCALNRANKS": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-1@1"}


@pytest.mark.parametrize("environ, pmi", [
    ({}, "none"),
    (HYDRA, "pmi"),
    ({**SLURM_STEP, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "4"}, "pmi"),  # srun pmi2
    ({**SLURM_STEP, "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.7.0"}, "pmix"),
    (OPENMPI, "pmix"),
    (SLURM_STEP, "none"),  # srun --mpi=none
])
def test_the_pmi_is_read_from_the_servers_variables(environ, pmi):
    assert launch_pmi(environ) == pmi


@pytest.fixture(autouse=True)
def no_earlier_settings(monkeypatch):
    """What earlier tests set is not this test's: the record starts empty."""
    monkeypatch.setattr(settings, "_applied", {})


#: the real reader of /proc/self/maps: the tests' process may have loaded an MPI itself
READ_MAPPED = mpi_library.mapped


@pytest.fixture(autouse=True)
def nothing_loaded_yet(monkeypatch) -> None:
    monkeypatch.setattr(mpi_library, "mapped", lambda maps=None: [])


@pytest.fixture(autouse=True)
def node_decision(monkeypatch) -> list[str]:
    """No real probe here (its peers are not running): "off", and the hosts asked, recorded.
    launcher.mpi.cma's own tests and tests/test_cma.py run the real one."""
    asked: list[str] = []

    def decision(env):
        asked.append(env.hostname)
        return cma.Decision(False, "faked")

    monkeypatch.setattr(cma, "node_decision", decision)
    return asked


@pytest.fixture
def unloaded(monkeypatch, bundled) -> None:
    """No library loaded yet in this process as the module sees it, ``bundled`` the image's."""
    monkeypatch.setattr(mpi_library, "_loaded", None)
    monkeypatch.setattr(mpi_library, "BUNDLED_MPICH", bundled[0])
    monkeypatch.setattr(mpi_library, "BUNDLED_OPENMPI", bundled[1])
    monkeypatch.delitem(mpi_library.sys.modules, "mpi4py.MPI", raising=False)


def _library(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(b"")
    return directory / name


@pytest.fixture
def bundled(tmp_path) -> tuple[Path, Path]:
    """A venv's MPICH and a prefix's Open MPI, as in the image."""
    return (_library(tmp_path / "venv" / "lib", "libmpi.so.12"),
            _library(tmp_path / "openmpi" / "lib", "libmpi.so.40"))


def choose(environ: dict[str, str], bundled) -> mpi_library.MpiChoice:
    return mpi_library.choose(detect_environment(environ, hostname="n1"), bundled)


@pytest.mark.parametrize("environ, abi", [
    (HYDRA, "mpich"),
    ({**SLURM_STEP, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "4"}, "mpich"),
    ({**SLURM_STEP, "PMIX_RANK": "1"}, "openmpi"),
    (OPENMPI, "openmpi"),
    ({}, "mpich"),
])
def test_the_launchers_pmi_picks_the_bundled_mpi(environ, abi, bundled):
    choice = choose(environ, bundled)
    assert (choice.abi, Path(choice.path)) == (abi, bundled[abi == "openmpi"])


@pytest.mark.parametrize("name, abi", [("libmpi.so.12", "mpich"), ("libmpich.so.12", "mpich"),
                                       ("libmpi.so.40", "openmpi"), ("libmpi.so", "")])
def test_a_libmpi_bound_in_on_ld_library_path_wins(tmp_path, bundled, name, abi):
    host = _library(tmp_path / "host-mpi" / "lib", name)
    path = f"{tmp_path / 'empty'}:{host.parent}:{bundled[0].parent}"
    for environ in (HYDRA, OPENMPI):
        choice = choose({**environ, "LD_LIBRARY_PATH": path}, bundled)
        assert (choice.abi, choice.path) == (abi, str(host))
        assert "LD_LIBRARY_PATH" in choice.reason


def test_the_bundled_directories_on_ld_library_path_do_not_count_as_bound_in(bundled):
    choice = choose({**OPENMPI, "LD_LIBRARY_PATH": str(bundled[0].parent)}, bundled)
    assert choice.path == str(bundled[1])


def test_the_users_mpi4py_variables_are_left_alone(bundled):
    choice = choose({**HYDRA, "MPI4PY_LIBMPI": "/site/libmpi.so"}, bundled)
    assert (choice.path, choice.reason) == ("", "MPI4PY_LIBMPI=/site/libmpi.so (set by the user)")


@pytest.mark.parametrize("names, abi", [
    (("libmpi_abi.so.1",), "mpiabi"),
    (("libmpi_abi.so", "libmpi.so.12"), "mpich"),  # MPICH builds both: its own ABI first
])
def test_the_mpi5_standard_abi_is_taken_when_it_is_alone(tmp_path, bundled, names, abi):
    for name in names:
        _library(tmp_path / "abi", name)
    assert choose({**HYDRA, "LD_LIBRARY_PATH": str(tmp_path / "abi")}, bundled).abi == abi


def test_a_standard_abi_library_without_the_extension_is_an_error_with_a_hint(monkeypatch,
                                                                               tmp_path):
    import mpi4py

    monkeypatch.setattr(mpi4py, "__file__", str(tmp_path / "mpi4py" / "__init__.py"))
    choice = mpi_library.MpiChoice("mpiabi", "/host/lib/libmpi_abi.so.1", "test")
    with pytest.raises(LaunchError) as error:
        mpi_library._offer_standard_abi(choice)
    assert "MPI-5 standard ABI" in error.value.message and "libmpi.so.12" in error.value.hint
    mpi_library._offer_standard_abi(mpi_library.MpiChoice("mpich", "/x/libmpi.so.12", "test"))


def test_load_points_mpi4py_at_the_choice_once(monkeypatch, bundled, unloaded):
    environ: dict[str, str] = {}  # what load() writes, kept from the rest of the session
    monkeypatch.setattr(settings.os, "environ", environ)
    env = detect_environment(HYDRA, hostname="n1")
    assert mpi_library.load(env).path == str(bundled[0])
    assert environ["MPI4PY_LIBMPI"] == str(bundled[0])
    assert "MPI4PY_MPIABI" not in environ  # it would make mpi4py skip loading the path
    assert environ[single_copy.CMA_VARIABLE] == "0"  # the node's decision (faked: off)
    assert mpi_library.IALLREDUCE_VARIABLE not in environ  # one node: MPICH's own choice
    # a second call, even for another launch, keeps the first choice: mpi4py loads once
    assert mpi_library.load(detect_environment(OPENMPI, hostname="n1")).path == str(bundled[0])


def test_the_choice_outlives_the_variable_load_writes(monkeypatch, bundled, unloaded):
    """In the image, the .pth line loads before any entry point: the JobEnv the entry point
    detects then carries load's own MPI4PY_LIBMPI, which must not read as the user's request
    (it turned --backend auto into gloo across the compose cluster's nodes)."""
    environ: dict[str, str] = {}
    monkeypatch.setattr(settings.os, "environ", environ)
    assert mpi_library.chosen(detect_environment(HYDRA, hostname="n1")).bundled_mpich
    mpi_library.load(detect_environment(HYDRA, hostname="n1"))
    later = detect_environment({**HYDRA, **environ}, hostname="n1")
    assert later.mpi4py_request == f"MPI4PY_LIBMPI={bundled[0]}"
    assert not mpi_library.choose(later).bundled_mpich  # read afresh: "set by the user"
    assert mpi_library.chosen(later).bundled_mpich


@pytest.mark.parametrize("environ, cause", [
    (SLURM_STEP, "srun started the tasks without a PMI"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}, "torchrun offers no MPI"),
])
def test_a_launch_without_pmi_cannot_start_mpi(monkeypatch, environ, cause):
    monkeypatch.setattr(mpi_library, "_loaded", mpi_library.MpiChoice("mpich", "", "test"))
    with pytest.raises(LaunchError) as error:
        mpi_library.ensure_startable(detect_environment(environ, hostname="n1"))
    assert cause in error.value.message and "--backend gloo" in error.value.hint


def test_pmix_with_the_bundled_mpich_is_refused_before_it_aborts(monkeypatch):
    choice = mpi_library.MpiChoice("mpich", str(mpi_library.BUNDLED_MPICH), "test")
    monkeypatch.setattr(mpi_library, "_loaded", choice)
    with pytest.raises(LaunchError) as error:
        mpi_library.ensure_startable(detect_environment({**SLURM_STEP, "PMIX_RANK": "1"},
                                                        hostname="n1"))
    assert "does not speak" in error.value.message and "--mpi=pmi2" in error.value.hint


@pytest.mark.parametrize(("environ", "on", "expected"), [
    (HYDRA, True, {single_copy.CMA_VARIABLE: "1", huge_pages.VARIABLE: "1"}),
    (HYDRA, False, {single_copy.CMA_VARIABLE: "0"}),
    (OPENMPI, True, {single_copy.SMSC_VARIABLE: "cma", huge_pages.VARIABLE: "1"}),
    (OPENMPI, False, {single_copy.SMSC_VARIABLE: "^cma"}),
])
def test_the_nodes_decision_switches_the_bundled_mpis_single_copy(monkeypatch, unloaded, capsys,
                                                                   environ, on, expected):
    """With single copy on, torch's large buffers go into huge pages too (which CMA copies
    faster); with it off they gain nothing and keep 4 KiB pages."""
    monkeypatch.setattr(cma, "node_decision", lambda env: cma.Decision(on, "why"))
    monkeypatch.setattr(huge_pages, "system_mode", lambda: "madvise")
    written: dict[str, str] = {}
    monkeypatch.setattr(settings.os, "environ", written)
    mpi_library.load(detect_environment(environ, hostname="n1"))
    assert {k: v for k, v in written.items() if k != "MPI4PY_LIBMPI"} == expected
    assert capsys.readouterr().err == ""  # local rank 1: only local rank 0 speaks


@pytest.mark.parametrize(("user", "expected"), [(None, "^posix"), ("tcp,sysv", "tcp,sysv")])
def test_ranks_in_several_user_namespaces_keep_ucx_off_its_posix_shared_memory(
        monkeypatch, unloaded, user, expected):
    decision = cma.Decision(False, "2 user namespaces", one_namespace=False)
    monkeypatch.setattr(cma, "node_decision", lambda env: decision)
    written = {} if user is None else {single_copy.UCX_TLS: user}
    monkeypatch.setattr(settings.os, "environ", written)
    mpi_library.load(detect_environment(HYDRA, hostname="n1"))
    assert written[single_copy.UCX_TLS] == expected  # the user's own value wins


def test_local_rank_0_says_the_decision_in_one_line(monkeypatch, bundled, capsys):
    monkeypatch.setattr(mpi_library, "_loaded", None)
    monkeypatch.setattr(mpi_library, "BUNDLED_MPICH", bundled[0])
    monkeypatch.delitem(mpi_library.sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setattr(settings.os, "environ", {})
    mpi_library.load(detect_environment({**HYDRA, "MPI_LOCALRANKID": "0"}, hostname="n1"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(CMA) on n1: off" in err and "faked" in err
    assert "0.46x" in err  # what it costs


@pytest.mark.parametrize("environ", [
    {**HYDRA, single_copy.CMA_VARIABLE: "1"},  # the user's setting wins
    {**OPENMPI, single_copy.SMSC_VARIABLE: "cma"},
    {**HYDRA, "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0"},  # no local peer
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
     "MASTER_ADDR": "n1", "MASTER_PORT": "29500"},  # torchrun: no MPI
])
def test_no_probe_where_there_is_nothing_to_decide(monkeypatch, bundled, unloaded, node_decision,
                                                   environ):
    written = {k: v for k, v in environ.items() if k.endswith(("_ENABLE", "_smsc"))}
    monkeypatch.setattr(settings.os, "environ", written)
    mpi_library.load(detect_environment(environ, hostname="n1"))
    assert node_decision == []
    assert written.get(single_copy.CMA_VARIABLE) == environ.get(single_copy.CMA_VARIABLE)
    assert written.get(single_copy.SMSC_VARIABLE) == environ.get(single_copy.SMSC_VARIABLE)


@pytest.mark.parametrize("name", ["libmpi.so.12", "libmpi.so.40"])
def test_a_host_mpi_bound_in_keeps_its_own_single_copy_setting(monkeypatch, tmp_path, bundled,
                                                               node_decision, name):
    """Only the bundled MPIs (and Open MPI 4, above) are told: a host MPI's variables may mean
    something else. Open MPI 5 copes with ranks in separate user namespaces by itself."""
    host = _library(tmp_path / "host", name)
    monkeypatch.setattr(mpi_library, "_loaded", None)
    monkeypatch.setattr(mpi_library, "BUNDLED_MPICH", bundled[0])
    monkeypatch.delitem(mpi_library.sys.modules, "mpi4py.MPI", raising=False)
    written: dict[str, str] = {}
    monkeypatch.setattr(settings.os, "environ", written)
    env = detect_environment({**HYDRA, "LD_LIBRARY_PATH": str(host.parent)}, hostname="n1")
    assert mpi_library.load(env).path == str(host)
    assert node_decision == [] and single_copy.CMA_VARIABLE not in written


@pytest.mark.parametrize(("on", "expected"), [(False, "none"), (True, None)])
def test_a_host_open_mpi_4_bound_in_has_its_vader_single_copy_off_where_cma_fails(
        monkeypatch, tmp_path, unloaded, on, expected):
    """Open MPI before 5 (ORTE beside its libmpi) hangs across user namespaces (test_cma.py);
    where CMA works its own choice stays (it may have XPMEM or KNEM)."""
    host = _library(tmp_path / "host", "libmpi.so.40")
    _library(host.parent, "libopen-rte.so.40")
    monkeypatch.setattr(cma, "node_decision", lambda env: cma.Decision(on, "why"))
    written: dict[str, str] = {}
    monkeypatch.setattr(settings.os, "environ", written)
    env = detect_environment({**HYDRA, "LD_LIBRARY_PATH": str(host.parent)}, hostname="n1")
    assert mpi_library.load(env).path == str(host)
    assert written.get(single_copy.VADER[0]) == expected
    assert single_copy.SMSC_VARIABLE not in written
    assert huge_pages.VARIABLE not in written  # its own mechanism stays: no huge pages asked
    decided = single_copy.decided()
    assert decided is None if on else decided[0] is False and "off: why" in decided[1]


@pytest.mark.parametrize(("size", "per_node", "user", "expected"), [
    ("6", "2", None, "tsp_ring"),  # 3 nodes, 6 ranks: the ring
    ("3", "1", None, "tsp_ring"),
    ("6", "2", "auto", "auto"),  # the user's value wins
    ("4", "2", None, None),  # a power of two: MPICH's own halving and doubling
    ("8", "1", None, None),
    ("3", "3", None, None),  # one node: its shared-memory algorithms
])
def test_across_nodes_the_bundled_mpich_reduces_in_a_ring(monkeypatch, bundled, size,
                                                           per_node, user, expected):
    monkeypatch.setattr(mpi_library, "_loaded", None)
    monkeypatch.setattr(mpi_library, "BUNDLED_MPICH", bundled[0])
    monkeypatch.delitem(mpi_library.sys.modules, "mpi4py.MPI", raising=False)
    environ = {} if user is None else {mpi_library.IALLREDUCE_VARIABLE: user}
    monkeypatch.setattr(settings.os, "environ", environ)
    env = detect_environment({**HYDRA, "PMI_SIZE": size, "MPI_LOCALNRANKS": per_node,
                              "MPI_LOCALRANKID": "0"},
                             hostname="n1")
    mpi_library.load(env)
    assert environ.get(mpi_library.IALLREDUCE_VARIABLE) == expected


def test_a_host_mpich_keeps_its_own_all_reduce_across_nodes(monkeypatch, tmp_path, bundled):
    """MPIR_CVAR values differ between MPICH releases and derivatives: only ours is told."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "libmpi.so.12").touch()
    monkeypatch.setattr(mpi_library, "_loaded", None)
    monkeypatch.setattr(mpi_library, "BUNDLED_MPICH", bundled[0])
    monkeypatch.delitem(mpi_library.sys.modules, "mpi4py.MPI", raising=False)
    environ: dict[str, str] = {}
    monkeypatch.setattr(settings.os, "environ", environ)
    env = detect_environment({**HYDRA, "PMI_SIZE": "6", "MPI_LOCALNRANKS": "2",
                              "LD_LIBRARY_PATH": str(host)}, hostname="n1")
    assert mpi_library.load(env).path == str(host / "libmpi.so.12")
    assert mpi_library.IALLREDUCE_VARIABLE not in environ


def test_a_venv_without_open_mpi_under_pmix_is_refused_with_the_ways_out(monkeypatch, tmp_path,
                                                                        node_decision):
    """The venv of scripts/bootstrap.sh has MPICH only: under srun --mpi=pmix it would abort."""
    venv_mpich = _library(tmp_path / "venv" / "lib", "libmpi.so.12")
    monkeypatch.setattr(mpi_library, "_loaded", None)
    monkeypatch.setattr(mpi_library, "BUNDLED_MPICH", venv_mpich)
    monkeypatch.setattr(mpi_library, "BUNDLED_OPENMPI", tmp_path / "none" / "libmpi.so.40")
    monkeypatch.setattr(settings.os, "environ", {})
    env = detect_environment({**SLURM_STEP, "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.7.0"},
                             hostname="n1")
    assert mpi_library.choose(env).path == str(venv_mpich)
    with pytest.raises(LaunchError) as error:
        mpi_library.ensure_startable(env)
    assert "does not speak" in error.value.message
    for way_out in ("--mpi=pmi2", "image", "MPI4PY_LIBMPI"):
        assert way_out in error.value.hint
    assert node_decision == []  # no probe of the node's peers for a launch that is refused


MAPS = """\
7f10 r-xp 00000000 08:01 123 /opt/ompi/lib/libmpi.so.40.30.1
7f20 r--p 00200000 08:01 123 /opt/ompi/lib/libmpi.so.40.30.1
7f30 r-xp 00000000 08:01 124 /opt/ompi/lib/libmpi_mpifh.so.40.30.0
7f40 r-xp 00000000 08:01 125 /opt/ompi/lib/libmpi_cxx.so.40
7f50 r-xp 00000000 08:01 126 /venv/lib/libmpi.so.12
7f60 rw-p 00000000 00:00 0
"""


def test_the_loaded_libmpis_are_read_in_load_order_without_their_bindings():
    assert READ_MAPPED(MAPS) == ["/opt/ompi/lib/libmpi.so.40.30.1", "/venv/lib/libmpi.so.12"]


def test_a_libmpi_loaded_already_wins_over_every_other_rule(tmp_path, bundled):
    """A torch built with MPI loads its libmpi as it is imported, and mpi4py takes a loaded
    one before any other: the choice says so."""
    host = _library(tmp_path / "host" / "lib", "libmpi.so.12")
    for environ in ({**HYDRA, "LD_LIBRARY_PATH": str(host.parent)},
                    {**HYDRA, "MPI4PY_LIBMPI": "/site/libmpi.so"}):
        choice = mpi_library.choose(detect_environment(environ, hostname="n1"), bundled,
                                    loaded=["/opt/ompi/lib/libmpi.so.40.30.1"])
        assert (choice.abi, choice.path) == ("openmpi", "/opt/ompi/lib/libmpi.so.40.30.1")
        assert "already loaded" in choice.reason
    # a bundled one keeps its own name: its single-copy decision and PMI rules still apply
    env = detect_environment(OPENMPI, hostname="n1")
    choice = mpi_library.choose(env, bundled, loaded=[str(bundled[0].resolve())])
    assert (choice.abi, choice.path) == ("mpich", str(bundled[0]))


def test_a_libmpi_loaded_after_the_choice_is_chosen_again(monkeypatch, bundled, unloaded):
    """In the image the choice is made as Python starts, before torch is imported."""
    environ: dict[str, str] = {}
    monkeypatch.setattr(settings.os, "environ", environ)
    env = detect_environment(OPENMPI, hostname="n1")
    assert mpi_library.load(env).path == str(bundled[1])
    monkeypatch.setattr(mpi_library, "mapped", lambda: [str(bundled[1].resolve())])
    assert mpi_library.load(env).path == str(bundled[1])  # the same library: kept
    monkeypatch.setattr(mpi_library, "mapped", lambda: [str(bundled[0].resolve())])
    with pytest.raises(LaunchError) as error:  # MPICH under PMIx: explained, not aborted
        mpi_library.ensure_startable(env)
    assert "does not speak" in error.value.message
    assert environ["MPI4PY_LIBMPI"] == str(bundled[0])


#: a rank whose process loaded a libmpi of its own after the image's start-up choice, as a
#: torch built with MPI does
PRELOADED = """\
import ctypes, sys
import launcher.mpi.library
launcher.mpi.library.at_startup()  # the image's .pth line, as Python starts
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # as a torch built with MPI is imported
import torch, torch.distributed as dist
import launcher
from launcher.mpi import library
with launcher.distributed(backend="mpi", timeout_s=60) as job:
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {job.env.rank}: sum {t.item():.0f}, libmpis {library.mapped()}, "
          f"chosen {library.chosen(job.env).path}", flush=True)
"""


@pytest.mark.mpi
def test_ranks_run_on_and_name_the_libmpi_their_process_loaded(tmp_path):
    """A copy of the venv's MPICH at another path stands for torch's own: both ranks run on
    it alone, and the launcher's choice (what launcher.check and the rules read) names it;
    before, it named the venv's library that mpi4py had passed over."""
    venv_lib = Path(sys.prefix) / "lib"
    if not (venv_lib / "libmpi.so.12").exists():
        pytest.skip("no MPICH wheel in the venv")
    own = tmp_path / "lib" / "libmpi.so.12"
    own.parent.mkdir()
    shutil.copy(venv_lib / "libmpi.so.12", own)
    (own.parent / "mpich").symlink_to(venv_lib / "mpich")  # its RUNPATH: $ORIGIN/mpich
    result = run_mpi(2, ["-c", PRELOADED, str(own)], timeout=120)
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        assert f"rank {rank}: sum 2, libmpis {[str(own)]}, chosen {own}" in result.stdout, \
            result.output
