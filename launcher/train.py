"""``python -m launcher.train``: the training loop of ``launcher.training.train``.

``--help`` is answered from the configuration alone: importing torch takes seconds.
"""

import sys

if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        from launcher.training.config import build_parser

        build_parser().parse_args()  # prints the help, exits 0
    from launcher.training.train import main

    main()
