"""Shared fixtures live in tests/fixtures/, one module per real service the tests start."""

pytest_plugins = [
    "tests.fixtures.shared",
    "tests.fixtures.mpi",
    "tests.fixtures.training",
    "tests.fixtures.docker",
    "tests.fixtures.slurm",
    "tests.fixtures.cluster",
    "tests.fixtures.host_mpi",
    "tests.fixtures.sif",
    "tests.fixtures.xdist_groups",
    "tests.fixtures.scheduling",
    "tests.fixtures.timing",
]
