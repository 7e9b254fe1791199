"""Copy many small CPU tensors into a mapped slot by ``pwritev(2)`` of the slot file (a save's copy).

A save of many small tensors spends more on the calls than on the bytes: ``torch._foreach_copy_`` into typed views
of the slot costs about 1.1 us per tensor on the CPU. ``pwritev`` copies the same spans in the kernel, from the live
tensors straight into the slot file's pages (the pages the mapping shows: tmpfs, the same memory), one system call
per :data:`_BATCH` spans: 200,000 tensors of 1.3 KiB 0.076 s against 0.23 s for the ``_foreach_copy_`` (2-core VM,
2026-12-05; docs/performance.md). The call returns once the bytes are in the pages, so a tensor changed after the
save returned does not change the slot, and anything written to the slot after it (the header) comes after them.

The iovec table (each span's source address and size, then the alignment gap to the next span, written from a
buffer of zeros) is kept with the plan: :class:`SpanWrites` holds the layout's part (which spans, where, the calls)
and refills the addresses only when the data pointers differ from those it was filled with (the plan's quick check
reads them every save, :class:`~snapckpt.engine.layout_check.Recheck`). Gaps between spans are not part of any record:
the slot format leaves their bytes unspecified (the torch copy leaves what was there); here they become zeros.

The file is the mapping's only when its device and inode are those recorded when the slot was mapped
(:attr:`~snapckpt.engine.slot_maps.MappedSlot.ident`); its descriptor is opened once and kept with the mapping
(:class:`SlotFile`, ``MappedSlot.file``). Anything this module cannot do (no ``pwritev`` in libc, another
file at the path, a failed or short write) it reports by the count of spans it wrote, and the caller copies the
rest through the mapping.
"""
from __future__ import annotations

import ctypes
import math
import os
import weakref
from itertools import islice
from operator import lt
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from snapckpt.engine.span_read import libc_vectored, open_slot_file, vectored_call, vectored_calls

__all__ = ["SMALL_NBYTES", "SlotFile", "SpanWrites", "read_back", "write_spans"]

#: Tensors of fewer bytes are written by ``pwritev``; larger ones stay on torch's copy. ``pwritev`` into tmpfs costs
#: about 0.25 ms per MiB whatever the span size (the kernel's per-page work), torch's copy 1 us per tensor plus less
#: per byte: per tensor 0.3 against 0.9 us at 1 KiB, 1.1 against 2.1 us at 4 KiB, even at 8 KiB, 15 against 7 us at
#: 64 KiB (64 MiB of each size, 2-core VM, load 2, 2026-12-05).
SMALL_NBYTES = 8 << 10
#: Below this many small tensors a layout keeps torch's copy (nothing worth a table and an ``open``).
MIN_SPANS = 256
#: Fewer consecutive small tensors in the slot than this stay on torch's copy: a call (about 2 us with ctypes) must
#: carry enough spans to gain on torch's 1 us per tensor (``pwritev`` about 0.4 us per span of 1.3 KiB).
MIN_RUN = 16
_BATCH = 512  # spans per call: two iovecs each, IOV_MAX (1024 on Linux) per call
_GAP_MAX = 64  # the Stager's alignment: a larger gap (or another span between) ends a run of spans
_ZEROS = ctypes.create_string_buffer(_GAP_MAX)  # the gaps' bytes
_SCRATCH = ctypes.create_string_buffer(_GAP_MAX)  # where read_back reads the gaps' bytes (never into _ZEROS)
_ROWS = 32_000  # rows filled per torch call: under PyTorch's grain size (no thread-pool wake-up), see span_read
_pwritev = None  # libc's pwritev (ctypes: the call releases the GIL); False when there is none
_preadv = None  # libc's preadv, for read_back; False when there is none


def _load() -> bool:
    global _pwritev
    if _pwritev is None:
        _pwritev = libc_vectored("pwritev")
    return bool(_pwritev)


def _load_read() -> bool:
    global _preadv
    if _preadv is None:
        _preadv = libc_vectored("preadv")
    return bool(_preadv)


