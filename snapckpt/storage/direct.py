"""Direct I/O file writer: large sequential writes that bypass the page cache.

The persister writes a checkpoint once and fsyncs it; the page cache only adds a copy and dirty-page
write-back on the way (measured on this project's VM: a raw ``O_DIRECT`` write + fsync of 1 GiB took
0.7 s, a buffered write + fsync 1.7 s, see ``benchmarks/suite.py``'s ``floor_odirect`` and
``floor_write``). ``O_DIRECT`` needs the buffer address, the file offset and the length aligned to the
device's logical block size, while a ``torch.save`` archive is a stream of records of any length. So
:class:`DirectFile` copies what it is given into a page-aligned bounce buffer and writes it out in full,
aligned blocks; the last, partial block is written padded to the alignment and the file is then cut to
its true length (``ftruncate``). Reference: open(2), "O_DIRECT" (alignment restrictions).

There are :data:`BUFFERS` bounce buffers per file: while up to ``BUFFERS - 1`` of them are written out
(``pwrite`` on background threads, which release the GIL), the caller fills the next one and computes its
checksum, so that the copy and the checksum overlap the device writes instead of adding to them (measured
here at 1 GiB, on a loaded 2-core VM: 0.98-1.34 s with one buffer against a raw ``O_DIRECT`` floor of
0.68-0.73 s). Several writes in flight keep the device's queue full: on this project's VM (virtio disk, 0.5
GiB, O_DIRECT + fsync) one 16 MiB write at a time took 0.31-0.42 s, three 8 MiB writes at a time 0.17-0.21 s,
against a floor of 0.13-0.15 s; the same 32 MiB of buffers as two 16 MiB ones (issue 18).

A caller whose buffer stays unchanged until the file is flushed (the persister's arena slot) may hand it over
with :meth:`DirectFile.write_borrowed` instead: where the buffer's address and the file offset agree modulo
:data:`ALIGN`, its aligned middle is written straight from it, as the write floor of ``benchmarks/suite.py``
writes, without the copy into a bounce buffer. That copy is not free even though it overlaps the device
writes: writing 0.5 GiB with three 8 MiB writes in flight took 0.31 s straight from an anonymous shared mapping
and 0.43 s through bounce buffers (medians of 5, interleaved, load 3-4, 2026-12-05; the copy alone takes 0.04 s).
:mod:`snapckpt.formats.torch_archive` places large records so that they agree (its ``phase``).

A filesystem that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network filesystems) gets an ordinary
buffered file.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import fcntl
import mmap
import os
import threading
from typing import BinaryIO, Optional

__all__ = ["ALIGN", "BORROW_MIN_NBYTES", "BUFFER_NBYTES", "BUFFERS", "DirectFile", "open_direct"]

#: Alignment of O_DIRECT writes (bytes): 4096 covers 512-byte and 4 KiB logical blocks.
ALIGN = 4096
#: Each bounce buffer of an open file (bytes); one write(2) per full buffer.
BUFFER_NBYTES = 8 << 20
#: Bounce buffers per open file: the caller fills one while the others are written out (``_INFLIGHT_NBYTES``).
BUFFERS = 4
#: Bytes of background writes in flight per file at most (bounce buffers and borrowed pieces; bounce buffers alone
#: stay under ``BUFFERS * BUFFER_NBYTES``): the device's queue is kept full by bytes, not by calls (a record's small
#: head write must not take a large write's place). 0.5 GiB of 8 MiB borrowed records: 0.33-0.37 s with 24 MiB,
#: 0.32 s with 64 MiB, against 0.29 s for 8 MiB pieces 3 at a time without checksum and headers (load 2-3).
#: In a ``torch.save`` archive of such records the average is about 26 MiB, not this bound: a record's head goes out
#: in a bounce buffer, and the head four records later waits for that buffer (``_submit``). Keeping the bound full
#: (heads in buffers of their own) made the write slower on this project's VM (1.1-1.5 GB/s against 1.8-2.4, issue
#: 18, docs/performance.md "Time to durable, phase by phase").
_INFLIGHT_NBYTES = 64 << 20
#: :meth:`DirectFile.write_borrowed` copies a buffer shorter than this (bytes) as :meth:`DirectFile.write` does.
BORROW_MIN_NBYTES = 1 << 20

_writers: Optional[cf.ThreadPoolExecutor] = None  # the background pwrite threads, shared by all files
_writers_lock = threading.Lock()


def _writer_pool() -> cf.ThreadPoolExecutor:
    global _writers
    with _writers_lock:
        if _writers is None:
            _writers = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="snapckpt-direct")
        return _writers


def open_direct(path: str, buffered_nbytes: int = 8 << 20) -> BinaryIO:
    """Create ``path`` for writing with ``O_DIRECT`` (a file already there is unlinked first: it may have
    been left read-only by a spec's ``mode``, which a process that is not root cannot open for writing); fall
    back to a buffered file of ``buffered_nbytes`` when the filesystem refuses ``O_DIRECT`` (``EINVAL``)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    if not getattr(os, "O_DIRECT", 0):
        return open(path, "wb", buffering=buffered_nbytes)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return open(path, "wb", buffering=buffered_nbytes)
    return DirectFile(fd, path)


class DirectFile:
    """A write-only binary file object over an ``O_DIRECT`` descriptor (see the module docstring).

    ``write`` copies into a bounce buffer and hands each full buffer to a background thread that writes it
    at its aligned offset (with at most ``_INFLIGHT_NBYTES`` bytes in flight per file), then fills the next
    buffer; ``flush`` waits for them, writes the partial tail padded to :data:`ALIGN` and truncates the file to the
    bytes written so far (after it the file on disk is exactly what was written; later writes go on from
    there); ``close`` flushes. ``fileno`` is the descriptor, for ``os.fsync`` (after ``flush``).

    Raises:
        OSError: from write(2)/ftruncate(2) (``ENOSPC``, ``EFBIG``...), unchanged; a background write's
            error is raised by the next ``write``, ``flush`` or ``close``.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.name = path
        self._fd = fd
        self._bufs = [mmap.mmap(-1, BUFFER_NBYTES) for _ in range(BUFFERS)]  # anonymous mappings are page-aligned
        self._views = [memoryview(b) for b in self._bufs]
        self._next = 0  # index of the buffer being filled
        self._view = self._views[0]  # the buffer being filled
        self._fill = 0  # bytes in it
        self._offset = 0  # file offset of its first byte (aligned)
        # the background writes (bounce buffers and borrowed pieces), oldest first, with their sizes in bytes
        self._pending: collections.deque = collections.deque()
        self._inflight = 0  # bytes of the writes in _pending
        self._buf_writes: list = [None] * BUFFERS  # each bounce buffer's last background write
        self._closed = False
        self._direct = True  # False once a write fell back to buffered I/O (see _write_out)

    # -- file protocol
    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        pos = 0
        while pos < n:
            take = min(n - pos, BUFFER_NBYTES - self._fill)
            self._view[self._fill:self._fill + take] = mv[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == BUFFER_NBYTES:
                self._submit(self._view, BUFFER_NBYTES, self._offset)
                self._offset += BUFFER_NBYTES
                self._fill = 0
        return n

    def _submit(self, view: memoryview, nbytes: int, offset: int) -> None:
        """Write the bounce buffer being filled (``view``: ``nbytes`` at file ``offset``, aligned) in the background,
        and move on to the next one once it is free."""
        self._buf_writes[self._next] = self._write_behind(view, nbytes, offset)
        self._next = (self._next + 1) % BUFFERS
        self._view = self._views[self._next]
        self._wait(_INFLIGHT_NBYTES)
        last = self._buf_writes[self._next]
        while last is not None and not last.done():  # the buffer filled next must be written out
            self._pop()

    def _write_behind(self, view: memoryview, nbytes: int, offset: int) -> cf.Future:
        """Start writing ``view[:nbytes]`` at ``offset`` on a background thread."""
        fut = _writer_pool().submit(self._write_out, view, nbytes, offset)
        self._pending.append((fut, nbytes))
        self._inflight += nbytes
        return fut

    def write_borrowed(self, data, phase: int) -> int:
        """Write ``data`` as :meth:`write` does, but where ``phase`` (``data``'s address modulo :data:`ALIGN`) equals
        the file position's, write its aligned middle straight from ``data`` (at most ``_INFLIGHT_NBYTES`` bytes
        in flight, of :data:`BUFFER_NBYTES` each, shared with the bounce buffers' writes); only the unaligned
        head and tail are copied. ``data`` must stay unchanged until :meth:`flush` or :meth:`close` returns.
        Short buffers (under :data:`BORROW_MIN_NBYTES`), another phase, or a file that fell back to buffered
        I/O: a copy, as :meth:`write`. Returns ``len(data)`` in bytes.

        Raises:
            OSError: as :meth:`write`.
        """
        mv = memoryview(data).cast("B")
        n = len(mv)
        pos = self._offset + self._fill
        if n < BORROW_MIN_NBYTES or not self._direct or (phase - pos) % ALIGN:
            return self.write(mv)
        head = -pos % ALIGN
        if head:
            self.write(mv[:head])
        if self._fill:  # the bounce buffer ends at an aligned offset now: out with it, partly filled
            self._submit(self._view, self._fill, self._offset)
            self._offset += self._fill
            self._fill = 0
        end = head + (n - head) // ALIGN * ALIGN
        for a in range(head, end, BUFFER_NBYTES):
            b = min(end, a + BUFFER_NBYTES)
            self._write_behind(mv[a:b], b - a, self._offset)
            self._offset += b - a
            self._wait(_INFLIGHT_NBYTES)
        if end < n:
            self.write(mv[end:])
        return n

    def flush(self) -> None:
        if self._closed:
            return
        self._wait()
        if self._fill == 0:
            return
        padded = (self._fill + ALIGN - 1) // ALIGN * ALIGN
        self._view[self._fill:padded] = bytes(padded - self._fill)
        self._write_out(self._view, padded, self._offset)
        os.ftruncate(self._fd, self._offset + self._fill)
        # The tail stays in the buffer: a later write continues it and rewrites this block in place.

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._offset + self._fill

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._pending:  # flush raised before waiting: let the writes end, drop their errors
                cf.wait([fut for fut, _ in self._pending])
                self._pending.clear()
            self._view = None
            for v, b in zip(self._views, self._bufs):
                v.release()
                b.close()
            os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals
    def _wait(self, keep_nbytes: int = -1) -> None:
        """Wait for the oldest background writes until at most ``keep_nbytes`` bytes are in flight (default:
        none); raise the first error (the writes still in flight are waited for by ``close``)."""
        while self._pending and self._inflight > keep_nbytes:
            self._pop()

    def _pop(self) -> None:
        """Wait for the oldest background write; raise its error."""
        fut, nbytes = self._pending.popleft()
        self._inflight -= nbytes
        fut.result()

    def _write_out(self, view: memoryview, nbytes: int, offset: int) -> None:
        """Write ``view[:nbytes]`` at file offset ``offset`` (both aligned, unless the file fell back)."""
        done = 0
        retried = False
        while done < nbytes:
            try:
                written = os.pwrite(self._fd, view[done:nbytes], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or retried:
                    raise
                # The kernel cut the write to an unaligned length (a file-size limit: RLIMIT_FSIZE) or
                # the device needs a larger alignment: go on without O_DIRECT, so that the write either
                # works or fails with its real cause (EFBIG, ENOSPC). Once per write: another write in
                # flight may have switched the descriptor already, after this one was issued.
                self._buffered()
                retried = True
                continue
            if written <= 0:
                raise OSError(errno.EIO, f"short write to {self.name}")
            done += written
            if done < nbytes and done % ALIGN:
                self._buffered()  # a short write left the offset unaligned (a nearly full disk)

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False
