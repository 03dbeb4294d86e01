"""The bind model's premise, run for real inside the cpu image under Docker: a plain
``from mpi4py import MPI`` (a user's own script, no launcher code) runs 2 ranks on the Intel
MPI runtime when Intel's libmpi.so.12 comes first on LD_LIBRARY_PATH and Intel's mpiexec starts
the ranks (as a site's Intel MPI bound in by Apptainer would): the image's venv chooses the
library as launcher.mpi.library does. Intel MPI comes from PyPI (`impi-rt`), installed on the
host in a prefix of its own and bind-mounted, like a host MPI. The same through ch-run, with
the launcher: tests/test_host_launchers.py.
"""

from __future__ import annotations

import pytest

from tests.fixtures.docker import COLD_BUILD_TIMEOUT
from tests.fixtures.host_mpi import IMPI_ENV, IMPI_VERSION

pytestmark = [pytest.mark.docker, pytest.mark.timeout(COLD_BUILD_TIMEOUT)]

# one write per line: the image runs Python unbuffered, and two ranks share one pipe
HELLO = (
    "import os; from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.Get_rank() + 1); "
    "os.write(1, f'rank {c.Get_rank()}/{c.Get_size()} sum {s} | "
    "{MPI.Get_library_version().splitlines()[0]}\\n'.encode())"
)


def test_image_mpi4py_runs_two_ranks_on_intel_mpi(cpu_image, impi_prefix, run_in_image):
    volumes = {str(impi_prefix): {"bind": "/opt/impi", "mode": "ro"}}
    status, output = run_in_image(
        cpu_image, ["/opt/impi/bin/mpiexec.hydra", "-n", "2", "python", "-c", HELLO],
        environment={**IMPI_ENV, "LD_LIBRARY_PATH": "/opt/impi/lib"}, volumes=volumes)
    assert status == 0, output
    lines = sorted(line for line in output.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}/2 sum 3 | Intel(R) MPI Library {IMPI_VERSION} for Linux* OS"
                     for r in (0, 1)], output


def test_without_the_substitution_the_image_runs_its_own_mpich(cpu_image, run_in_image):
    status, output = run_in_image(cpu_image, ["mpiexec", "-n", "2", "python", "-c", HELLO])
    assert status == 0, output
    lines = [line for line in output.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("MPICH Version:" in line for line in lines), output
