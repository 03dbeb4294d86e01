"""``python -m launcher.train``: the training loop of ``launcher.training.train``."""

from launcher.training.train import main

if __name__ == "__main__":
    main()
