"""A training rank's mappings of its arena slots, and the background prefault of the slots it has not used yet.

The persister creates and sizes the slot files (:mod:`snapckpt.persister.arena`); a rank maps the slot the persister
hands it and copies its snapshot in. The first copy into a freshly mapped slot takes one page fault per
4 KiB page on the training thread (measured here: 1.1-1.4 s per GiB against 0.4-0.5 s for a copy into
mapped pages, on a loaded 2-core VM). So once a rank knows its snapshot size it maps its *other* slots at
that size on one background thread with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+; older kernels read one
byte per page): the kernel maps every page writable in one call and leaves the data as it is, so a slot that
holds an older snapshot a load still needs is unchanged; the save that first uses such a slot finds it mapped and
takes no page fault. A save that comes before the prefault has ended takes its mapping over as far as it got, and
its copy maps the rest (a new mapping of the slot would fault in every page again).
The slots of a reservation ahead of the first save (``expected_nbytes``, a restart) are
mapped with ``MADV_POPULATE_READ`` instead (:attr:`MappedSlot.zeroed`): the persister wrote their pages
(:mod:`snapckpt.persister.arena`), and a read fault on such pages maps the 16 around it at once (the kernel's
fault-around), writable, since a tmpfs tracks no dirty pages, where a write fault maps one page (less than half
the time: docs/performance.md). On pages not yet zeroed (``posix_fallocate``) each read fault
zeroes its own page, and fault-around finds nothing to map: ``MADV_POPULATE_WRITE`` is faster there.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before ours: see _EXITING)
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from snapckpt.persister.arena import map_slot, slot_file_name
from snapckpt.engine.device_copy import CudaCopier
from snapckpt.engine.span_write import SlotFile
from snapckpt.errors import SnapckptError

__all__ = ["MappedSlot", "SlotMaps"]

_PAGE = mmap.PAGESIZE
_PREFAULT_CHUNK = 16 << 20  # bytes prefaulted between two looks at the stop flag and at a pause (SlotMaps.pause)
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # <linux/mman.h>; Python's mmap module names them from 3.13

# Set at interpreter exit before concurrent.futures joins its worker threads (threading's exit hooks run
# last registered first), so a pending prefault ends then instead of holding the exit until its timeout:
# an exit that leaves close() to an atexit handler (the Megatron-LM flag path) runs it only after that join.
_EXITING = threading.Event()
try:
    threading._register_atexit(_EXITING.set)  # type: ignore[attr-defined]  (what concurrent.futures uses)
except (AttributeError, RuntimeError):  # another Python; or imported during the exit itself
    pass


class MappedSlot:
    """One slot file mapped read-write into this process.

    Attributes:
        path: the slot file; nbytes: the mapped length (bytes).
        buf: the ``mmap``; tensor: a ``uint8`` tensor of shape ``(nbytes,)`` over it.
        cuda: the :class:`~snapckpt.engine.device_copy.CudaCopier` that page-locked it, once CUDA copies used it.
        views: typed views of ``tensor`` by state layout, made by the Stager's copies (dropped on close).
        populated: bytes from the start that a prefault or :meth:`populate` has mapped.
        busy: held by a background prefault while it maps a chunk; :meth:`close` waits for it.
        zeroed: the persister wrote zeros into its pages (a reservation ahead of the first save): they are mapped
            with read faults (see the module docstring).
        ident: the mapped file's ``(st_dev, st_ino)``: a restore reads the file at :attr:`path` only while it is
            this one (:mod:`snapckpt.engine.span_read`).
        file: the slot file for a save's ``pwritev`` (:class:`~snapckpt.engine.span_write.SlotFile`): its descriptor
            is opened by the first save that writes by file and closed by :meth:`close`.

    Raises (constructor): ``OSError`` / :class:`~snapckpt.errors.SnapshotError` when the file cannot be mapped.
    """

    def __init__(self, path: str, nbytes: int, zeroed: bool = False) -> None:
        self.path, self.nbytes, self.zeroed = path, nbytes, zeroed
        ident: List[tuple] = []
        self.buf = map_slot(path, nbytes, ident)
        self.ident: Optional[tuple] = ident[0]  # the mapped file's (st_dev, st_ino): snapckpt.engine.span_read
        self.file = SlotFile(path, self.ident)
        self.tensor = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.cuda: Optional[CudaCopier] = None
        self.views: Dict[Any, List[torch.Tensor]] = {}
        self.populated = 0
        # held by a prefault while it maps a chunk: close() waits for it (the save that took the mapping over may
        # unmap it meanwhile; a read of an unmapped page, the fallback of a kernel before 5.14, is a SIGSEGV)
        self.busy = threading.Lock()

    def populate(self, upto: int) -> None:
        """Map the first ``upto`` bytes (at most :attr:`nbytes`) of a :attr:`zeroed` slot that are not mapped yet, on
        the calling thread, before a copy writes them: the rest of a reservation's prefault that was cut short (the
        first save came before it ended). Read faults, 16 pages each (see the module docstring), where the copy's own
        write faults take one per page. A no-op for a slot whose pages are not yet zeroed (a save's own growth, the
        first save of a new job): there the copy's faults zero the pages on all of torch's threads, faster than one
        thread here; and once done (every later save into this mapping). A kernel that refuses leaves the pages to
        the copy's faults."""
        if not self.zeroed:
            return
        upto = min(upto, self.nbytes)
        lo = self.populated - self.populated % _PAGE  # madvise takes a page-aligned start (EINVAL otherwise)
        if self.populated < upto and _populate(self, lo, upto - lo):
            self.populated = upto

    def map_for_reading(self, upto: int) -> None:
        """Map the first ``upto`` bytes (at most :attr:`nbytes`) before a restore reads them: one
        ``MADV_POPULATE_READ`` (the pages hold the snapshot, in the page cache) instead of a page fault per 4 KiB page
        in the copy, which a fresh mapping (a restarted process) would take; the data is not changed. A kernel
        without it (before 5.14), or one that refuses: nothing, the copy's faults map the pages."""
        upto = min(upto, self.nbytes)
        if upto > self.populated and _load_madvise() and self.tensor is not None:
            with self.busy:
                _madvise(self.tensor.data_ptr(), upto, _MADV_POPULATE_READ)

    def fits(self, path: str, nbytes: int) -> bool:
        """Whether this mapping is of ``path`` at exactly ``nbytes`` bytes."""
        return self.path == path and self.nbytes == nbytes

    def close(self) -> None:
        """Unmap (after unregistering the pages from CUDA and waiting for any DMA into them) and close the slot
        file's descriptor (:attr:`file`)."""
        self.file.close()
        with self.busy:  # not under a prefault's chunk
            if self.cuda is not None and self.tensor is not None:
                torch.cuda.synchronize()  # no DMA may still target the mapping
                self.cuda.unregister(self.tensor)
            self.views.clear()  # they hold the mapping's buffer
            self.tensor = None
            try:
                self.buf.close()
            except BufferError:  # a tensor view is still alive somewhere; the mapping goes with it
                pass


