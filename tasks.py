"""invoke tasks: `invoke --list` shows them; `invoke --help TASK` documents each parameter.

The tasks are thin: each command line is built by a small pure function in ``ddp_tasks``
so that tests can compare it exactly (golden files).
"""

from invoke import Collection

from ddp_tasks import cluster, dev, image, launch, lock, runs, sif_build

ns = Collection()
for task in dev.TASKS + image.TASKS + sif_build.TASKS + lock.TASKS + launch.TASKS + runs.TASKS:
    ns.add_task(task)
ns.add_collection(cluster.ns)
