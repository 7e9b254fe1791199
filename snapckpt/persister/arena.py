"""The shared-memory arena: one file per (local rank, slot) in a tmpfs, mapped by trainer and persister.

The persister owns the arena: it creates, sizes and deletes the slot files and keeps every slot's state
(:class:`SlotState`) in its own memory. A training process maps the slot files of its rank and copies its
state into the slot the persister hands it. Files are created owner-only (``0o600``) in an owner-only
directory (``0o700``).

Slot bytes (all offsets from the slot start)::

    [0, 64)            header: magic b"SNAPCKPT", layout version, step, index offset, index length; at
                       [56, 64) the copy's watermark (a streamed save: see below)
    [64, ...)          span data, each span 64-byte aligned
    ...                one data.pkl per file, then the index (JSON: ``{"v":2,"step":N,["plain":"<hex>",]"files":[...]}``,
                       :mod:`snapckpt.persister.slot_index`; ``"plain"``: :mod:`snapckpt.formats.plain_digest`)

The header is written last: a slot whose header is not valid never describes a complete snapshot. A
streamed DISK save (:meth:`snapckpt.engine.stager.Stager.copy_into` with ``publish``) writes the pickles
and the index first, then copies the spans in ascending slot offset and after each batch stores the
*watermark*: every span byte below it is final. The persister's writer starts while the copy runs and
never reads a span byte at or above the watermark (:func:`read_watermark`). It is one aligned 8-byte store
and load (a ``memoryview`` cast to ``"Q"``: one machine word, never torn), stored after the batch's copies
returned: on a CPU that keeps stores in order (x86-64) a reader that sees it sees the bytes below it.

Sizing reserves the pages at once, so a too-small ``/dev/shm`` fails here with a clear error instead of a
SIGBUS on first touch later (case D1): ``posix_fallocate``, or, for a reservation ahead of the first save on a
tmpfs, zeros written into the pages (:func:`write_zeros`, ``SlotFiles.ensure_size(zero=True)``). Pages that
``posix_fallocate`` reserved are zeroed by the first fault of each in a rank's mapping, one fault per 4 KiB page;
pages written here are up to date, and a rank maps them with the kernel's fault-around (16 pages per read fault,
writable on a tmpfs), so its background prefault of a reservation (:mod:`snapckpt.engine.slot_maps`) costs less
than half. Writing zeros takes the persister longer than ``posix_fallocate``, so a growth that a save waits for,
or that runs beside one, keeps ``posix_fallocate``. Measurements: docs/performance.md, "First save".
"""
from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import re
import struct
import threading
from typing import Callable, List, Optional, Tuple

from snapckpt._internal.private_dirs import private_dir
from snapckpt.errors import InsufficientSharedMemoryError, PreflightError, SnapshotError
from snapckpt.persister.budget import OtherRanks, fitting_node_setting, fitting_setting, fmt_nbytes

__all__ = ["slot_file_name", "SlotState", "HEADER_NBYTES", "write_header", "read_header", "SlotFiles", "map_slot",
           "mem_available_bytes", "WATERMARK_OFFSET", "watermark_view", "stores_in_order", "write_zeros",
           "fs_type"]

log = logging.getLogger(__name__)

MAGIC = b"SNAPCKPT"
LAYOUT_VERSION = 1
HEADER_NBYTES = 64
GROW_CHUNK = 64 << 20  # bytes reserved per write_zeros by a growth that may pause (SlotFiles.ensure_size)
_ZEROS = bytes(64 << 10)  # the source of write_zeros: small enough to stay in the CPU's cache
_ZEROS_PER_CALL = 128  # of _ZEROS per pwritev (8 MiB)
_HEADER = struct.Struct("<8sIqQQ")  # magic, version, step, index offset, index length
# SlotFiles.path's names, and the peer replicas' (persister/replication.py: one per peer rank, and the
# one being received)
_SLOT_NAME = re.compile(r"r\d{5,}-s\d+|p\d{5,}(\.part)?")
# a dead persister's slot file set aside by the next one (SlotFiles), deleted in the background
_STALE_NAME = re.compile(r"(r\d{5,}-s\d+|p\d{5,}(\.part)?)\.stale-\d+")


