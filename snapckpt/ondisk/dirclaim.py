"""One writer job per checkpoint directory: a claim taken at a job's first save (case P2 of a user trial).

Two jobs saving into one directory (two job ids on one host, or two hosts on a shared filesystem) would
rotate each other's checkpoints, since retention counts every checkpoint of the directory, and a restart
could load the other job's state. So global rank 0 of a job claims the directory at its first save: an
exclusive, non-blocking ``flock`` on the checkpoint directory itself, so that the claim adds no entry to
a directory the user (or the Trainer's ``output_dir``) owns. A small JSON record of the holder goes into
the directory's extended attribute ``user.snapckpt.writer`` (read back for the error message)::

    {"pid": 1234, "host": "node7/<boot id>", "job_id": "a", "run_id": "...", "since_unix": 1.7e9,
     "since": "2026-11-30T13:40:00Z"}

Where a directory cannot be locked (NFS emulates ``flock`` with byte-range locks, which need a descriptor
open for writing: ``EBADF``), the claim falls back to a lock file, ``<checkpoint_dir>/.snapckpt-writer.lock``
(mode ``0600``, created if missing, never deleted), whose content is the record. The kernel drops the lock
when the holder's process exits, ``kill -9`` included, so a restart just works; :meth:`DirClaim.release`
(``Checkpointer.close``) drops it earlier. Loading takes no claim: an evaluation job may read a directory
while training writes it. Several Checkpointers of one process on one directory share one claim (counted
per ``realpath``). A forked child closes its inherited descriptor, so a DataLoader worker never keeps a
dead trainer's claim alive. Where the filesystem has no ``flock`` at all (``ENOLCK``, ``EOPNOTSUPP``,
``ENOSYS``) no claim is taken, with a one-line warning.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

from snapckpt.errors import CheckpointDirError, CheckpointDirInUseError

__all__ = ["LOCK_NAME", "RECORD_XATTR", "DirClaim", "claim_dir", "read_holder"]

LOCK_NAME = ".snapckpt-writer.lock"  # only where the directory itself cannot be locked (NFS)
RECORD_XATTR = "user.snapckpt.writer"
_DIR_LOCK_REFUSED = {errno.EBADF, errno.EINVAL}  # flock on a directory descriptor refused: use a lock file
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.ENOSYS}
_DEAD_HOLDER_GRACE_SECS = 5.0  # a holder that is exiting (zombie) on this host: wait for the kernel to unlock
_ANY_HOLDER_GRACE_SECS = 1.0  # any other holder: a job killed just before this one started may still be exiting

log = logging.getLogger(__name__)
_lock = threading.Lock()
_held: Dict[str, List[int]] = {}  # realpath -> [fd, number of DirClaim objects of this process]
_fork_hook = False


class DirClaim:
    """This process's share of the claim on one checkpoint directory; :meth:`release` once."""

    def __init__(self, real: str, entry: List[int]) -> None:
        self.path, self._entry, self._released = real, entry, False

    def release(self) -> None:
        """Drop this share; the last share of the process closes the descriptor (unlocks). Idempotent."""
        with _lock:
            if self._released:
                return
            self._released = True
            self._entry[1] -= 1
            if self._entry[1] == 0:
                if _held.get(self.path) is self._entry:
                    del _held[self.path]
                if self._entry[0] >= 0:
                    os.close(self._entry[0])
                    self._entry[0] = -1


def claim_dir(checkpoint_dir: str, holder: Mapping[str, Any]) -> Optional[DirClaim]:
    """Claim ``checkpoint_dir`` (an existing directory) for this process's job.

    Args:
        checkpoint_dir: the directory.
        holder: ``job_id`` and ``run_id`` of the job, recorded with pid, host and time.

    Returns:
        a :class:`DirClaim`, or ``None`` where the filesystem does not support ``flock`` (a one-line warning).

    Raises:
        CheckpointDirInUseError: another process holds the claim; the message names it (pid, host, job id,
            since when) and the fix.
        CheckpointDirError: the directory or the lock file cannot be opened, or the lock file is a
            symbolic link.
    """
    real = os.path.realpath(checkpoint_dir)
    with _lock:
        entry = _held.get(real)
        if entry is not None and any(_same_file(entry[0], p) for p in (real, os.path.join(real, LOCK_NAME))):
            entry[1] += 1
            return DirClaim(real, entry)
        # not held, or held on a directory (lock file) that was deleted and re-created since
        fd = _open_dir(real)
        try:
            locked = _flock(fd, real, fallback=True)
        except BaseException:
            os.close(fd)
            raise
        if locked is None:  # the directory cannot be locked here (NFS): a lock file in it
            os.close(fd)
            fd = _open(os.path.join(real, LOCK_NAME))
            try:
                locked = _flock(fd, real, fallback=False)
            except BaseException:
                os.close(fd)
                raise
        if not locked:
            os.close(fd)
            return None
        _record(fd, holder)
        entry = _held[real] = [fd, 1]
        _install_fork_hook()
        return DirClaim(real, entry)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_dir(real: str) -> int:
    try:
        return os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointDirError(f"cannot open the checkpoint directory {real}: {e.strerror}; fix its "
                                 "permissions or pick another checkpoint directory") from e


