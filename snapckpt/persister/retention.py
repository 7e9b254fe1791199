"""Retention: delete old committed checkpoints after a commit, on the committer only.

Only directories with a valid snapckpt manifest are ever candidates (native checkpoints snapckpt did not
write are never touched); the ``keep_last`` most recently saved are kept (save order, not commit time nor step number: a
rewound run's new checkpoints are never rotated away in favour of abandoned higher steps), which always
includes the newest committed one; in-flight (partial) directories are hidden and never candidates; a directory already
deleted by someone else is not an error (case C3). The checkpoint a tracker file still names (DeepSpeed's ``latest``
after later ``save_latest=False`` saves) is never retired either: it is what the framework's own resume loads, and
without retention (the framework's own save) it would still be there.

Deleting a multi-GiB checkpoint takes a while (about 0.2 s per GiB on ext4 here). So that it does not
delay the commit's answer, :func:`apply_retention` can first rename each old checkpoint to a hidden
``.<dirname>.deleted-<run_id>`` directory (atomic, instant; loaders and listings skip hidden names) and
leave the deletion to the caller, after it has reported the commit. A deletion interrupted by a crash
leaves that hidden directory, which the next run's committer removes with the stale partial directories.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, List, Optional

from snapckpt._internal import faultpoints as faults
from snapckpt.ondisk.manifest import list_committed, save_order, tracker_named
from snapckpt.storage.base import StorageReader, StorageWriter

__all__ = ["apply_retention", "trash_dirname"]

log = logging.getLogger(__name__)


def trash_dirname(dirname: str, run_id: str) -> str:
    """Hidden name a retired checkpoint ``dirname`` is renamed to before it is deleted."""
    return f".{dirname}.deleted-{run_id}"


def apply_retention(storage: StorageWriter, reader: StorageReader, checkpoint_dir: str,
                    keep_last: Optional[int], protect: Iterable[str] = (), *,
                    defer_to: Optional[List[str]] = None, run_id: str = "", step: int = -1,
                    spared: Optional[List[str]] = None) -> List[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``, except one a tracker file in
    ``checkpoint_dir`` names (:func:`~snapckpt.ondisk.manifest.tracker_named`); return the retired directory names.

    Args:
        protect: directory names never retired here (commits in flight).
        defer_to: when a list is given, each retired checkpoint is renamed to
            :func:`trash_dirname` ``(dirname, run_id)`` and that absolute path is appended to the list for
            the caller to ``remove_tree``; otherwise it is deleted here.
        run_id: the committing run's id (names the hidden directories when ``defer_to`` is given).
        step: the committed step whose commit runs this retention (fault point ``commit.retention_listed``).
        spared: when a list is given, the names in ``protect`` that are committed and would otherwise have
            been retired are appended to it.
    """
    if keep_last is None:
        return []
    committed = list_committed(reader, checkpoint_dir, quick_check=False)
    faults.point("commit.retention_listed", step=step, rank=None)
    # Newest means most recently requested (the save order), not the highest step: after a rewind (load
    # an older step and train on), the new lower-numbered checkpoints are kept, the abandoned
    # higher-numbered ones rotate away. Not the commit time either: commits of one job run in parallel
    # and may finish out of order, and the newest save (the one the tracker names) must never rotate
    # away because an older save committed after it. Manifests without requested_unix: commit time.
    committed.sort(key=lambda c: save_order(c.manifest))
    newest = {c.dirname for c in committed[-keep_last:]}
    if len(committed) > keep_last:
        newest |= tracker_named(((c.dirname, c.manifest) for c in committed[:-keep_last]),
                                lambda name: _read_text(reader, os.path.join(checkpoint_dir, name)))
    protect = set(protect)
    deleted = []
    for c in committed:
        if c.dirname in newest:
            continue
        if c.dirname in protect:
            if spared is not None:
                spared.append(c.dirname)
            continue
        if defer_to is None:
            storage.remove_tree(c.path)
        else:
            trash = os.path.join(checkpoint_dir, trash_dirname(c.dirname, run_id))
            storage.remove_tree(trash)  # left by an earlier retirement of the same name in this run
            try:
                storage.rename(c.path, trash)
            except FileNotFoundError:  # deleted by someone else meanwhile (C3)
                continue
            defer_to.append(trash)
        deleted.append(c.dirname)
        log.info("retention: deleted %s (step %d), keeping the newest %d", c.dirname, c.step, keep_last)
    return deleted


def _read_text(reader: StorageReader, path: str) -> Optional[str]:
    try:
        return reader.read_bytes(path).decode("utf-8", errors="replace")
    except OSError:  # missing, or a directory: it names nothing
        return None
