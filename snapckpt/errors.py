"""The snapckpt error hierarchy.

Every error snapckpt raises on purpose derives from :class:`SnapckptError` (an ``Exception``, never a
``BaseException``). Errors that happen in the persister process are carried back as small JSON records
(never pickles) and re-raised on the training thread with their original type where that type is a
builtin ``OSError``/``ValueError``-like class or one of the classes below, chained and annotated with the
rank, step and persister pid (see :func:`snapckpt.persister.protocol.error_from_record`).
"""
from __future__ import annotations

__all__ = [
    "SnapckptError",
    "PreflightError",
    "InsufficientSharedMemoryError",
    "InsufficientDiskError",
    "CheckpointDirError",
    "CheckpointDirInUseError",
    "RemoteStorageError",
    "RemoteURLError",
    "SnapshotError",
    "SlotBusyError",
    "PersisterError",
    "PersisterDiedError",
    "PersisterTimeoutError",
    "ProtocolVersionError",
    "PersistError",
    "DiskFullError",
    "CommitError",
    "CommitTimeoutError",
    "PeerLostError",
    "SaveSkippedError",
    "CoordinationError",
    "RankTimeoutError",
    "CheckpointNotFoundError",
    "all_damaged_error",
    "CheckpointCorruptError",
    "IncompatibleCheckpointError",
    "UnsafeCheckpointError",
]


class SnapckptError(Exception):
    """Base class of every error snapckpt raises on purpose."""


class PreflightError(SnapckptError):
    """A resource check before the first snapshot or write failed; nothing was written."""


class InsufficientSharedMemoryError(PreflightError):
    """The shared-memory directory (or RAM) cannot hold the arena slots the state needs."""


class InsufficientDiskError(PreflightError):
    """The checkpoint directory's filesystem has less free space than the checkpoint needs."""


class CheckpointDirError(PreflightError):
    """The checkpoint directory cannot be created or written, or is not the one this checkpointer was made for."""


class RemoteStorageError(PreflightError):
    """The remote tier (``remote_dir``, an object store URL) cannot be used: no fsspec implementation of its
    scheme, a missing bucket, refused or missing credentials, an unreachable endpoint. The message names the
    URL, the cause and the fix, never a credential."""


class RemoteURLError(RemoteStorageError, CheckpointDirError, ValueError):
    """An object store URL cannot be used as given, whichever argument carried it: the checkpoint directory
    of remote-only mode (``Checkpointer("s3://bucket/run1")``), ``remote_dir=`` or ``$SNAPCKPT_REMOTE_DIR``, or
    the ``snapckpt`` command's URL argument. It is not a URL; it is a ``file://`` URL (pass the plain path);
    it carries credentials or query options; it names no bucket or no prefix; fsspec does not know its
    scheme or its package is not installed; or its filesystem cannot reach the URL's host when made
    (``ftp://``). The message names the URL, the cause and the fix, never a credential.

    One fault, one type, wherever the URL was passed: it is a :class:`RemoteStorageError` (what ``remote_dir``
    raised), a :class:`CheckpointDirError` (what a URL as the checkpoint directory raised) and a
    ``ValueError`` (what the ``remote_dir`` option's own check raised), so callers catching any of them
    still do."""


class CheckpointDirInUseError(PreflightError):
    """Another job (another process) is saving into the checkpoint directory; the message names it (pid,
    host, job id, since when). Nothing was saved and no checkpoint was touched."""


class SnapshotError(SnapckptError):
    """The state cannot be snapshotted (an unsupported tensor type, a dtype-aliased storage...)."""


class SlotBusyError(SnapckptError):
    """No arena slot became free in time: the persister still holds every slot of this rank."""


class CheckpointerClosedError(SnapckptError):
    """The Checkpointer is closed (``close()``, the end of its ``with`` block, or an integration's own close such
    as the DeepSpeed engine's ``destroy()``): it saves and loads nothing more. Create a new ``Checkpointer`` over
    the same directory to go on; it resumes from what the closed one committed."""


