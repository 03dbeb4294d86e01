"""Benchmarks of the launcher, the image and the clusters. Each runs from the repository root
as ``python -m benchmarks.NAME`` (benchmarks/README.md holds the commands and the figures), so
``benchmarks.*``, ``launcher`` and ``ddp_tasks`` import without a path of their own."""

from pathlib import Path

#: the checkout (on a compose cluster's shared volume: the directory holding benchmarks/)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
