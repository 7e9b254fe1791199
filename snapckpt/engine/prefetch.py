"""Page-cache prefetch of a restart's newest checkpoint while the node persister starts (issue 18).

When a restarted job finds no live persister (a lost node, or a job that ended), its Checkpointer starts one
and waits for it (the constructor's error contract: a persister that cannot start raises there); that costs
a Python start and the persister's imports, some 0.3-0.6 s. The first ``load`` after it reads this rank's
file of the newest checkpoint from a cold page cache. :class:`Prefetch` reads that file into the page cache
on a background thread while the persister starts, so that the load's own pass
(:mod:`snapckpt.engine.disk_restore`, which verifies the checksum and fills the live tensors) finds the
bytes cached.

Nothing is trusted from it: it only asks the kernel to read the file named by the tracker
``checkpoint_dir/latest`` into the page cache (``POSIX_FADV_WILLNEED``, piece by piece: no byte is copied into
this process, which the load's own read then does once); the load still agrees on its candidate with every
rank, checks the size and checksum, and a wrong guess (another step agreed, the file damaged or gone) costs
only the read. It reads at most half of ``MemAvailable`` (the pages must still be cached when the load reads
them) and stops at :meth:`Prefetch.stop`.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import List, Optional, Tuple

from snapckpt.persister.arena import mem_available_bytes

__all__ = ["Prefetch", "CHUNK"]

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes per WILLNEED request (the stop flag is looked at between two)


class Prefetch:
    """Read ``files`` (``[(path, nbytes)]``) into the page cache on a daemon thread, in order.

    Args:
        files: the files to read and their sizes in bytes (from the manifest; a file of another size is
            read anyway: nothing here is verified).
    """

    def __init__(self, files: List[Tuple[str, int]]) -> None:
        self._files = files
        self._stop = threading.Event()
        self.done = threading.Event()  # set when the thread has finished (read all, stopped, or failed)
        self._thread = threading.Thread(target=self._run, name="snapckpt-prefetch", daemon=True)
        self._thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop after the read in progress and wait for the thread (at most ``timeout`` seconds)."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            budget = (mem_available_bytes() or 0) // 2
            for path, nbytes in self._files:
                left = min(nbytes, budget)
                if left <= 0 or self._stop.is_set():
                    break
                budget -= left
                fd = os.open(path, os.O_RDONLY)
                try:
                    # WILLNEED, not read(): the kernel fills the page cache without a copy into this process (a
                    # read would copy every byte once more than the load's own read does, on a busy node's CPUs)
                    for off in range(0, left, CHUNK):
                        if self._stop.is_set():
                            break
                        os.posix_fadvise(fd, off, min(CHUNK, left - off), os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
        except OSError as e:  # a hint only: the load reads (and reports) the file itself
            log.debug("prefetch of %s stopped: %s", [p for p, _ in self._files], e)
        finally:
            self.done.set()
