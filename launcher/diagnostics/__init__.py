"""The cluster self-check behind python -m launcher.check.

The cluster self-check behind ``python -m launcher.check``: what each rank reports and
how ranks compare, and ``--preflight``, which names slow nodes.

May import: every layer below, up to ``launcher.api``; not ``launcher.training``.
"""