def _open(path: str) -> int:
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | flags, 0o600)
    except PermissionError:  # another user's lock file in a shared directory: lock it read-only
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointDirError(f"cannot open the writer lock {path}: {e.strerror}; fix its permissions "
                                     "or pick another checkpoint directory") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointDirError(f"the writer lock {path} is a symbolic link; remove it (snapckpt never "
                                     "follows links in a checkpoint directory)") from e
        raise CheckpointDirError(f"cannot create the writer lock {path}: {e.strerror}; fix the directory's "
                                 "permissions or pick another checkpoint directory") from e


def _flock(fd: int, real: str, fallback: bool) -> Optional[bool]:
    """Lock ``fd``: True when locked; False where flock is unsupported; None (``fallback`` only) where a
    directory descriptor cannot be locked; CheckpointDirInUseError when another process holds it."""
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            info = read_holder(real)
            # A holder killed a moment ago may still be exiting (its files not yet closed): wait a little,
            # longer when it is known to be on its way out (gone or a zombie on this host).
            grace = _DEAD_HOLDER_GRACE_SECS if _exiting_here(info) else _ANY_HOLDER_GRACE_SECS
            if time.monotonic() - start < grace:
                time.sleep(0.05)
                continue
            raise CheckpointDirInUseError(_in_use_message(real, info)) from None
        except OSError as e:
            if fallback and e.errno in _DIR_LOCK_REFUSED:
                return None
            if e.errno in _NO_FLOCK:
                log.warning("checkpoint directory %s: its filesystem does not support flock (%s); no writer "
                            "claim is taken: make sure no other job saves into it", real, os.strerror(e.errno))
                return False
            raise


def _record(fd: int, holder: Mapping[str, Any]) -> None:
    now = time.time()
    from snapckpt.dist.topology import host_identity

    rec = {"pid": os.getpid(), "host": host_identity(), "job_id": holder.get("job_id"),
           "run_id": holder.get("run_id"), "since_unix": now,
           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
    data = (json.dumps(rec) + "\n").encode()
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.setxattr(fd, RECORD_XATTR, data)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
    except OSError:  # no user xattrs here, or a read-only lock file: the claim holds, the record is older
        pass


def read_holder(checkpoint_dir: str) -> Dict[str, Any]:
    """The holder record of ``checkpoint_dir``'s claim (``{}`` when missing, empty or damaged): the
    directory's ``user.snapckpt.writer`` attribute, or the lock file where the claim fell back to one
    (the newer of the two where both exist)."""
    found = []
    for read in (lambda: os.getxattr(checkpoint_dir, RECORD_XATTR),
                 lambda: open(os.path.join(checkpoint_dir, LOCK_NAME), "rb").read(4096)):
        try:
            rec = json.loads(read() or b"{}")
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec:
            found.append(rec)
    since = lambda r: r.get("since_unix") if isinstance(r.get("since_unix"), (int, float)) else 0  # noqa: E731
    return max(found, key=since, default={})


def _exiting_here(info: Mapping[str, Any]) -> bool:
    """True when the holder runs on this host and its process is gone or a zombie."""
    from snapckpt.dist.topology import host_identity

    pid = info.get("pid")
    if not isinstance(pid, int) or info.get("host") != host_identity():
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _in_use_message(real: str, info: Mapping[str, Any]) -> str:
    if info.get("pid") is not None:
        who = (f"pid {info.get('pid')} on host {str(info.get('host', '?')).split('/')[0]} (job_id "
               f"{info.get('job_id')!r}, run {info.get('run_id')}), saving since {info.get('since', '?')}")
    else:
        who = "a process that is just starting (its record is not written yet)"
    return (f"checkpoint directory {real} is in use by another job: {who}. Two jobs saving into one directory "
            "would rotate each other's checkpoints and could load each other's state, so this save was "
            "refused and nothing in the directory was touched. Give each job its own checkpoint directory, or "
            "stop the other job first (its claim, an flock on the directory, is released when it exits or calls "
            "close())")


def _install_fork_hook() -> None:
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(after_in_child=_close_in_child)
        _fork_hook = True


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep the claim alive after its parent dies. Closing the
    child's copy leaves the parent's lock in place (the lock belongs to the open file description)."""
    global _lock
    _lock = threading.Lock()  # the parent's lock may have been held by another thread at fork time
    for entry in _held.values():
        try:
            os.close(entry[0])
        except OSError:
            pass
        entry[0] = -1
    _held.clear()
