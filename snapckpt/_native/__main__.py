"""``python -m snapckpt._native build [DIR]`` (see :mod:`snapckpt._native`)."""
import sys

from snapckpt._native import main

if __name__ == "__main__":
    sys.exit(main())