class SlotState(str, enum.Enum):
    """Life cycle of a slot: FREE -> WRITING(N) -> READY(N) -> PERSISTING(N) -> READY(N) -> ... ;
    INVALID marks a slot whose writer died mid-copy (never trusted, reused like FREE)."""

    FREE = "FREE"
    WRITING = "WRITING"
    READY = "READY"
    PERSISTING = "PERSISTING"
    INVALID = "INVALID"


def write_header(buf, step: int, index_offset: int, index_nbytes: int) -> None:
    """Write the slot header into ``buf`` (a writable buffer of at least 64 bytes)."""
    _HEADER.pack_into(buf, 0, MAGIC, LAYOUT_VERSION, step, index_offset, index_nbytes)


#: Byte offset of the copy's watermark in the slot header (8 bytes, native byte order; see the module docstring).
WATERMARK_OFFSET = 56


def watermark_view(buf) -> memoryview:
    """A one-item ``"Q"`` view of the watermark of slot mapping ``buf``: ``view[0] = n`` publishes ``n`` (bytes
    from the slot start), ``view[0]`` reads it. Release it (``view.release()``) before the mapping is closed."""
    return memoryview(buf)[WATERMARK_OFFSET:WATERMARK_OFFSET + 8].cast("Q")


def stores_in_order() -> bool:
    """Whether this CPU makes one thread's stores visible to other processes in program order (x86-64's total
    store order), which a streamed save's watermark relies on; elsewhere saves are not streamed."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def read_header(buf) -> Tuple[int, int, int]:
    """Return ``(step, index_offset, index_nbytes)`` from a slot; ``SnapshotError`` if it is not one."""
    magic, version, step, off, n = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != LAYOUT_VERSION:
        raise SnapshotError(f"arena slot has no valid snapckpt header (magic {magic!r}, version {version})")
    return step, off, n


def mem_available_bytes() -> Optional[int]:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class SlotFiles:
    """Persister side: creates and sizes slot files in ``directory``.

    Args:
        directory: the job's arena directory (created ``0o700``). Stale files from a dead persister of the
            same job are removed, since nothing in them can be trusted: renamed aside at once, then deleted on
            a background thread (freeing a GiB of tmpfs pages takes 0.1-0.2 s, which a restart's constructor
            would otherwise wait for before this persister listens; issue 18). :meth:`ensure_size` waits for
            that deletion (:attr:`cleared`), so that the capacity check sees the pages it frees.

    Raises:
        PersisterError: ``directory`` is a symbolic link, not a directory or another user's
            (:func:`snapckpt._internal.private_dirs.private_dir`).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        private_dir(directory)
        # zeros written into the pages on a tmpfs only (the module docstring): on a disk they would be written
        # out, and a hugetlbfs takes no write(2); elsewhere posix_fallocate reserves the blocks, as it always did
        self._zero_fill = fs_type(directory) == "tmpfs"
        stale = []
        for name in os.listdir(directory):
            if _SLOT_NAME.fullmatch(name):
                aside = f"{name}.stale-{os.getpid()}"
                try:
                    os.rename(os.path.join(directory, name), os.path.join(directory, aside))
                except FileNotFoundError:
                    continue
                stale.append(aside)
            elif _STALE_NAME.fullmatch(name):  # set aside by a persister that died before deleting it
                stale.append(name)
        #: set once the stale files found at construction are deleted
        self.cleared = threading.Event()
        if stale:
            threading.Thread(target=self._remove, args=(stale,), name="snapckpt-arena-clear", daemon=True).start()
        else:
            self.cleared.set()

    def _remove(self, names: List[str]) -> None:
        try:
            for name in names:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
        except OSError as e:  # the next persister of the job finds what is left
            log.warning("could not remove stale arena files in %s: %s", self.directory, e)
        finally:
            self.cleared.set()

    def path(self, rank: int, slot: int) -> str:
        """Path of the file of ``slot`` of global ``rank``."""
        return os.path.join(self.directory, slot_file_name(rank, slot))

    def ensure_size(self, rank: int, slot: int, nbytes: int, current_nbytes: int,
                    reserve_nbytes: int = 0, *, slots: int = 1, held_nbytes: int = 0,
                    others: Optional[OtherRanks] = None, pause: Optional[Callable[[], None]] = None,
                    checked: Optional[Callable[[], None]] = None, zero: bool = False) -> int:
        """Make the slot file at least ``nbytes`` long, reserving its pages; return its size in bytes.

        ``pause``: called before each :data:`GROW_CHUNK` bytes are reserved (a background reservation waits
        there while a rank reads a checkpoint: :class:`ReserveHolds`); the file reaches ``nbytes`` with the
        last piece.

        ``reserve_nbytes`` is what the rank's other slots still need to reach ``nbytes``: the capacity
        check counts it too, so an arena that cannot hold every slot fails at the first snapshot, not at
        a later one. ``slots`` (how many slots the rank uses) and ``held_nbytes`` (bytes its slots already
        hold, up to ``nbytes`` each) only shape the error's advice: which ``slots_per_rank`` would fit.

        ``others``: what the node's other local ranks' slots have yet to reserve (bytes), counted in the check too,
        so that this rank's growth never takes the room another rank needs for a slot the persister has counted for
        it (:meth:`snapckpt.persister.slots.SlotTable.acquire`); the advice is then the node's, each rank at its size.

        ``checked``: called once the capacity check passed, before the pages are reserved (the caller starts
        the other slots' growths there, so that they run alongside this one).

        ``zero``: write zeros into the new pages on a tmpfs (see the module docstring), for a growth off the save
        path (a reservation ahead of the first save), where the rank then maps them cheaply; otherwise
        ``posix_fallocate``, which reserves them faster: a save that waits for its slot's growth (or runs beside
        it) lets its copy zero the pages through its own faults, on all of torch's threads.

        Raises:
            InsufficientSharedMemoryError: the tmpfs or RAM cannot hold it (names the bytes needed, the bytes
                available, and the setting that fits).
            PreflightError: the process file-size limit (``ulimit -f``) is below the slot size (names both).
        """
        if nbytes <= current_nbytes:
            return current_nbytes
        self.cleared.wait()  # a dead persister's slot files still being deleted: their pages count as free
        grow = nbytes - current_nbytes
        need = grow + reserve_nbytes
        free, avail = self.room()
        hint = ("lower slots_per_rank (1: one slot, reused) or slot_headroom, set host_memory_budget_nbytes, "
                "point shm_dir= (or the environment variable SNAPCKPT_SHM_DIR) at a larger tmpfs, or save less "
                "state per rank")
        room = min(free, avail) if avail is not None else free
        more = others.nbytes if others is not None else 0
        if need + more > room:
            where = (f"shared-memory directory {self.directory!r} has {free} bytes free" if need + more > free else
                     f"the host has {avail} bytes of RAM available (MemAvailable)")
            mine = (f"the {slots} snapshot slot(s) of rank {rank} need {need} bytes more than they hold "
                    f"({nbytes} bytes per slot, {fmt_nbytes(nbytes * slots)} in all)")
            if others is None or not others.ranks:
                advice = fitting_setting(nbytes, slots, 1, 0, room + held_nbytes)
                raise InsufficientSharedMemoryError(f"{where} but {mine}; {advice}; or: {hint}")
            advice = fitting_node_setting([(nbytes, slots)] + [(n, k) for _, n, k in others.ranks],
                                          room + held_nbytes + others.held)
            theirs = ", ".join(f"rank {r}: {k} x {n} bytes" for r, n, k in others.ranks)
            raise InsufficientSharedMemoryError(
                f"{where} but {mine}, and the slots of this node's other local ranks, counted at the sizes they "
                f"asked for ({theirs}), need {more} bytes more than they hold: this node's arena does not fit "
                f"with these slot counts; {advice}; or: {hint}")
        if checked is not None:
            checked()
        path = self.path(rank, slot)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size > current_nbytes:  # never zero bytes that are there already; reserve them as they are
                    os.posix_fallocate(fd, current_nbytes, min(size, nbytes) - current_nbytes)
                step = nbytes if pause is None else GROW_CHUNK
                for lo in range(max(size, current_nbytes), nbytes, step):
                    if pause is not None:
                        pause()
                    if zero and self._zero_fill:
                        write_zeros(fd, lo, min(lo + step, nbytes))
                    else:
                        os.posix_fallocate(fd, lo, min(lo + step, nbytes) - lo)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    os.ftruncate(fd, current_nbytes)
                    limit = _file_size_limit()
                    if e.errno == errno.EFBIG and limit is not None and limit < nbytes:
                        raise PreflightError(
                            f"the file-size limit of this job's processes (ulimit -f, RLIMIT_FSIZE: {limit} "
                            f"bytes, inherited by the node persister from the rank that started it) is below "
                            f"the snapshot slot size of rank {rank} ({nbytes} bytes): the arena's slot files "
                            "cannot be reserved. Raise the limit before starting the job (ulimit -f unlimited, "
                            "or at least the slot size); nothing was saved") from e
                    raise InsufficientSharedMemoryError(
                        f"could not reserve {nbytes} bytes for the snapshot slot of rank {rank} in "
                        f"{self.directory!r} ({os.strerror(e.errno)}); {hint}") from e
                raise
        finally:
            os.close(fd)
        return nbytes

    def room(self) -> Tuple[int, Optional[int]]:
        """``(free bytes of the arena's filesystem, the host's MemAvailable in bytes or None where unknown)``."""
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize, mem_available_bytes()

    def remove(self, rank: int, slot: int) -> None:
        """Delete the file of ``slot`` of ``rank`` (gone already is fine); its pages return to the tmpfs once
        the last mapping of it is closed."""
        try:
            os.unlink(self.path(rank, slot))
        except FileNotFoundError:
            pass

    def release(self, rank: int, slot: int) -> None:
        """Truncate the file of ``slot`` of ``rank`` to 0 bytes: its pages go back to the host (the file stays,
        for :meth:`ensure_size` to grow again). A file already gone is fine."""
        try:
            os.truncate(self.path(rank, slot), 0)
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        """Delete the slot files and then the directory if it is empty (best effort; files already gone are
        fine). Only names this class creates are deleted: nothing else is ever removed from the directory."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if not (_SLOT_NAME.fullmatch(name) or _STALE_NAME.fullmatch(name)):
                continue
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def fs_type(path: str) -> Optional[str]:
    """Filesystem type of the mount holding ``path`` (from ``/proc/mounts``), ``None`` if unknown."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for mnt, fstype in mounts:
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best[0])):
            best = (mnt, fstype)
    return best[1] if best else None