class _Made:
    """The mapping a prefault has made so far, shared with the save that takes it over while the prefault still runs
    (:meth:`_Pending.take`): once ``adopted``, the prefault thread neither closes it nor writes its ``populated`` any
    more, and returns it at its next chunk. ``lock`` makes the hand-over and the prefault's closing exclusive."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mapping: Optional[MappedSlot] = None
        self.adopted = False

    def adopt(self) -> Optional[MappedSlot]:
        """The mapping made so far, now the caller's (``None``: none made yet)."""
        with self.lock:
            if self.mapping is not None:
                self.adopted = True
            return self.mapping


@dataclass
class _Pending:
    """A background prefault of one slot: its future, its stop flag, what it maps, its hand-over flag (set with
    ``stop``: return the mapping as far as it is populated, for a save that needs it now), and the mapping it has
    made so far (``made``)."""

    future: Any
    stop: threading.Event
    path: str
    nbytes: int
    handoff: threading.Event
    made: _Made

    def take(self, wanted: bool, wait: bool = True) -> Optional[MappedSlot]:
        """The mapping if ``wanted`` and it got made; otherwise stop it and unmap what it made. A ``wanted`` mapping
        the prefault has made already is taken over at once, however far it got (the prefault stops at its next
        chunk; the copy maps the rest: its write faults, or :meth:`MappedSlot.populate`), rather than waited for or
        mapped anew: a new mapping of the slot would fault in every page again, even those mapped already. Not made
        yet (the prefault waits for the persister's growth): ``wait=False`` stops it (``None``; the save maps the
        slot itself), ``wait=True`` waits for it to map the slot and hand it over."""
        if self.future.cancel():  # still queued behind another slot's prefault
            return None
        if wanted:
            m = self.made.adopt()
            if m is not None:
                self.handoff.set()
                self.stop.set()
                return m
        if not wanted:
            self.stop.set()  # it may be waiting for a growth this save will not ask for
        if not wait and not self.future.done():
            self.stop.set()
            self.future.add_done_callback(_close_result)
            return None
        if wanted and not self.future.done():
            # a save waits: the prefault hands its mapping over once made, and the save maps the rest itself
            # (MappedSlot.populate, before its copy)
            self.handoff.set()
            self.stop.set()
        m = self.future.result()
        if m is not None and not wanted:
            m.close()
            return None
        return m