class SpanWrites:
    """The spans of one layout's direct tensors that :func:`write_spans` writes, and their iovec table.

    Attributes:
        pos: positions (in the layout's direct tensors) of the spans written, in ascending slot offset.
        rest: positions of the other direct tensors (larger ones, short runs), ascending: not written here.
        sel: int64 tensor: per written span, the index of its tensor in the save's tensors (the data pointers' list).
        batches: ``(first span, spans, file offset, bytes)`` per call, in order.
        end: the first byte after the last span (the file must be at least that long).
        iov: int64 ``(len(pos), 4)``: per span its ``struct iovec`` then the gap's (zeros; length 0 at a run's end);
            ``ptrs``: the data pointers list its addresses were filled from (``None``: not filled yet).
        back: ``(ptrs, table)``: :attr:`iov` with the gaps read into a scratch buffer (:func:`read_back`), made from
            the addresses of that ``ptrs`` list (``None``: not made yet).
    """

    __slots__ = ("pos", "rest", "sel", "batches", "end", "iov", "ptrs", "back")

    @classmethod
    def make(cls, direct: Sequence[int], dst: Sequence[Tuple[int, torch.dtype, tuple, tuple]], small: Sequence[int]
             ) -> Optional["SpanWrites"]:
        """The writes of a layout whose direct tensors are the save's tensors ``direct`` (indices) with slot views
        ``dst`` (``(slot byte offset, dtype, shape, stride)``, contiguous), of which those at positions ``small``
        (ascending) are under :data:`SMALL_NBYTES` and not empty (the caller's size partition); ``None`` when fewer
        than :data:`MIN_SPANS` of them are in runs of :data:`MIN_RUN` or more, or there is no ``pwritev``."""
        if not _load() or len(small) < MIN_SPANS:
            return None
        pos = list(small)
        offsets = [dst[j][0] for j in pos]
        sizes = [dst[j][1].itemsize * math.prod(dst[j][2]) for j in pos]
        small_set = set(pos)
        rest = [j for j in range(len(dst)) if j not in small_set] if len(pos) < len(dst) else []
        if not all(map(lt, offsets, islice(offsets, 1, None))):  # the plan's order is the slot's: not seen
            order = sorted(range(len(pos)), key=offsets.__getitem__)
            pos, offsets, sizes = [pos[k] for k in order], [offsets[k] for k in order], [sizes[k] for k in order]
        # runs of spans one call can write (each gap to the next an alignment's); a run too short to save more than
        # its calls cost (small tensors between large ones: a GPT layer's) stays on torch's copy
        runs, first = [], 0
        for last in _breaks(offsets, sizes) + [len(pos) - 1]:
            if last + 1 - first >= MIN_RUN:
                runs.append((first, last + 1))
            first = last + 1
        if sum(b - a for a, b in runs) < MIN_SPANS:
            return None
        if len(runs) > 1 or runs[0] != (0, len(pos)):
            keep = [i for a, b in runs for i in range(a, b)]
            kept = set(map(pos.__getitem__, keep))
            rest = sorted(rest + [j for j in pos if j not in kept])
            pos, offsets, sizes = [pos[i] for i in keep], [offsets[i] for i in keep], [sizes[i] for i in keep]
            starts, at = [], 0  # each kept run's first span, among the kept ones
            for a, b in runs:
                starts.append(at)
                at += b - a
            runs = starts
        else:
            runs = [0]
        self = cls()
        self.pos, self.rest = pos, rest
        self.sel = torch.tensor(list(map(direct.__getitem__, pos)), dtype=torch.int64)
        n = len(pos)
        iov = torch.zeros((n, 4), dtype=torch.int64)
        iov[:, 1] = torch.tensor(sizes, dtype=torch.int64)
        iov[:, 2] = ctypes.addressof(_ZEROS)
        off_t = torch.tensor(offsets, dtype=torch.int64)
        if n > 1:
            torch.sub(off_t[1:], off_t[:-1] + iov[:-1, 1], out=iov[:-1, 3])
        ends = [a - 1 for a in runs[1:]] + [n - 1]  # each run's last span: no gap written after it
        iov[ends, 3] = 0
        gaps = iov[:, 3]
        self.batches = []
        for first, last in zip(runs, ends):
            for i in range(first, last + 1, _BATCH):
                k = min(_BATCH, last + 1 - i)
                j = i + k - 1
                self.batches.append((i, k, offsets[i], offsets[j] + sizes[j] + int(gaps[j]) - offsets[i]))
        self.end = offsets[-1] + sizes[-1]  # ascending, disjoint
        self.iov, self.ptrs, self.back = iov, None, None
        return self

    def fill(self, ptrs: List[int]) -> bool:
        """Take the spans' source addresses from ``ptrs`` (the data pointers of the save's tensors, a list kept
        unchanged: a later save with the same list object reuses them); ``False`` when one is null."""
        if ptrs is self.ptrs:
            return True
        self.ptrs = None
        n = len(ptrs)
        every = torch.empty(n, dtype=torch.int64)
        for a in range(0, n, _ROWS):
            every[a:a + _ROWS] = torch.tensor(ptrs[a:a + _ROWS], dtype=torch.int64)
        col = self.iov[:, 0]
        col.copy_(every[self.sel])
        if int(col.min()) <= 0:
            return False
        self.ptrs = ptrs
        return True


    def read_table(self) -> Optional[torch.Tensor]:
        """The iovec table of :func:`read_back` for the addresses filled now (:meth:`fill`), made once per fill;
        ``None`` when none are filled."""
        ptrs = self.ptrs
        if ptrs is None:
            return None
        if self.back is None or self.back[0] is not ptrs:
            table = self.iov.clone()
            for a in range(0, len(table), _ROWS):  # under the grain size: no thread-pool wake-up
                table[a:a + _ROWS, 2] = ctypes.addressof(_SCRATCH)
            self.back = (ptrs, table)
        return self.back[1]