def write_zeros(fd: int, lo: int, hi: int) -> None:
    """Write zeros into bytes ``[lo, hi)`` of the file ``fd`` (``pwritev`` of a small zero buffer, so nothing
    large is allocated or read): on a tmpfs each page is allocated, zeroed and up to date (see the module
    docstring).

    Raises:
        OSError: the write failed (``ENOSPC`` on a full tmpfs, ``EFBIG`` past ``RLIMIT_FSIZE``); the bytes
            before the failure stay written.
    """
    z = len(_ZEROS)
    while lo < hi:
        n = min(hi - lo, z * _ZEROS_PER_CALL)
        iov = [_ZEROS] * (n // z) + ([memoryview(_ZEROS)[:n % z]] if n % z else [])
        done = os.pwritev(fd, iov, lo)  # a short write goes on from where it stopped; a failure raises
        if done <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        lo += done


def _file_size_limit() -> Optional[int]:
    """This process's soft ``RLIMIT_FSIZE`` in bytes; ``None`` when unlimited or unknown."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def slot_file_name(rank: int, slot: int) -> str:
    """File name of ``slot`` of global ``rank`` in a job's arena directory."""
    return f"r{rank:05d}-s{slot}"


def map_slot(path: str, nbytes: int, ident: Optional[list] = None) -> mmap.mmap:
    """Map ``nbytes`` of a slot file read-write, shared. The file must already be that long. ``ident``: a list that
    gets the mapped file's ``(st_dev, st_ino)`` appended (to tell the file at ``path`` later is this one)."""
    fd = os.open(path, os.O_RDWR)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < nbytes:
            raise SnapshotError(f"slot file {path} is {size} bytes, expected at least {nbytes}")
        if ident is not None:
            ident.append((st.st_dev, st.st_ino))
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
