"""The training loop behind python -m launcher.train.

``train`` is ``python -m launcher.train``: set-up in ``setup``, the loop in ``loop``; its
configuration and command line (``config``), data sets, models, batches, gradient
synchronisation, evaluation, resuming.

May import: every layer below, up to ``launcher.api``; not ``launcher.diagnostics``.
"""
