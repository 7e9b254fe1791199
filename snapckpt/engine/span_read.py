"""Copy many small spans of a mapped slot into live CPU tensors by ``preadv(2)`` of the slot file.

A restore of many small tensors spends more on the calls than on the bytes: ``torch._foreach_copy_`` costs about
1.3 us per tensor on the CPU, a ctypes ``memmove`` about 0.6 us, and a process that did not write the slot (a
restart) also maps each of its pages first. ``preadv`` copies the spans in the kernel instead, straight from the
slot file's pages (the same pages the mapping shows) into the tensors: one system call per :data:`_BATCH` spans,
each span an iovec of its tensor's bytes followed by one for the alignment gap to the next span (into a scratch
buffer), and no page of the slot mapped into the process. 200,000 spans of 1.3 KiB: about 0.11 s, against 0.25 s
for a ``_foreach_copy_`` of the same tensors and 0.25 s for mapping the slot and a ``memmove`` each (2-core VM,
2026-12-05; docs/performance.md).

The file is the mapping's only when its device and inode are those recorded when the slot was mapped
(:attr:`~snapckpt.engine.slot_maps.MappedSlot.ident`). Anything this module cannot do (no ``preadv`` in libc, another
file at the path, spans out of order or too far apart, a failed or short read) it reports by the count of spans it
copied, and the caller copies the rest from the mapping: every span is copied exactly once, in order.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from array import array
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["libc_vectored", "open_slot_file", "read_spans", "vectored_call", "vectored_calls"]

_BATCH = 512  # spans per call: two iovecs each, IOV_MAX (1024 on Linux) per call
_GAP_MAX = 4096  # bytes of the scratch buffer the gaps between spans are read into
_SCRATCH = ctypes.create_string_buffer(_GAP_MAX)
_preadv = None  # libc's preadv (ctypes: the call releases the GIL); False when there is none
#: A vectored copy of at least this many bytes per thread is split among threads (:func:`vectored_calls`): the
#: kernel copies tmpfs pages on the calling thread, about 5.5 GB/s each here (1 GiB of 200,000 spans in 188 ms on one
#: thread, 110 ms on two; 2-core VM, 2026-12-05); below it a thread's start and a busy core cost more than they save.
SPLIT_NBYTES = 32 << 20
MAX_THREADS = 4  # at most this many threads (and no more than torch's intra-op threads) copy one restore's spans


def libc_vectored(name: str):
    """libc's ``preadv`` or ``pwritev`` (``name``) as a ctypes function ``(fd, iovec table address, iovec count,
    file offset) -> bytes or -1`` that releases the GIL, or ``False`` when there is none or the ABI is not 64-bit
    (the iovec tables here are int64 pairs: a 64-bit ABI's ``struct iovec``)."""
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return False
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols in the process
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
    fn.restype = ctypes.c_ssize_t
    return fn


def open_slot_file(path: str, flags: int, ident: tuple, end: int) -> Optional[int]:
    """A descriptor of the slot file ``path`` opened with ``flags``, or ``None`` when it cannot be opened, is not the
    mapped file (``ident``: its ``(st_dev, st_ino)``) or is shorter than ``end`` bytes. The caller closes it."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != ident or st.st_size < end:
        os.close(fd)
        return None
    return fd


def vectored_call(fn, fd: int, iov: int, count: int, offset: int) -> int:
    """``fn(fd, iov, count, offset)`` (:func:`libc_vectored`), again while it is interrupted (EINTR): bytes moved,
    or -1."""
    while True:
        got = fn(fd, iov, count, offset)
        if got >= 0 or ctypes.get_errno() != errno.EINTR:
            return got


def _calls_from(fn, fd: int, base: int, calls: Sequence[Tuple[int, int, int, int]], out: list, at: int) -> None:
    for i, k, off, nbytes in calls:
        if vectored_call(fn, fd, base + 32 * i, 2 * k, off) != nbytes:
            out[at] = i
            return


def vectored_calls(fn, fd: int, base: int, calls: Sequence[Tuple[int, int, int, int]]) -> Optional[int]:
    """Make the ``calls`` ``(first span, spans, file offset, bytes)`` of ``fn`` (:func:`libc_vectored`) on ``fd``
    with the iovec table at address ``base`` (two ``struct iovec`` per span: 32 bytes); a copy of
    :data:`SPLIT_NBYTES` or more per thread is split into runs of consecutive calls of about equal bytes, one per
    thread (the calling one and up to :data:`MAX_THREADS` - 1 more, no more than ``torch.get_num_threads()``; each
    call releases the GIL; a part whose thread cannot be started is read by the calling thread). Returns ``None``
    when every call moved its bytes, else the first span of the first call that did not (a failed or short call);
    calls after it may have run too, so the caller copies from that span on again (the same bytes)."""
    total = sum(c[3] for c in calls)
    parts = max(1, min(MAX_THREADS, torch.get_num_threads(), total // SPLIT_NBYTES, len(calls)))
    out: list = [None] * parts
    if parts == 1:
        _calls_from(fn, fd, base, calls, out, 0)
        return out[0]
    cuts, acc = [0], 0
    for j, c in enumerate(calls):  # cut where the running bytes pass each part's share
        acc += c[3]
        if len(cuts) < parts and acc * parts >= total * len(cuts):
            cuts.append(j + 1)
    cuts.append(len(calls))
    groups = [calls[a:b] for a, b in zip(cuts, cuts[1:])]
    threads, mine = [], [0]  # the started threads; the parts the calling thread reads
    try:
        for w, g in enumerate(groups[1:], 1):
            if g:
                t = threading.Thread(target=_calls_from, args=(fn, fd, base, g, out, w), daemon=True,
                                     name="snapckpt-span-read")
                try:
                    t.start()
                except RuntimeError:  # no thread to be had (a process or cgroup limit): this part is read here
                    mine.append(w)
                    continue
                threads.append(t)
        for w in mine:
            _calls_from(fn, fd, base, groups[w], out, w)
    finally:  # never return (or raise) while a thread still writes into the caller's memory
        for t in threads:
            t.join()
    failed = [i for i in out if i is not None]
    return min(failed) if failed else None


def _load() -> bool:
    global _preadv
    if _preadv is None:
        _preadv = libc_vectored("preadv")
    return bool(_preadv)


def read_spans(path: str, ident: Optional[tuple], ptrs: "List[int] | array", offsets: torch.Tensor,
               nbytes: torch.Tensor) -> int:
    """Copy bytes ``[offsets[i], offsets[i] + nbytes[i])`` of the slot file ``path`` to address ``ptrs[i]`` for each
    ``i`` in order, by ``preadv``; return how many leading spans were copied (``len(ptrs)``: all).

    Args:
        path: the slot file; ident: ``(st_dev, st_ino)`` of the file that is mapped (``None``: unknown, nothing is
            read).
        ptrs: the destinations: each the start of ``nbytes[i]`` writable bytes (a live contiguous CPU tensor's data);
            a list of ints or an ``array("q")``.
        offsets, nbytes: int64 tensors of ``len(ptrs)`` items: the spans in the file (byte offsets, sizes), in
            ascending order, each gap to the next (alignment) under 4 KiB; otherwise nothing is read.

    Errors are not raised: a file that cannot be opened or is not ``ident``, or a read that fails or comes back
    short, ends the copy there; the spans from the returned index on are the caller's to copy.
    """
    n = len(ptrs)
    if not n or ident is None or not _load():
        return 0
    iov = _iovecs(ptrs, offsets, nbytes)
    if iov is None:
        return 0  # not spans in order (a layout this module does not know): the caller copies
    end = int(offsets[-1]) + int(nbytes[-1])
    fd = open_slot_file(path, os.O_RDONLY, ident, end)
    if fd is None:
        return 0
    try:
        starts = offsets[::_BATCH].tolist() + [end]  # each batch reads its spans and the gaps after them
        calls = [(k * _BATCH, min(_BATCH, n - k * _BATCH), starts[k], starts[k + 1] - starts[k])
                 for k in range(len(starts) - 1)]
        failed = vectored_calls(_preadv, fd, iov.data_ptr(), calls)
        return n if failed is None else failed  # from that batch on the caller's to copy (again: the same bytes)
    finally:
        os.close(fd)


#: Rows of the iovec table filled per torch call: under PyTorch's grain size (32,768), so that no call wakes its
#: thread pool (on a loaded host a wake-up costs more than the work).
_ROWS = 32_000


def _iovecs(ptrs: "List[int] | array", offsets: torch.Tensor, nbytes: torch.Tensor) -> Optional[torch.Tensor]:
    """The iovec table of :func:`read_spans` (int64, ``(len(ptrs), 4)``: ``struct iovec`` pairs per span, its
    tensor's bytes then the gap to the next span in the scratch buffer), or ``None`` when a span is out of order,
    of a negative size or followed by a gap of 4 KiB or more."""
    n = len(ptrs)
    iov = torch.empty((n, 4), dtype=torch.int64)
    given = torch.frombuffer(ptrs, dtype=torch.int64) if isinstance(ptrs, array) else None  # no int objects made
    for a in range(0, n, _ROWS):
        b = min(n, a + _ROWS)
        iov[a:b, 0] = given[a:b] if given is not None else torch.tensor(ptrs[a:b], dtype=torch.int64)
        iov[a:b, 1] = nbytes[a:b]
        iov[a:b, 2] = ctypes.addressof(_SCRATCH)
        gaps = iov[a:b, 3]
        if b < n:
            torch.sub(offsets[a + 1:b + 1], offsets[a:b], out=gaps)
        else:
            gaps[-1] = nbytes[b - 1]  # the last span: no gap after it (0 below)
            torch.sub(offsets[a + 1:b], offsets[a:b - 1], out=gaps[:-1])
        gaps.sub_(nbytes[a:b])
        if int(gaps.min()) < 0 or int(gaps.max()) >= _GAP_MAX or int(nbytes[a:b].min()) < 0:
            return None
    return iov
