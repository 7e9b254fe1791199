"""Preflight of a Checkpointer's directories, before the first byte of a snapshot moves (contract 7).

The Checkpointer's constructor runs :func:`preflight_dir` on every rank (the checkpoint directory exists
or can be created, and is writable; the shared-memory directory exists and is a tmpfs), then rank 0 reads
the directory's identity (:func:`dir_identity`), which every memory snapshot is tagged with so that a
deleted and re-created directory never loads another run's snapshots.
"""
from __future__ import annotations

import errno
import logging
import os
import uuid
from typing import Optional

from snapckpt.errors import CheckpointDirError, PreflightError

__all__ = ["DIR_ID_XATTR", "dir_identity", "fs_type", "preflight_dir"]

DIR_ID_XATTR = "user.snapckpt.dir_id"  # random id of a checkpoint directory, an extended attribute of it

log = logging.getLogger(__name__)


def preflight_dir(checkpoint_dir: str, shm_dir: str, run_id: str, rank: int) -> None:
    """Check the directories of one rank; create ``checkpoint_dir`` if missing.

    Args:
        checkpoint_dir: absolute path of the checkpoint directory.
        shm_dir: the shared-memory directory of the arena (a warning when it is not a tmpfs).
        run_id: this launch attempt's run id (names the probe file).
        rank: global rank (names the probe file and the errors).

    Raises:
        CheckpointDirError: ``checkpoint_dir`` is not a directory, is full, or is not writable.
        PreflightError: ``shm_dir`` does not exist.
    """
    d = checkpoint_dir
    probe = os.path.join(d, f".snapckpt-probe-{run_id}-{rank}")
    if os.path.exists(d) and not os.path.isdir(d):
        raise CheckpointDirError(f"checkpoint directory {d!r} exists and is not a directory; pick "
                                 "another path")
    shm = shm_dir
    if not os.path.isdir(shm):
        raise PreflightError(f"shared-memory directory {shm!r} does not exist; point shm_dir= (or "
                             "SNAPCKPT_SHM_DIR) at an existing tmpfs such as /dev/shm")
    if fs_type(shm) not in ("tmpfs", "ramfs", "hugetlbfs", None):
        log.warning("shm_dir %r is on a %s filesystem, not a tmpfs: memory snapshots will be written to "
                    "that disk and will be slow", shm, fs_type(shm))
    try:
        os.makedirs(d, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        try:
            os.unlink(probe)
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise CheckpointDirError(f"checkpoint directory {d!r} is full (rank {rank}: {e.strerror}); "
                                     "free space (older checkpoints, leftover .*.partial-* directories) "
                                     "or pick another directory") from e
        raise CheckpointDirError(f"checkpoint directory {d!r} is not writable by rank {rank}: "
                                 f"{e.strerror or e}; fix its permissions or pick another directory") from e


def dir_identity(checkpoint_dir: str) -> str:
    """Rank 0: a random id kept in the extended attribute ``user.snapckpt.dir_id`` of the checkpoint
    directory (created on first use; it goes with the directory, and listings do not show it). ``""``
    where the filesystem has no user xattrs: then memory snapshots are not tied to the directory."""
    d = checkpoint_dir
    try:
        return os.getxattr(d, DIR_ID_XATTR).decode("ascii")
    except OSError as e:
        if e.errno not in (errno.ENODATA, getattr(errno, "ENOATTR", errno.ENODATA)):
            return ""
    value = uuid.uuid4().hex
    try:
        os.setxattr(d, DIR_ID_XATTR, value.encode("ascii"), os.XATTR_CREATE)
        return value
    except FileExistsError:
        return os.getxattr(d, DIR_ID_XATTR).decode("ascii")
    except OSError:
        return ""


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
