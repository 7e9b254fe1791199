"""One ``engine.save_checkpoint`` captured as snapckpt file specs, for a framework that keeps DeepSpeed's
checkpoint inside its own folder (the Hugging Face Trainer: ``checkpoint-N/global_stepN/``, ``latest``...).

:func:`capture_save` runs DeepSpeed's own ``save_checkpoint`` into a scratch directory with
:class:`CaptureEngine` as ``engine.checkpoint_engine``: every state dict DeepSpeed hands the engine is recorded
as a :class:`~snapckpt.formats.TorchSave` (its tensors are copied by the snapshot, not serialized on the
training thread), and what DeepSpeed writes itself (``latest`` and the recovery scripts ``zero_to_fp32.py`` /
``zero_to_torch.py``, on rank 0) is read back as :class:`~snapckpt.formats.RawBytes` with the mode DeepSpeed
gave it (it makes the scripts executable by their owner). The names are relative
to the save directory and are DeepSpeed's (``global_stepN/mp_rank_00_model_states.pt`` ...); the caller
snapshots them together with its own files through :meth:`snapckpt.Checkpointer.save_files`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict, Optional

from snapckpt.formats import RawBytes, TorchSave

from snapckpt.integrations.deepspeed.engine import CheckpointEngine
from snapckpt.integrations.deepspeed.checkpointer import _check_engine

__all__ = ["CaptureEngine", "capture_save"]


class CaptureEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` that records the state dicts of a save instead of writing them.

    Args:
        root: the save directory of the captured save; recorded names are relative to it.

    Attributes:
        files: ``{name relative to root: TorchSave(state_dict)}``, in the order DeepSpeed saved them.
    """

    def __init__(self, root: str) -> None:
        super().__init__()
        self.name = "snapckpt-capture"
        self.root = os.path.abspath(root)
        self.files: Dict[str, Any] = {}

    def create(self, info) -> None:
        pass

    def makedirs(self, path, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=True)  # inside the scratch directory: DeepSpeed copies its scripts there

    def save(self, state_dict, path: str) -> None:
        """Record ``state_dict`` as the file ``path`` (relative to :attr:`root`).

        Raises:
            ValueError: ``path`` is outside the save directory (a second save directory in one call).
        """
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel.startswith(".."):
            raise ValueError(f"DeepSpeed saved {path!r} outside the captured save directory {self.root!r}")
        self.files[rel.replace(os.sep, "/")] = TorchSave(state_dict)

    def load(self, path: str, map_location=None):
        raise NotImplementedError("CaptureEngine only captures saves; loads go through DeepSpeed's own engine")

    def commit(self, info) -> bool:
        return True

    def is_decoupled(self) -> bool:
        return False  # DeepSpeed writes `latest` into the scratch directory at the end of save_checkpoint

    def preserves_storage_sharing(self) -> bool:
        return False  # no clone before save(): the snapshot copies only the bytes each view uses


def capture_save(engine, *, tag: Optional[str] = None, exclude_frozen_parameters: bool = False) -> Dict[str, Any]:
    """Collective: the files this rank's ``engine.save_checkpoint(save_dir, tag=tag)`` would write, as
    ``{name relative to save_dir: file spec}``, without writing any of them.

    Args:
        engine: a ``DeepSpeedEngine`` (dense model, ZeRO stage 0-3).
        tag: DeepSpeed's tag (default ``global_step<engine.global_steps>``, as DeepSpeed).
        exclude_frozen_parameters: DeepSpeed semantics (the Trainer sets it for a PEFT model).

    Returns:
        DeepSpeed's state files as ``TorchSave`` of the live state dicts (valid until the weights change:
        snapshot them before the next optimizer step); on the rank that writes them, ``latest`` and the
        recovery scripts as ``RawBytes``. ``save_non_zero_checkpoint`` decides as in DeepSpeed which rank
        has ``mp_rank_00_model_states.pt``.

    Raises:
        TypeError, NotImplementedError: see :class:`~snapckpt.integrations.deepspeed.DeepSpeedCheckpointer`
            (not an engine; pipeline, MoE, NVMe optimizer offload).
    """
    _check_engine(engine)
    scratch = tempfile.mkdtemp(prefix="snapckpt-ds-capture-")
    capture = CaptureEngine(scratch)
    own = engine.checkpoint_engine
    engine.checkpoint_engine = capture
    try:
        engine.save_checkpoint(scratch, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters)
        files = dict(capture.files)
        for root, _, names in os.walk(scratch):
            for n in names:
                rel = os.path.relpath(os.path.join(root, n), scratch).replace(os.sep, "/")
                if rel not in files:
                    files[rel] = RawBytes.from_file(os.path.join(root, n))  # with its mode: zero_to_fp32.py is +x
    finally:
        engine.checkpoint_engine = own
        shutil.rmtree(scratch, ignore_errors=True)
    return files
