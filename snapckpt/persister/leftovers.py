"""Leftovers of dead saves of other jobs: which hidden in-flight directories of a checkpoint directory no live
writer can own.

A save in flight lives in ``.<dirname>.partial-<run id>`` (and, while a commit replaces or retention deletes a
step, ``.replaced-``/``.deleted-``; a multi-node run's records in ``.peers-``). The committer of the same job
removes its earlier runs' leftovers at start (:func:`snapckpt.persister.commit.recover_interrupted_commits`);
one of another job (another ``job_id``, the directory moved, or copied) is removed only when its writer is
provably dead (:func:`writer_is_dead`): no persister of its job runs on this host (its ``persister.pid`` is
not locked: the kernel drops the lock of a killed process), and nothing in it changed for ``quiet_secs``
(a writer on another host sharing the filesystem would have touched it, or its commit would have timed out).
``snapckpt ls`` uses the same test to keep such leftovers out of its table of checkpoints.
"""
from __future__ import annotations

import fcntl
import os
import time
from typing import Optional

from snapckpt.persister.client import JOB_KEY_LEN, job_of_run

__all__ = ["LEFTOVER_KINDS", "leftover_run", "writer_is_dead"]

LEFTOVER_KINDS = (".partial-", ".replaced-", ".deleted-", ".peers-")


def leftover_run(name: str) -> Optional[str]:
    """The run id of a hidden in-flight directory name (``.X.partial-<run id>``...), else ``None``."""
    if not name.startswith(".") or not any(k in name for k in LEFTOVER_KINDS):
        return None
    rid = name.rsplit("-", 1)[-1]
    return rid if len(rid) > JOB_KEY_LEN else None


def _persister_alive(runtime_root: str, job: str) -> bool:
    """Whether the persister of ``job`` (a job key) runs on this host for this user: its pid file is locked."""
    path = os.path.join(runtime_root, f"snapckpt-{os.getuid()}", job, "persister.pid")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: alive
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)


def _newest_mtime(path: str) -> float:
    newest = os.lstat(path).st_mtime
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, n)).st_mtime)
            except FileNotFoundError:
                pass
    return newest


def writer_is_dead(path: str, run_id: str, runtime_root: str, quiet_secs: float) -> bool:
    """Whether the save that left ``path`` (of run ``run_id``) is over for good: no persister of its job
    runs on this host for this user (``runtime_root``: the parent of the ``snapckpt-<uid>`` runtime
    directories) and nothing under ``path`` changed for ``quiet_secs`` seconds. ``False`` when unsure
    (``path`` unreadable)."""
    if _persister_alive(runtime_root, job_of_run(run_id)):
        return False
    try:
        return time.time() - _newest_mtime(path) > quiet_secs
    except OSError:
        return False
