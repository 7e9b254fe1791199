"""The save side: the files of one ``engine.save_checkpoint`` call, and their snapshot into snapckpt.

Data path: DeepSpeed's ``engine.save_checkpoint`` builds the state dicts and hands them, one file at a
time, to :class:`~.engine.SnapckptCheckpointEngine`, which collects them in a :class:`PendingSave`; once this
rank's expected files are all there, :meth:`DeepSpeedSaver.snapshot` adds the RNG sidecar and passes the
lot to ``Checkpointer.save_files`` (the shared-memory snapshot; for the DISK tier the node persister then
writes ``<dir>/<tag>/`` and replaces ``<dir>/latest`` after the commit).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from snapckpt import Checkpointer, rng
from snapckpt.events import StorageType
from snapckpt.formats import MemoryOnly, TorchSave

from snapckpt.integrations.deepspeed.layout import TRACKER, same_directory, sidecar_name

__all__ = ["PendingSave", "DeepSpeedSaver"]


class PendingSave:
    """The files DeepSpeed handed the engine during one ``save_checkpoint`` call on this rank.

    Args:
        save_dir: DeepSpeed's ``save_dir`` (absolute).
        tag: the tag (the directory name under ``save_dir``).
        save_latest: replace ``<save_dir>/latest`` once this tag is committed.
        expected: how many files of this rank make the save complete.
        passthrough: a save into another directory, written by DeepSpeed's own engine.
    """

    def __init__(self, save_dir: str, tag: str, save_latest: bool, expected: int, passthrough: bool) -> None:
        self.save_dir, self.tag, self.save_latest, self.expected = save_dir, tag, save_latest, expected
        self.passthrough = passthrough  # another directory: DeepSpeed's own engine writes it
        self.passed = 0  # files of a passthrough save written so far
        self.files: Dict[str, Any] = {}

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)


class DeepSpeedSaver:
    """What a save of one DeepSpeed engine expects, how each file is wrapped, and the snapshot of it.

    Args:
        engine: the ``DeepSpeedEngine``.
        checkpointer: the :class:`snapckpt.Checkpointer` of the checkpoint directory.
        original_engine: the engine's own ``checkpoint_engine`` (writes pass-through files).
        writes_model_states: whether DeepSpeed chose this rank to write ``mp_rank_XX_model_states.pt``
            (every rank builds it for its memory snapshot; only these ranks persist it).

    ``tier`` is the storage tier of the save in progress (set by ``DeepSpeedCheckpointer.save_checkpoint``,
    ``DISK`` otherwise); ``last_handle`` the :class:`snapckpt.SaveHandle` of the newest snapshot.
    """

    def __init__(self, engine, checkpointer: Checkpointer, original_engine, writes_model_states: bool) -> None:
        self.engine = engine
        self.checkpointer = checkpointer
        self.original_engine = original_engine
        self.writes_model_states = writes_model_states
        self.tier = StorageType.DISK
        self.last_handle = None

    def is_own_dir(self, path) -> bool:
        """Whether ``path`` is this checkpointer's directory (a save elsewhere is passed through)."""
        return same_directory(path, self.checkpointer.checkpoint_dir)

    def begin(self, info, passthrough: bool) -> PendingSave:
        """A :class:`PendingSave` for DeepSpeed's ``CheckpointCommitInfo`` ``info``."""
        return PendingSave(os.path.abspath(info.save_dir), str(info.tag), bool(info.save_latest),
                           self.expected_files(), passthrough=passthrough)

    def expected_files(self) -> int:
        """Files one save of this rank writes: the model states, plus the optimizer states under ZeRO."""
        return 1 + (1 if self.engine.save_zero_checkpoint else 0)

    def wrap(self, name: str, state_dict: Any) -> Any:
        """The file spec of ``state_dict`` saved as ``name``: memory-only on a rank DeepSpeed did not choose
        to write the model states."""
        if name.endswith("_model_states.pt") and not name.startswith("zero_pp_rank_") \
                and not self.writes_model_states:
            return MemoryOnly(TorchSave(state_dict))
        return TorchSave(state_dict)

    def pass_through(self, p: Optional[PendingSave], state_dict: Any, path: str) -> None:
        """Write ``path`` with DeepSpeed's own engine; after the last file of a pass-through save with
        ``save_latest``, rank 0 writes that directory's ``latest`` as DeepSpeed would."""
        self.original_engine.save(state_dict, path)
        if p is not None and p.passthrough and os.path.dirname(os.path.abspath(path)) == p.tag_dir:
            p.passed += 1
            if p.passed >= p.expected and p.save_latest and self.checkpointer.rank == 0:
                with open(os.path.join(p.save_dir, TRACKER), "w") as f:  # as DeepSpeed would
                    f.write(p.tag)

    def snapshot(self, p: PendingSave) -> None:
        """Snapshot the files of ``p`` with this rank's sidecar at ``engine.global_steps``, in :attr:`tier`."""
        files = dict(p.files)
        files[sidecar_name(self.checkpointer.rank)] = TorchSave({"tag": p.tag, "rng": rng.capture()})
        # a MEMORY snapshot carries the tracker too: it is only ever applied if the persister flushes the
        # snapshot to disk after a crash, and then `latest` must name it for stock DeepSpeed to find it
        tracker = TRACKER if p.save_latest else None
        self.last_handle = self.checkpointer.save_files(
            files, int(self.engine.global_steps), self.tier, dirname=p.tag, tracker_name=tracker,
            tracker_content=p.tag)
