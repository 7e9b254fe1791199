"""Page-cache prefetch of a restart's newest checkpoint while the node persister starts (issue 18).

When a restarted job finds no live persister (a lost node, or a job that ended), its Checkpointer starts one
and waits for it (the constructor's error contract: a persister that cannot start raises there); that costs
a Python start and the persister's imports, some 0.3-0.6 s. The first ``load`` after it reads this rank's
file of the newest checkpoint from a cold page cache. :class:`Prefetch` reads that file into the page cache
on a background thread while the persister starts, so that the load's own pass
(:mod:`snapckpt.engine.disk_restore`, which verifies the checksum and fills the live tensors) finds the
bytes cached.

Nothing is trusted from it: it only asks the kernel to read the file named by the tracker
``checkpoint_dir/latest`` into the page cache (``POSIX_FADV_WILLNEED``, piece by piece: no byte of the tensors is
copied into this process, which the load's own read then does once); the load still agrees on its candidate with
every rank, checks the size and checksum, and a wrong guess (another step agreed, the file damaged or gone) costs
only the read. It reads at most half of ``MemAvailable`` (the pages must still be cached when the load reads
them) and stops at :meth:`Prefetch.stop`.

Order: a ``torch.save`` archive's directory is at its end and each record's local header sits just before its
bytes, spread through the file; the load reads all of them (:func:`~snapckpt.engine.disk_restore.read_into`)
before its pass in file order. So the pages of the directory (read here: its last 64 KiB), of ``data.pkl`` and of
every local header are asked for first, then the whole file in order: the load finds its metadata cached and
starts its pass while the kernel still reads the bulk, instead of waiting, header by header, behind it.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from typing import List, Optional, Tuple

from snapckpt.persister.arena import mem_available_bytes

__all__ = ["Prefetch", "CHUNK", "header_ranges"]

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes per WILLNEED request (the stop flag is looked at between two)
HEAD_NBYTES = 4096  # bytes asked for at each local header (the header and its name fit in a page)
HEAD_GAP = 1 << 20  # headers closer than this are asked for as one range (a run of small records)
MAX_HEADS = 8192  # archives with more records skip the header pass (parsing their directory costs more)
_TAIL = 65536 + 22 + 20  # the end of central directory record, its comment and the zip64 locator
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory: signature, disks, entries (4H), size, offset
_EOCD64_LOC = struct.Struct("<4sLQL")  # zip64 locator: signature, disk, offset of the zip64 record, disks
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end record: ..., entries on disk, entries, size, offset


def _entries(fd: int, size: int) -> Optional[int]:
    """Number of records of the zip archive open as ``fd`` (``size`` bytes), from its end records; ``None`` when
    it is not a zip archive. Reads the file's last ``_TAIL`` bytes (which the load's own zip parse then finds
    cached)."""
    n = min(size, _TAIL)
    tail = os.pread(fd, n, size - n)
    i = tail.rfind(b"PK\x05\x06")
    if i < 0 or len(tail) - i < _EOCD.size:
        return None
    entries = _EOCD.unpack_from(tail, i)[4]
    if entries != 0xFFFF:
        return entries
    if i < _EOCD64_LOC.size or tail[i - _EOCD64_LOC.size:i - _EOCD64_LOC.size + 4] != b"PK\x06\x07":
        return None
    rec = os.pread(fd, _EOCD64.size, _EOCD64_LOC.unpack_from(tail, i - _EOCD64_LOC.size)[2])
    return _EOCD64.unpack(rec)[7] if len(rec) == _EOCD64.size and rec[:4] == b"PK\x06\x06" else None


def header_ranges(path: str, fd: int, size: int) -> List[Tuple[int, int]]:
    """``[(offset, nbytes)]`` in file order covering the local header of every record of the zip archive ``path``
    (open as ``fd``, ``size`` bytes) and the whole of its ``data.pkl``; headers closer than :data:`HEAD_GAP` share
    one range. ``[]`` when it is not a zip archive, is damaged, or holds more than :data:`MAX_HEADS` records."""
    import zipfile

    entries = _entries(fd, size)
    if entries is None or entries > MAX_HEADS:
        return []
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except Exception:  # noqa: BLE001 -- a hint only: a damaged archive is the load's to report
        return []
    spans = sorted((i.header_offset, HEAD_NBYTES + (i.file_size if i.filename.endswith("/data.pkl") else 0))
                   for i in infos)
    out: List[List[int]] = []
    for off, n in spans:
        if out and off <= out[-1][1] + HEAD_GAP:
            out[-1][1] = max(out[-1][1], off + n)
        else:
            out.append([off, off + n])
    return [(lo, min(hi, size) - lo) for lo, hi in out if lo < size]


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
                    size = os.fstat(fd).st_size
                    # the load's metadata first (module docstring), then the file in order
                    for off, n in header_ranges(path, fd, size):
                        os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
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
