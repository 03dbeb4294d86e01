"""Leaves: the user's error, exit statuses, shared defaults, atomic writes, run files, logs.

Leaves every other part builds on: the user-facing error and the exit statuses, the defaults
several parts share, atomic file writes, field documentation read from source, the run
directory's file names, rank-0 logging.

May import: the standard library, torch; nothing else of ``launcher``. The host side
(``ddp_tasks``) imports from here too, so ``errors``, ``defaults``, ``field_docs`` and ``run_files``
stay standard library only.
"""
