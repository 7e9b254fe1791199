"""SaveHandle: the result of one ``Checkpointer.save`` (torchsnapshot's ``PendingSnapshot`` idea).

``snapshot_taken`` is true when ``save`` returns (unless the snapshot was skipped); ``done()`` asks, without
waiting, whether the save reached its end (committed for DISK; held in memory for MEMORY; failed; or, for
DISK, skipped because another rank had no free slot: ``skipped`` then turns true);
``wait()`` blocks, bounded, until then and re-raises a background failure on the caller's thread with
its original type, annotated with rank, step and persister pid.

A handle knows its owner (the save pipeline, :class:`~snapckpt.engine.saver.Saver`) only through the
small :class:`SaveOwner` protocol below; the owner drives the handle only through its public methods
(:meth:`SaveHandle.mark_copied`, :meth:`SaveHandle.fail`, :meth:`SaveHandle.mark_reported`).
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Protocol

from snapckpt.errors import CommitTimeoutError, SaveSkippedError
from snapckpt.events import SaveStats, StorageType
from snapckpt.persister import protocol as P

__all__ = ["SaveHandle", "SaveOwner"]


class SaveOwner(Protocol):
    """What a :class:`SaveHandle` needs from the one that made it.

    Sequence: ``wait()`` on a handle whose copy is still running (``overlap=True``) calls :meth:`fence`;
    then ``done()`` asks :meth:`status` once, and ``wait()`` asks it with ``wait_secs`` (the persister answers
    when the save ends, not at once) until the persister says ``committed`` (the handle calls
    :meth:`on_committed`), ``failed`` (it builds the error with :meth:`context` and calls :meth:`on_failed`)
    or ``unknown`` (the error is :meth:`lost_error`).
    """

    commit_timeout_secs: float
    """Default bound of ``SaveHandle.wait``, before its margin (seconds)."""

    def status(self, step: int, dirname: str, wait_secs: float = 0.0, seq: int = -1) -> Dict[str, Any]:
        """The persister's state of the save of ``step`` as ``dirname`` (``{"state": ..., "error": ...}``);
        with ``wait_secs`` > 0 answered once the save is no longer pending, or after about ``wait_secs`` s.
        ``seq``: the snapshot the save handed over, which tells it from another save of the same step and
        directory (-1: unknown)."""
        ...

    def on_committed(self, handle: "SaveHandle") -> None:
        """``handle``'s step was committed (log and event)."""
        ...

    def on_failed(self, handle: "SaveHandle", exc: BaseException) -> None:
        """``handle``'s save failed with ``exc`` (log and event)."""
        ...

    def on_skipped(self, handle: "SaveHandle") -> None:
        """``handle``'s save was skipped because another rank had no free slot (log and event)."""
        ...

    def context(self, step: int) -> str:
        """Rank, step and persister pid, for error messages."""
        ...

    def lost_error(self, step: int) -> Exception:
        """The error of a save the persister no longer knows (it was restarted)."""
        ...

    def fence(self) -> None:
        """Wait for the in-flight snapshot copy and hand it to the persister."""
        ...


