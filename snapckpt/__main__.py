"""``python -m snapckpt``: the ``snapckpt`` command line (see :mod:`snapckpt.cli`)."""
import sys

from snapckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