class SlotMaps:
    """This rank's slot mappings, by slot index.

    Args:
        rank: the global rank (names the slot files, :func:`~snapckpt.persister.arena.slot_file_name`).
        slots_per_rank: how many slots the rank has.
        wait_timeout_secs: how long a prefault waits for the persister to grow a slot (seconds).
    """

    def __init__(self, rank: int, slots_per_rank: int, wait_timeout_secs: float) -> None:
        self.rank, self.slots_per_rank, self.wait_timeout_secs = rank, slots_per_rank, wait_timeout_secs
        self.maps: Dict[int, MappedSlot] = {}
        self._pending: Dict[int, _Pending] = {}
        self._thread: Optional[cf.ThreadPoolExecutor] = None  # started on first use
        self._limit = 0  # the slot limit of the last acquire (see set_limit)
        self._go = threading.Event()  # cleared while a load reads (see pause): prefaults wait
        self._go.set()

    def get(self, slot: int, path: str, nbytes: int, usable: Optional[List[int]] = None,
            wait_prefault: bool = True) -> MappedSlot:
        """The mapping of ``slot`` (file ``path``) at ``nbytes`` bytes: the one made before, the prefaulted
        one, or a new one (remapped when the slot grew); then start prefaulting the other slots at ``nbytes``
        (those in ``usable``, the slots the persister lets this rank use; ``None``: all of them).
        ``wait_prefault=False``: a prefault of ``slot`` still running is not waited for; the slot is mapped
        anew and the copy into it takes the page faults left (the overlapped copy, off the training thread).

        Raises: ``OSError`` / :class:`~snapckpt.errors.SnapshotError` when it cannot be mapped.
        """
        m = self.maps.get(slot)
        pending = self._pending.pop(slot, None)
        if pending is not None:
            self._go.set()  # wanted now (a load's fn may save): paused prefaults go on, this one in their queue
        pre = pending.take(wanted=(pending.path, pending.nbytes) == (path, nbytes),
                           wait=wait_prefault) if pending else None
        if pre is not None or m is None or not m.fits(path, nbytes):
            if m is not None:
                m.close()
            m = self.maps[slot] = pre if pre is not None else MappedSlot(path, nbytes)
        if usable is not None or not self._limit:  # under a limit, only the persister knows which slots
            self._prefault_others(slot, os.path.dirname(path), nbytes, usable)
        return m

    def set_limit(self, limit: int) -> None:
        """The rank's slot limit (0: all slots) for the next ``acquire``. When it changes, every pending
        prefault is stopped first: the persister empties (truncates) slots beyond a new limit, and a prefault
        reading a truncated file would die of SIGBUS."""
        if limit == self._limit:
            return
        self._limit = limit
        pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.stop.set()
        for p in pending:
            p.take(wanted=False)

    def pause(self, paused: bool) -> None:
        """Hold back (``True``) or resume the background prefaults: a load that reads a checkpoint holds them,
        so that mapping fresh shared memory does not compete with its read for the CPUs; the wait for the
        persister's growth does not count towards ``wait_timeout_secs`` meanwhile. :meth:`get` of a slot
        being prefaulted resumes them."""
        if paused:
            self._go.clear()
        else:
            self._go.set()

    def prefault(self, slot: int, path: str, nbytes: int) -> None:
        """Map ``slot`` (file ``path``) at ``nbytes`` bytes on the background thread, once the persister has
        grown it that far (a reservation made before the first save); :meth:`get` then finds it mapped."""
        have = self.maps.get(slot)
        if slot in self._pending or (have is not None and have.fits(path, nbytes)):
            return
        if self._thread is None:
            self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-prefault")
        stop, handoff, made = threading.Event(), threading.Event(), _Made()
        fut = self._thread.submit(_prefault, path, nbytes, self.wait_timeout_secs, stop, self._go, handoff, True, made)
        self._pending[slot] = _Pending(fut, stop, path, nbytes, handoff, made)

    def _prefault_others(self, slot: int, arena_dir: str, nbytes: int, usable: Optional[List[int]]) -> None:
        for other in (range(self.slots_per_rank) if usable is None else usable):
            have = self.maps.get(other)
            if other == slot or other in self._pending or (have is not None and have.nbytes == nbytes):
                continue
            if self._thread is None:
                self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-prefault")
            path = os.path.join(arena_dir, slot_file_name(self.rank, other))
            stop, handoff, made = threading.Event(), threading.Event(), _Made()
            fut = self._thread.submit(_prefault, path, nbytes, self.wait_timeout_secs, stop, self._go, handoff, False,
                                      made)
            self._pending[other] = _Pending(fut, stop, path, nbytes, handoff, made)

    def drop(self) -> None:
        """Stop every prefault and unmap every slot (a new persister recreates the slot files)."""
        pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.stop.set()
        for p in pending:
            p.take(wanted=False)
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def close(self) -> None:
        """:meth:`drop`, then stop the prefault thread."""
        self.drop()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _close_result(future: cf.Future) -> None:
    """Unmap the mapping a prefault made after its save stopped waiting for it."""
    m = None if future.cancelled() or future.exception() is not None else future.result()
    if m is not None:
        m.close()