class PersisterError(SnapckptError):
    """The node persister process refused a request or is not usable."""


class PersisterDiedError(PersisterError):
    """The node persister process exited; in-flight snapshots it held are lost, committed ones are not."""


class PersisterTimeoutError(PersisterError):
    """The node persister did not answer within the configured timeout (it may be hung)."""


class ProtocolVersionError(PersisterError):
    """A training process and its node's persister run snapckpt versions that speak different protocols
    (snapckpt was upgraded while the job's persister lived on): refused at the connection's ``hello``."""


class PersistError(SnapckptError):
    """Writing a rank's part of a checkpoint failed in the persister (the original error is chained)."""


class DiskFullError(PersistError, OSError):
    """The checkpoint directory's filesystem ran full (``ENOSPC``) or the disk quota ran out (``EDQUOT``) while
    the persister wrote a checkpoint that passed the free-space preflight (something else filled the disk
    meanwhile). The message names the checkpoint directory, the bytes the rank's part needs and those free,
    and the fix. It is an ``OSError`` too: ``errno`` and ``filename`` are the failed write's. The previous
    checkpoint is intact; the step's partial directory is removed."""


class CommitError(SnapckptError):
    """The commit of a checkpoint was refused: a part is missing, unexpected or damaged."""


class CommitTimeoutError(CommitError):
    """Not every rank's part arrived before the commit timeout; the message names the missing ranks."""


class PeerLostError(CommitError):
    """A commit was abandoned because a part it waits for can never come: the rank's process died before
    handing it over, or the persister of the rank's node is gone (its lease went stale). The message names
    the step, the rank(s), their pid and host (see :mod:`snapckpt.persister.peers`)."""


class SaveSkippedError(CommitError):
    """A DISK save was skipped on every rank because one rank had no free arena slot (``on_slot_busy="skip"``);
    the message names that rank. Never raised to the caller: it travels, as the save's error, from the skipping
    rank through the persisters to the other ranks, whose handle of that save then ends skipped
    (:attr:`~snapckpt.engine.handle.SaveHandle.skipped`, a ``skipped`` event) instead of failed. Nothing of the
    save is committed; the previous checkpoint is untouched."""


class CoordinationError(SnapckptError):
    """The checkpoint coordination channel between ranks failed."""


class RankTimeoutError(CoordinationError):
    """Some ranks did not reach a collective snapckpt call in time; the message names them."""


class CheckpointNotFoundError(SnapckptError):
    """No complete checkpoint exists (or not the requested step) in memory or on disk."""


class CheckpointCorruptError(SnapckptError):
    """A committed checkpoint's files do not match its manifest (size or checksum)."""


def all_damaged_error(where: str, refused: "list[str]", *, what: str = "any step",
                      skipped: "list[str]" = (), note: str = "") -> CheckpointCorruptError:
    """The error for "checkpoints exist in ``where`` and every one was refused": one line per checkpoint
    tried (``refused``: why each failed) and per directory skipped as damaged (``skipped``), then the fix
    (``snapckpt verify``). Every loader (the core's and each integration's) raises this one, never "not
    found", which callers rightly read as "start afresh". ``note`` is added after ``where`` (e.g. "none was
    moved")."""
    lines = [f"  {e}" for e in refused] + [f"  {d} (skipped as damaged)" for d in skipped]
    return CheckpointCorruptError(
        f"no readable checkpoint of {what} in {where}{note}; each one was refused:\n" + "\n".join(lines)
        + f"\nRun `snapckpt verify {where}` to check every checkpoint there; restore or delete the damaged "
        "ones (or start afresh in an empty directory)")


class IncompatibleCheckpointError(SnapckptError):
    """A checkpoint cannot be loaded into this job (world size, shapes, format version)."""


class UnsafeCheckpointError(SnapckptError):
    """A checkpoint holds objects that ``weights_only=True`` refuses to unpickle."""
