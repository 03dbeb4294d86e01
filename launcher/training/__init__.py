"""The training loop behind python -m launcher.train.

The training loop behind ``python -m launcher.train``: its configuration and command line,
data sets, models, batches, gradient synchronisation, evaluation, resuming.

May import: every layer below, up to ``launcher.api``; not ``launcher.diagnostics``.
"""
