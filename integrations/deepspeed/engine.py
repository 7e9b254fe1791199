"""The framework seam: :class:`SnapckptCheckpointEngine`, DeepSpeed's ``CheckpointEngine`` backed by snapckpt.

DeepSpeed's interface (``deepspeed/runtime/checkpoint_engine/checkpoint_engine.py``, DeepSpeed 0.19.8) and
the order in which ``engine.save_checkpoint`` / ``engine.step()`` / ``engine.load_checkpoint`` call it::

    create(info)                 a save of info.tag begins            -> a PendingSave
    makedirs(path)               DeepSpeed's mkdir of the tag dir     -> skipped: the commit renames it in
    save(state_dict, path) x N   one per file of this rank            -> recorded; the last one snapshots
    commit(info)                 (only for non-decoupled engines)     -> snapshot anything left
    get_commit_info()            engine.step(), before each optimizer step -> fence + poll
    load(path, map_location)     engine.load_checkpoint, per file     -> torch.load, or the memory snapshot
    cleanup()                    engine.destroy()                     -> close the DeepSpeedCheckpointer

The engine only routes: what a save expects and how it is snapshotted is :mod:`.save`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from snapckpt.errors import CheckpointNotFoundError, SnapshotError

from snapckpt.integrations.deepspeed.layout import check_tag
from snapckpt.integrations.deepspeed.save import DeepSpeedSaver, PendingSave

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("snapckpt.deepspeed needs DeepSpeed: pip install '.[deepspeed]' in your snapckpt clone") from e

__all__ = ["SnapckptCheckpointEngine"]


class SnapckptCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` that snapshots into snapckpt instead of calling ``torch.save``.

    Installed as ``engine.checkpoint_engine`` by :class:`~.checkpointer.DeepSpeedCheckpointer`; not used on
    its own. ``is_decoupled()`` is true, so DeepSpeed defers the commit (and ``latest``) to the engine; the
    commit runs in the node persister, and ``latest`` is written there after it.

    Args:
        saver: the save side of the owning checkpointer.
        close: called by :meth:`cleanup` (the owner's ``close``).
    """

    def __init__(self, saver: DeepSpeedSaver, close: Callable[[], None]) -> None:
        super().__init__()
        self.name = "snapckpt"
        self._saver = saver
        self._close = close
        self._pending: Optional[PendingSave] = None
        self._serving: Optional[Dict[str, Any]] = None  # memory-tier load: {basename: object}

    # -- save ------------------------------------------------------------------------------------
    def create(self, info) -> None:
        """Start collecting the files of ``info.tag`` (DeepSpeed's ``CheckpointCommitInfo``).

        A save into another directory than the checkpointer's (``engine.save_checkpoint(other_dir)``,
        ``engine.save_16bit_model``) is passed through to DeepSpeed's own checkpoint engine: written
        synchronously, as without snapckpt.

        Raises:
            ValueError: a tag DeepSpeed could not load back (see :func:`~.layout.check_tag`).
        """
        if self._pending is not None and self._pending.files and not self._pending.passthrough:
            self._saver.snapshot(self._pending)  # a save that never completed its expected files
        passthrough = not self._saver.is_own_dir(info.save_dir)
        if not passthrough:
            check_tag(str(info.tag))
        self._pending = self._saver.begin(info, passthrough=passthrough)

    def makedirs(self, path, exist_ok: bool = False) -> None:
        """Create ``path``, except the tag directory of the save in progress: a checkpoint directory
        appears only when its commit renames it into place."""
        p = self._pending
        if p is not None and not p.passthrough and os.path.abspath(path) == p.tag_dir:
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        """Record ``state_dict`` as the file ``path``; snapshot once every expected file is recorded.
        A file outside the tag directory of a save into the checkpointer's directory (DeepSpeed's
        ``save_16bit_model``) or of a save elsewhere is written at once by DeepSpeed's own engine.

        Raises:
            SnapshotError: DeepSpeed saved the same file twice in one checkpoint.
        """
        p = self._pending
        if p is None or p.passthrough or os.path.dirname(os.path.abspath(path)) != p.tag_dir:
            self._saver.pass_through(p, state_dict, path)
            return
        name = os.path.basename(path)
        if name in p.files:
            raise SnapshotError(f"DeepSpeed saved {name!r} twice in one checkpoint (each file is saved once per "
                                "tag: a custom checkpoint engine or model code that saves it again)")
        p.files[name] = self._saver.wrap(name, state_dict)
        if len(p.files) >= p.expected:
            self._pending = None
            self._saver.snapshot(p)

    def commit(self, info) -> bool:
        """Snapshot anything still collected (DeepSpeed calls this only for non-decoupled engines)."""
        self.flush()
        return True

    def flush(self) -> None:
        """Snapshot a save whose files are recorded but not yet snapshotted (there is normally none)."""
        p, self._pending = self._pending, None
        if p is not None and p.files and not p.passthrough:
            self._saver.snapshot(p)

    def is_decoupled(self) -> bool:
        return True

    def get_commit_info(self):
        """Called by ``engine.step()`` before each optimizer step: the fence (the snapshot copy is complete
        before the weights change) and a poll of outstanding saves. Returns ``None``: snapckpt commits and
        writes ``latest`` itself, DeepSpeed does neither."""
        self.flush()
        self._saver.checkpointer.fence()
        self._saver.checkpointer.poll()
        return None

    def cleanup(self) -> None:
        """``engine.destroy()``: close the checkpointer (the last policy save, every commit waited for, the
        engine's own checkpoint engine given back)."""
        self._close()

    def preserves_storage_sharing(self) -> bool:
        # False tells DeepSpeed not to clone tensors before save(): snapckpt writes only the bytes each view
        # uses (case D3), so the clone (a full extra copy on the training critical path) is not needed.
        return False

    # -- load ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def serving(self, files: Dict[str, Any]) -> Iterator[None]:
        """Within the block, :meth:`load` returns the objects of ``files`` (``{basename: object}``, a memory
        snapshot) instead of reading files."""
        self._serving = files
        try:
            yield
        finally:
            self._serving = None

    def load(self, path: str, map_location=None):
        """Return the object of file ``path``: from the memory snapshot during a memory-tier load, else
        ``torch.load(path, weights_only=<option>)`` (DeepSpeed's own loader trusts its files fully).

        Raises:
            CheckpointNotFoundError: a memory-tier load asks for a file this rank's snapshot lacks.
        """
        if self._serving is not None:
            name = os.path.basename(path)
            if name not in self._serving:
                raise CheckpointNotFoundError(
                    f"the memory snapshot of this rank has no {name!r} (an elastic ZeRO load reads every rank's "
                    "file); falling back to disk")
            return self._serving[name]
        return torch.load(path, map_location=map_location,
                          weights_only=self._saver.checkpointer.options.weights_only)