def _breaks(offsets: List[int], sizes: List[int]) -> List[int]:
    """Indices of the spans (ascending ``offsets``, byte ``sizes``) after which a call must end: the next span is not
    the next one of the slot (a gap of :data:`_GAP_MAX` bytes or more: another span lies between)."""
    off = torch.tensor(offsets, dtype=torch.int64)
    gaps = off[1:] - off[:-1] - torch.tensor(sizes[:-1], dtype=torch.int64)
    return ((gaps < 0) | (gaps >= _GAP_MAX)).nonzero().flatten().tolist()


class SlotFile:
    """The slot file behind one mapping (:class:`~snapckpt.engine.slot_maps.MappedSlot`), for :func:`write_spans`.

    The descriptor is opened (read-write, close-on-exec) at the first :meth:`descriptor` and kept until :meth:`close`
    (the mapping's), so a save costs one ``stat`` of the path instead of an ``open``, ``fstat`` and ``close``. A
    descriptor the owner forgets to close is closed when this object is collected (or at exit); a forked child
    shares it (writes at explicit offsets: no shared file position) and an exec'd program never gets it.

    Attributes:
        path: the slot file; ident: ``(st_dev, st_ino)`` of the file that is mapped (``None``: unknown, nothing is
            written by file).
    """

    __slots__ = ("path", "ident", "_fd", "_closer", "__weakref__")

    def __init__(self, path: str, ident: Optional[tuple]) -> None:
        self.path, self.ident = path, ident
        self._fd: Optional[int] = None
        self._closer: Optional[weakref.finalize] = None

    def descriptor(self, end: int) -> Optional[int]:
        """The kept descriptor of the mapped file while the file at :attr:`path` is still it (another file renamed
        over it: ``None``, the caller copies through the mapping) and at least ``end`` bytes long; ``None`` too when
        it cannot be opened or :meth:`close` ran. Not to be closed by the caller."""
        if self.ident is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        if (st.st_dev, st.st_ino) != self.ident or st.st_size < end:
            return None
        if self._fd is None:
            fd = open_slot_file(self.path, os.O_RDWR, self.ident, end)
            if fd is None:
                return None
            self._fd, self._closer = fd, weakref.finalize(self, os.close, fd)
        return self._fd

    @property
    def is_open(self) -> bool:
        """Whether a descriptor is kept now."""
        return self._fd is not None

    def close(self) -> None:
        """Close the kept descriptor (if any); a later :meth:`descriptor` gives ``None``."""
        closer, self._closer, self._fd, self.ident = self._closer, None, None, None
        if closer is not None:
            closer()


def write_spans(fd: Optional[int], writes: SpanWrites, at: Optional[int], halfway: Callable[[], None]) -> int:
    """Write the spans of ``writes`` (addresses filled, :meth:`SpanWrites.fill`) into the slot file open as ``fd``
    (:meth:`SlotFile.descriptor`; ``None``: nothing is written) by ``pwritev``; return how many leading spans (in
    ``writes.pos`` order) were written (all: ``len(writes.pos)``).

    ``halfway`` is called once right before call ``at`` (an index into ``writes.batches``; ``None``: never) when the
    calls get that far: the save's mid-copy fault point. Errors are not raised: a write that fails or comes back short
    ends the copy there; the spans from the returned index on are the caller's to copy (again, for a short write: the
    same bytes).
    """
    if fd is None or writes.ptrs is None or not _load():
        return 0
    base = writes.iov.data_ptr()
    for b, (i, k, off, nbytes) in enumerate(writes.batches):
        if b == at:
            halfway()
        got = vectored_call(_pwritev, fd, base + 32 * i, 2 * k, off)
        if got != nbytes:
            return i
    return len(writes.pos)


def read_back(fd: Optional[int], writes: SpanWrites) -> int:
    """Read the spans of ``writes`` from the slot file open as ``fd`` (:meth:`SlotFile.descriptor`; ``None``: nothing
    is read) back into the addresses the table was filled with (:meth:`SpanWrites.fill`: live tensors that still have
    those data pointers, the caller's check) by ``preadv``, the inverse of :func:`write_spans` (an in-process restore,
    :mod:`snapckpt.engine.slot_restore`; on several threads when large,
    :func:`~snapckpt.engine.span_read.vectored_calls`); the gaps' bytes go to a scratch buffer. Returns how many
    leading spans (in ``writes.pos`` order) were read (all: ``len(writes.pos)``). Errors are not raised: a read that
    fails or comes back short ends the copy there (calls after it may have run too); the spans from the returned
    index on are the caller's to copy (again: the same bytes).
    """
    table = writes.read_table()
    if fd is None or table is None or not _load_read():
        return 0
    failed = vectored_calls(_preadv, fd, table.data_ptr(), writes.batches)  # on several threads when large
    return len(writes.pos) if failed is None else failed
