"""``python -m launcher.env``: where this process is in the job (``launcher.placement.env``)."""

from launcher.placement.env import main

if __name__ == "__main__":
    main()
