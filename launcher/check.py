"""``python -m launcher.check``: the cluster self-check of ``launcher.diagnostics.check``."""

import sys

from launcher.diagnostics.check import main

if __name__ == "__main__":
    sys.exit(main())
