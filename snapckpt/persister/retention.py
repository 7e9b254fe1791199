"""Retention: delete old committed checkpoints after a commit, on the committer only.

Only directories with a valid snapckpt manifest are ever candidates (native checkpoints snapckpt did not
write are never touched); the ``keep_last`` most recently committed are kept (commit time, not step number: a
rewound run's new checkpoints are never rotated away in favour of abandoned higher steps), which always
includes the newest committed one; in-flight (partial) directories are hidden and never candidates; a directory already
deleted by someone else is not an error (case C3).
"""
from __future__ import annotations

import logging
from typing import Iterable, List, Optional

from ..manifest import list_committed
from ..storage.base import StorageReader, StorageWriter

__all__ = ["apply_retention"]

log = logging.getLogger(__name__)


def apply_retention(storage: StorageWriter, reader: StorageReader, checkpoint_dir: str,
                    keep_last: Optional[int], protect: Iterable[str] = ()) -> List[str]:
    """Delete committed checkpoints beyond the newest ``keep_last``; return the deleted directory names."""
    if keep_last is None:
        return []
    committed = list_committed(reader, checkpoint_dir, quick_check=False)
    # Newest means most recently committed (the manifest's commit time), not the highest step: after a
    # rewind (load an older step and train on), the new lower-numbered checkpoints are kept, the
    # abandoned higher-numbered ones rotate away.
    committed.sort(key=lambda c: c.manifest.get("created_unix", 0.0))
    keep = {c.dirname for c in committed[-keep_last:]} | set(protect)
    deleted = []
    for c in committed:
        if c.dirname in keep:
            continue
        storage.remove_tree(c.path)
        deleted.append(c.dirname)
        log.info("retention: deleted %s (step %d), keeping the newest %d", c.dirname, c.step, keep_last)
    return deleted
