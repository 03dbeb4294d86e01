"""A rank or peer that fails: heard, named, agreed on, recorded.

A rank or peer that fails: heartbeats, fail fast, a lost peer named, errors agreed across
ranks, preemption, how the process ends (``exits``) and how a job's ending is recorded (exit
status, rank records).

May import: ``launcher.core``, ``launcher.placement``.
"""
