"""``python -m launcher.hang DIR``: a hung job's post-mortem, of ``launcher.diagnostics.hang``."""

import sys

from launcher.diagnostics.hang import main

if __name__ == "__main__":
    sys.exit(main())
