"""A streamed part: the persister writes a rank's slot while the rank is still copying into it.

Sequence (issue 18: the write overlaps the copy instead of following it):

1. the rank writes the slot's pickles and index, then sends ``stream`` (:mod:`snapckpt.persister.protocol`)
   and copies its spans in ascending slot offset, storing the slot's watermark after each batch
   (:meth:`snapckpt.engine.stager.Stager.copy_into`, :mod:`snapckpt.persister.arena`);
2. the server makes a :class:`Stream` for the slot (still WRITING) and the scheduler starts the part's writer
   and the step's commit (:meth:`snapckpt.persister.scheduler.Scheduler.stream`); the writer reads a span
   byte only once the watermark has passed it (:meth:`Stream.wait`);
3. ``ready`` (the copy is complete, the header written): :meth:`Stream.set_ready`; the writer, its files
   written, waits for it (:meth:`Stream.wait_ready`) before the fsyncs and the part marker, so no marker
   ever names a part whose rank did not hand it over;
4. ``abort``, or the rank's death before ``ready``: :meth:`Stream.cancel`; the writer's next wait raises,
   the part fails (its failure ends the commit at once, which removes the partial directory), and the slot
   is not handed out again until the writer has stopped reading it (``Slot.stream``, :mod:`~snapckpt.persister.slots`).
"""
from __future__ import annotations

import threading
from typing import Optional

from snapckpt.errors import PersisterError
from snapckpt.persister.arena import watermark_view

__all__ = ["Stream"]

#: First and longest sleep of a writer waiting for the watermark (seconds): the rank stores it every
#: 32 MiB (a few ms of copying), so the writer trails the copy by about one batch.
POLL_FIRST_SECS = 0.0005
POLL_MAX_SECS = 0.004


class Stream:
    """One streamed part (see the module docstring).

    Args:
        rank, step: whose part, of which step.
        data_end: first slot byte after the spans (bytes from the slot start); the pickles and the index,
            after it, were final before ``stream`` was sent.

    Attributes:
        seq: the slot's READY sequence number once ``ready`` came (``None`` before).
        error: why the copy will never complete (``None`` while it may).
    """

    def __init__(self, rank: int, step: int, data_end: int) -> None:
        self.rank, self.step, self.data_end = rank, step, data_end
        self.seq: Optional[int] = None
        self.error: Optional[str] = None
        self._cond = threading.Condition()
        self._seen = 0  # the highest watermark read so far
        self._mark: Optional[memoryview] = None

    # ------------------------------------------------------------------------- server side (with its lock)
    def set_ready(self, seq: int) -> None:
        """The rank handed the slot over (``ready``): every byte is final."""
        with self._cond:
            self.seq = seq
            self._cond.notify_all()

    def cancel(self, why: str) -> None:
        """The copy will never complete (``abort``, the rank died); nothing once ``ready`` came."""
        with self._cond:
            if self.seq is None and self.error is None:
                self.error = why
                self._cond.notify_all()

    # ------------------------------------------------------------------------------------- writer side
    def attach(self, buf) -> None:
        """Read the watermark of slot mapping ``buf`` from now on (:meth:`detach` before the mapping closes)."""
        self._mark = watermark_view(buf)

    def detach(self) -> None:
        """Stop reading the slot's watermark (idempotent)."""
        if self._mark is not None:
            self._mark.release()
            self._mark = None

    def wait(self, offset: int, nbytes: int) -> None:
        """Return once slot bytes ``[offset, offset + nbytes)`` are final (bytes at or past ``data_end`` are).

        Raises:
            PersisterError: the copy will never complete (:meth:`cancel`).
        """
        if offset >= self.data_end:
            return
        need = min(offset + nbytes, self.data_end)
        if need <= self._seen:
            return
        delay = POLL_FIRST_SECS
        while True:
            mark = self._mark[0] if self._mark is not None else 0
            if mark >= need:
                self._seen = mark
                return
            with self._cond:
                if self.error is not None:
                    raise PersisterError(self.error)
                if self.seq is not None:
                    self._seen = self.data_end
                    return
                self._cond.wait(delay)
            delay = min(delay * 2, POLL_MAX_SECS)

    def wait_ready(self) -> int:
        """Wait for ``ready``; return the slot's READY sequence number.

        Raises:
            PersisterError: the copy will never complete (:meth:`cancel`).
        """
        with self._cond:
            self._cond.wait_for(lambda: self.seq is not None or self.error is not None)
            if self.seq is None:
                raise PersisterError(self.error)
            return self.seq
