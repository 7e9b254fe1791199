"""``python -m snapckpt.persister``: run the node persister (started by the client, not by hand)."""
import sys

from snapckpt.persister.server import main

if __name__ == "__main__":
    sys.exit(main())
