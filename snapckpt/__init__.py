"""snapckpt: near-free checkpoints for large-model training.

At a step boundary each rank's state is copied into host shared memory (a *snapshot*); training goes on
at once, and one persister process per node writes the snapshot to storage in the framework's own
format and commits it crash-safely. A restarted job resumes from the freshest tier, memory or disk.

Public names are listed in ``__all__``; everything else may change. The integration seam (what
``snapckpt.integrations`` builds on) is public too: ``Checkpointer.save_files``, ``Checkpointer.load_with``
and its :class:`LoadCandidate`, ``Checkpointer.coordinator``, ``Checkpointer.storage``,
``Checkpointer.verify_directory``, ``Checkpointer.write_out`` and :func:`check_step`.
"""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from snapckpt import rng
    from snapckpt.engine.checkpointer import Checkpointer
    from snapckpt.engine.handle import SaveHandle
    from snapckpt.engine.hooks import HookRegistry, SnapshotPolicy
    from snapckpt.engine.loader import LoadCandidate, LoadInfo
    from snapckpt.engine.restore import check_step
    from snapckpt.errors import SnapckptError
    from snapckpt.events import Event, SaveStats, StorageType
    from snapckpt.options import CheckpointOptions

# Public names are imported on first use (PEP 562), so that `snapckpt ls`/`verify`/`ps` and the persister
# start without importing torch (seconds on a busy node).
_LAZY = {
    "Checkpointer": "snapckpt.engine.checkpointer", "SaveHandle": "snapckpt.engine.handle",
    "HookRegistry": "snapckpt.engine.hooks", "SnapshotPolicy": "snapckpt.engine.hooks",
    "LoadCandidate": "snapckpt.engine.loader", "LoadInfo": "snapckpt.engine.loader",
    "check_step": "snapckpt.engine.restore", "SnapckptError": "snapckpt.errors", "Event": "snapckpt.events",
    "SaveStats": "snapckpt.events", "StorageType": "snapckpt.events", "CheckpointOptions": "snapckpt.options",
}


def __getattr__(name: str):
    import importlib

    if name == "rng":
        return importlib.import_module("snapckpt.rng")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'snapckpt' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Checkpointer",
    "CheckpointOptions",
    "Event",
    "HookRegistry",
    "LoadCandidate",
    "LoadInfo",
    "SaveHandle",
    "SaveStats",
    "SnapckptError",
    "SnapshotPolicy",
    "StorageType",
    "check_step",
    "rng",
]

__version__ = "0.1.0"