def _prefault(path: str, nbytes: int, timeout_secs: float, stop: threading.Event,
              go: threading.Event, handoff: threading.Event, zeroed: bool, made: _Made) -> Optional[MappedSlot]:
    """Map slot file ``path`` once the persister has grown it to ``nbytes`` (``zeroed``: a reservation, its pages
    written: :attr:`MappedSlot.zeroed`) and populate every page (:func:`_populate`); with ``handoff`` set at
    ``stop`` (a save needs the slot now), the mapping as far as it is populated. The mapping is in ``made`` from the
    moment it exists: a save that takes it over there (:meth:`_Pending.take`) owns it, and this thread stops at its
    next chunk without closing it. ``None`` when it did not grow within ``timeout_secs`` (not counting time paused:
    ``go`` clear), ``stop`` was set without ``handoff``, the file is still short once ``handoff`` is set (the save's
    acquire grew it before: it is another file now), the interpreter is exiting (:data:`_EXITING`: no save will
    use it, and the exit joins this thread), or it could not be mapped (the save that needs it maps it itself)."""
    deadline = time.monotonic() + timeout_secs
    delay = 0.005
    while True:
        if not go.is_set():
            t0 = time.monotonic()
            if not _wait_go(go, stop):
                return None
            deadline += time.monotonic() - t0
            delay = 0.005
        wanted = handoff.is_set()  # read before the stat: the save's acquire grew the file before it set this
        try:
            if os.stat(path).st_size >= nbytes:
                break
        except FileNotFoundError:
            pass
        if wanted:
            # the file at the path is not the one the persister grew (replaced, truncated or removed by someone
            # else): it never grows now; the save maps the slot itself, which names the cause, instead of
            # waiting out the timeout
            return None
        if time.monotonic() > deadline or _EXITING.is_set():
            return None
        if stop.wait(delay) and not handoff.is_set():
            return None
        delay = min(delay * 2, 0.2)
    try:
        m = MappedSlot(path, nbytes, zeroed)
    except (OSError, SnapckptError):
        return None
    with made.lock:
        made.mapping = m

    def give_up() -> Optional[MappedSlot]:
        # a save that took the mapping over owns it: it is not closed here
        with made.lock:
            if made.adopted:
                return m
            made.mapping = None
        m.close()
        return None

    for lo in range(0, nbytes, _PREFAULT_CHUNK):
        # taken over: the save maps the rest. stop: the save that needs this slot takes the faults left itself
        # (handoff: in this mapping); go clear: a load reads, wait for it
        if made.adopted:
            return m
        if stop.is_set() or (not go.is_set() and not _wait_go(go, stop)):
            return m if handoff.is_set() else give_up()
        with m.busy:
            if m.tensor is None:  # closed by the save that took it over
                return m
            ok = _populate(m, lo, min(_PREFAULT_CHUNK, nbytes - lo))
        if not ok:
            return give_up()
        with made.lock:
            if made.adopted:  # the save that took it over maps the rest; its own populate sets ``populated``
                return m
            m.populated = min(lo + _PREFAULT_CHUNK, nbytes)  # a save handed this mapping maps only the rest
    return m


_madvise = None  # libc's madvise (ctypes: the call releases the GIL, which mmap.madvise holds), False: none


def _load_madvise() -> bool:
    """Whether libc's ``madvise`` is at hand (:data:`_madvise`, looked up once)."""
    global _madvise
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return bool(_madvise)


def _populate(m: MappedSlot, lo: int, n: int) -> bool:
    """Map bytes ``[lo, lo + n)`` of ``m`` writable without changing them (``MADV_POPULATE_READ`` when ``m.zeroed``,
    else ``MADV_POPULATE_WRITE``: see the module docstring), or read one byte per page where the kernel lacks them;
    ``False`` when the kernel refused (a file truncated meanwhile: the save maps the slot itself)."""
    global _madvise
    if _load_madvise():
        if _madvise(m.tensor.data_ptr() + lo, n, _MADV_POPULATE_READ if m.zeroed else _MADV_POPULATE_WRITE) == 0:
            return True
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: a kernel before 5.14; anything else: give up
            return False
        _madvise = False
    m.tensor[lo:lo + n:_PAGE].sum()  # a read fault per page maps it; no write, no change to the data
    return True


def _wait_go(go: threading.Event, stop: threading.Event) -> bool:
    """Wait until ``go`` is set; ``False`` when ``stop`` is set or the interpreter exits meanwhile."""
    while not go.wait(0.1):
        if stop.is_set() or _EXITING.is_set():
            return False
    return not stop.is_set()