class SaveHandle:
    """Observe one save. Created by :meth:`snapckpt.Checkpointer.save`; not built by users."""

    _AWAIT_SECS = 1.0  # the longest one status request of wait() is held by the persister (seconds)

    def __init__(self, owner: SaveOwner, step: int, tier: StorageType, stats: Optional[SaveStats],
                 skipped_reason: Optional[str] = None, dirname: str = "", copying: bool = False,
                 started: Optional[float] = None, seq: int = -1) -> None:
        self._owner = owner
        self._copying = copying  # overlap: the copy into the arena runs until the next fence()
        self.step = step
        self.dirname = dirname  # the checkpoint directory (tag) this save commits as
        self._seq = seq  # the snapshot it handed over (the persister's ready answer; -1: not yet, or MEMORY)
        self.storage_type = tier
        self.stats = stats
        self.skipped_reason = skipped_reason
        self._taken = skipped_reason is None  # this rank's snapshot was taken (kept when another rank skips)
        self._state = "pending" if ((tier == StorageType.DISK or copying) and skipped_reason is None) else "done"
        self._error: Optional[BaseException] = None
        self._reported = False
        self._created = time.monotonic()
        self._started = self._created if started is None else started  # time.monotonic() of the save call
        self.committed_secs: Optional[float] = None  # seconds from snapshot to commit
        self.durable_secs: Optional[float] = None  # seconds from the save call to the commit being known

    @property
    def snapshot_taken(self) -> bool:
        """True when the state has been copied into the arena: when ``save`` returns (unless skipped), or
        with ``overlap=True`` after the next ``fence()``."""
        return self._taken and not self._copying and self._error is None

    @property
    def committed(self) -> bool:
        """True when this DISK save is known to be committed (by an earlier :meth:`done` or :meth:`wait`);
        asks the persister nothing. False for MEMORY saves, skipped ones, failed ones and those not yet known."""
        return self.storage_type == StorageType.DISK and self.skipped_reason is None and self._state == "done"

    @property
    def skipped(self) -> bool:
        """True when this save was skipped: this rank had no free slot (``on_slot_busy="skip"``; then no snapshot was
        taken), or, for a DISK save, another rank had none (known once :meth:`done` or :meth:`wait` says it
        ended: every rank's save of the step and directory is skipped, none committed; ``skipped_reason`` names
        that rank)."""
        return self.skipped_reason is not None

    @property
    def reported(self) -> bool:
        """True once the failure (if any) was raised to the caller: by :meth:`wait`, or by the Checkpointer's
        ``poll``/``fence``, which raise each failure once (:meth:`mark_reported`)."""
        return self._reported

    def mark_reported(self) -> None:
        """The owner raised this save's failure to the caller: later calls do not raise it again."""
        self._reported = True

    def mark_copied(self, stats: SaveStats, held_in_memory: bool, seq: int = -1) -> None:
        """The owner finished the overlapped copy of this save and handed the slot to the persister.

        Args:
            stats: the save's statistics (now known).
            held_in_memory: a MEMORY save, which ends here (a DISK save goes on until committed).
            seq: the snapshot handed over (the persister's ``ready`` answer; -1: unknown).
        """
        self.stats = stats
        self._seq = seq
        self._copying = False
        if held_in_memory:
            self._state = "done"  # held in memory from now on

    def fail(self, exc: BaseException) -> None:
        """End this save with ``exc`` (its copy, if one was running, is over); the owner is told."""
        self._copying = False
        self._state = "failed"
        self._error = exc
        self._owner.on_failed(self, exc)

    def _poll(self, wait_secs: float = 0.0) -> None:
        if self._state != "pending" or self._copying:
            return
        reply = self._owner.status(self.step, self.dirname, wait_secs, self._seq)
        state = reply.get("state")
        if state == "committed":
            self._state = "done"
            now = time.monotonic()
            self.committed_secs = now - self._created
            self.durable_secs = now - self._started
            self._owner.on_committed(self)
        elif state == "failed" and (reply.get("error") or {}).get("type") == SaveSkippedError.__name__:
            self.skipped_reason = str(reply["error"].get("message") or "skipped by another rank")
            self._state = "done"
            self._owner.on_skipped(self)
        elif state == "failed":
            rec = reply.get("error") or {"type": "PersistError", "message": "unknown failure"}
            self.fail(P.error_from_record(rec, context=self._owner.context(self.step)))
        elif state == "unknown":
            self.fail(self._owner.lost_error(self.step))

    def done(self) -> bool:
        """Whether the save has finished (committed, held in memory, skipped or failed). Never blocks
        for long: one status request to the persister at most."""
        return self._done(0.0)

    def _done(self, wait_secs: float) -> bool:
        try:
            self._poll(wait_secs)
        except Exception as e:  # a dead persister ends the save too
            self.fail(e)
        return self._state != "pending"

    def exception(self) -> Optional[BaseException]:
        """The failure, once known; ``None`` otherwise."""
        return self._error

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the save has finished; re-raise its failure.

        Args:
            timeout: seconds; default: the Checkpointer's ``commit_timeout_secs`` plus a margin.

        Raises:
            CommitTimeoutError: not finished within the timeout (the save goes on in the background).
            The save's own failure, with its original type.
        """
        if self._copying:
            self._owner.fence()
        limit = timeout if timeout is not None else self._owner.commit_timeout_secs + 30.0
        deadline = time.monotonic() + limit
        # each status request is held by the persister until the save ends or _AWAIT_SECS pass: about one request
        # per second of waiting, instead of every rank of the node polling every few milliseconds
        while not self._done(min(self._AWAIT_SECS, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise CommitTimeoutError(f"step {self.step} was not committed within {limit:g} s; "
                                         f"{self._owner.context(self.step)}")
        self._reported = True
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, tier={self.storage_type.value}, state={self._state})"
