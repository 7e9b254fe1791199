"""The load side: ``engine.load_checkpoint`` over snapckpt's tiers, with DeepSpeed's ``latest`` and native dirs.

Data path: every rank agrees (``Checkpointer.load_with``) on the newest step complete on all ranks, in
memory or committed on disk; each :class:`~snapckpt.LoadCandidate` is checked on every rank before any
rank runs DeepSpeed's loader (which runs collectives under ZeRO-3), then loaded by DeepSpeed's own
``load_checkpoint``: from the committed directory (DISK), or from empty placeholder files in a scratch
directory while :class:`~.engine.SnapckptCheckpointEngine` serves the objects from the snapshot (MEMORY).
A directory snapckpt did not commit (a checkpoint DeepSpeed wrote itself) is loaded natively.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any, Optional, Tuple

from snapckpt import Checkpointer, LoadCandidate, LoadInfo, rng
from snapckpt.errors import CheckpointNotFoundError, IncompatibleCheckpointError
from snapckpt.events import StorageType
from snapckpt.ondisk.manifest import SIDECAR, validate_dirname

from snapckpt.integrations.deepspeed.engine import SnapckptCheckpointEngine
from snapckpt.integrations.deepspeed.layout import TRACKER, load_sidecar, read_tracker, same_directory, sidecar_name

__all__ = ["DeepSpeedLoader", "UNIVERSAL_CHECKPOINT_ADVICE"]

log = logging.getLogger(__name__)

UNIVERSAL_CHECKPOINT_ADVICE = (
    "DeepSpeed ZeRO stage 1-3 checkpoints (optimizer state partitioned by data-parallel rank) cannot be loaded "
    "at another data-parallel size, by DeepSpeed's own load_checkpoint either (ZeRO stage 0 ones can); convert "
    "the checkpoint with "
    "DeepSpeed's universal checkpoint tool (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
    "<dir>/<tag> --output_folder <dir>/<tag>_universal) and load it with "
    "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config. The tool needs the key "
    "\"universal_checkpoint_info\" in the checkpoint's client state, which Megatron-DeepSpeed saves and plain "
    "DeepSpeed does not: save with engine.save_checkpoint(dir, client_state={\"universal_checkpoint_info\": {}})")


class DeepSpeedLoader:
    """Loads one DeepSpeed engine from a checkpoint directory, through snapckpt's tiers.

    Args:
        engine: the ``DeepSpeedEngine``.
        checkpointer: the :class:`snapckpt.Checkpointer` of the checkpoint directory.
        ckpt_engine: the engine's :class:`~.engine.SnapckptCheckpointEngine` (serves memory-tier loads).
    """

    def __init__(self, engine, checkpointer: Checkpointer, ckpt_engine: SnapckptCheckpointEngine) -> None:
        self.engine = engine
        self.checkpointer = checkpointer
        self.ckpt_engine = ckpt_engine
        self.checkpoint_dir = checkpointer.checkpoint_dir

    def load(self, load_dir, tag, kwargs) -> Tuple[Any, Any]:
        """``(load_path, client_state)`` of ``load_dir`` at ``tag`` (``None``: the newest), ``(None, None)``
        when there is nothing to load; ``kwargs`` are ``engine.load_checkpoint``'s other arguments.
        Collective. Raises what ``DeepSpeedCheckpointer.load_checkpoint`` documents."""
        if not same_directory(load_dir, self.checkpoint_dir):  # e.g. a pretrained checkpoint: no tiers
            return self._native_load(os.fspath(load_dir), None if tag is None else str(tag), kwargs)
        try:
            if tag is not None:
                return self._load_tag(tag, kwargs)
            result, _ = self.checkpointer.load_with(lambda c: self._load_candidate(c, kwargs),
                                                    check=self._check_candidate,
                                                    any_world_size=self._any_world_size())
            self._warn_missing_tracker_tag()  # once something else was loaded: "instead" is then true
            return result
        except IncompatibleCheckpointError as e:
            raise IncompatibleCheckpointError(f"{e}. {UNIVERSAL_CHECKPOINT_ADVICE}") from e
        except CheckpointNotFoundError:
            if tag is None and os.path.isfile(os.path.join(self.checkpoint_dir, TRACKER)):
                return self._load_tracker(kwargs)
            if tag is not None:
                raise
            log.info("nothing to load in %s yet (no memory snapshot, no committed tag)", self.checkpoint_dir)
            return None, None

    def _load_tag(self, tag, kwargs) -> Tuple[Any, Any]:
        # a tag of this directory: never a path out of it
        tag = validate_dirname(str(tag), what="DeepSpeed tag (the tag= argument of engine.load_checkpoint)")
        tagdir = os.path.join(self.checkpoint_dir, tag)
        gone = (f"no tag {tag!r} in {self.checkpoint_dir} (tags there: {_tags(self.checkpoint_dir)}; memory "
                "snapshots are loaded with tag=None; a tag the job saving there retires or commits again can be "
                "missing for a moment)")
        # The job saving there may retire the tag or commit it again (old copy renamed aside, then the new one in
        # place) while this looks: every rank takes the branch of what any rank saw, so that a directory snapckpt
        # committed is never handed to DeepSpeed's own loader without its manifest check.
        kinds = {p["kind"] for p in self.checkpointer.coordinator.gather(f"ds tag {tag}", {"kind": _kind(tagdir)})}
        if "snapckpt" in kinds:
            try:
                result, _ = self.checkpointer.load_with(lambda c: self._load_disk(c, kwargs), dirname=tag,
                                                        check=self._check_candidate,
                                                        any_world_size=self._any_world_size())
            except CheckpointNotFoundError as e:  # retired (or mid-replace) since the look: name the tag
                raise CheckpointNotFoundError(f"{gone}: {e}") from e
            return result
        if "none" in kinds:
            raise CheckpointNotFoundError(gone)
        try:
            return self._native_load(self.checkpoint_dir, tag, kwargs)  # DeepSpeed wrote it itself
        except Exception as e:
            if not os.path.isdir(tagdir):  # DeepSpeed fails on an empty file list with a bare AssertionError
                raise CheckpointNotFoundError(f"{gone} (it went away while DeepSpeed read it: {type(e).__name__})"
                                              ) from e
            raise

    def _load_tracker(self, kwargs) -> Tuple[Any, Any]:
        """No snapckpt checkpoint, but a ``latest``: the checkpoint DeepSpeed wrote itself, natively."""
        named = read_tracker(self.checkpoint_dir)
        if not named:
            raise CheckpointNotFoundError(
                f"{os.path.join(self.checkpoint_dir, TRACKER)} is empty or unreadable and no snapckpt "
                f"checkpoint is in {self.checkpoint_dir}, so no tag is known to load: write the tag to "
                f"load into {TRACKER} (or pass tag=...), or delete {TRACKER} to start from scratch") from None
        if not os.path.isdir(os.path.join(self.checkpoint_dir, named)):
            raise CheckpointNotFoundError(
                f"{os.path.join(self.checkpoint_dir, TRACKER)} names tag {named!r}, which is not in "
                f"{self.checkpoint_dir}, and no other checkpoint is there: restore that tag, or delete "
                f"{TRACKER} to start from scratch") from None
        log.info("no snapckpt commit in %s; loading the checkpoint DeepSpeed wrote natively",
                 self.checkpoint_dir)
        return self._native_load(self.checkpoint_dir, None, kwargs)

    def _any_world_size(self) -> bool:
        """Whether a committed tag saved at another world size is a candidate: under ZeRO stage 0, as for
        DeepSpeed's own ``load_checkpoint``, which reads ``mp_rank_{mp}_model_states.pt`` (model, optimizer and
        scheduler, not partitioned by data-parallel rank) at any data-parallel size. Stages 1-3 partition the
        optimizer state per data-parallel rank: DeepSpeed refuses another size, and so does snapckpt (with
        :data:`UNIVERSAL_CHECKPOINT_ADVICE`). The RNG sidecar of this rank is restored when the tag has one."""
        return int(self.engine.zero_optimization_stage()) == 0

    def _warn_missing_tracker_tag(self) -> None:
        """Rank 0 warns when ``latest`` is empty or unreadable, or names a tag that is not in the directory
        (edited by hand, truncated, or its tag deleted): snapckpt resumes from the newest intact checkpoint,
        stock DeepSpeed would fail."""
        if self.checkpointer.rank != 0:
            return
        path = os.path.join(self.checkpoint_dir, TRACKER)
        if not os.path.lexists(path):
            return
        if os.path.isdir(path) and not os.path.islink(path):
            log.warning("%s is a directory, not DeepSpeed's tracker file; resuming from the newest intact "
                        "checkpoint in %s instead. Remove it: a DISK save refuses to start while it is there",
                        path, self.checkpoint_dir)
        elif not (named := read_tracker(self.checkpoint_dir)):
            log.warning("%s is empty or unreadable (stock DeepSpeed could not load from it); resuming from the "
                        "newest intact checkpoint in %s instead (the next commit rewrites it)", path,
                        self.checkpoint_dir)
        elif not os.path.isdir(os.path.join(self.checkpoint_dir, named)):
            log.warning("%s names tag %r, which is not in %s; resuming from the newest intact checkpoint "
                        "instead (the next commit rewrites it)", path, named, self.checkpoint_dir)

    def _check_candidate(self, cand: LoadCandidate) -> None:
        """Before any rank calls DeepSpeed's loader (which runs collectives under ZeRO-3): this rank's files
        are intact (DISK: sizes and checksums) or readable with their sidecar (MEMORY)."""
        if cand.tier == StorageType.DISK:
            cand.verify()
        elif sidecar_name(self.checkpointer.rank) not in cand.files():
            raise CheckpointNotFoundError("the memory snapshot has no snapckpt sidecar (not a DeepSpeed save)")

    def _load_candidate(self, cand: LoadCandidate, kwargs) -> Tuple[Any, Any]:
        if cand.tier == StorageType.DISK:
            return self._load_disk(cand, kwargs)
        sidecar = sidecar_name(self.checkpointer.rank)
        side = cand.files()[sidecar]
        files = {k: v for k, v in cand.files().items() if k != sidecar}
        tag = side["tag"]
        scratch = tempfile.mkdtemp(prefix="snapckpt-ds-load-")
        try:
            os.makedirs(os.path.join(scratch, tag))
            for name in files:
                open(os.path.join(scratch, tag, name), "wb").close()  # DeepSpeed globs/stat()s these paths
            with self.ckpt_engine.serving(files):
                load_path, client_state = self._engine_load(scratch, tag, kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if load_path is None:
            raise CheckpointNotFoundError(f"DeepSpeed found no model-states file in the memory snapshot of {tag!r}")
        rng.restore(side["rng"])
        return os.path.join(self.checkpoint_dir, tag, os.path.basename(load_path)), client_state

    def _load_disk(self, cand: LoadCandidate, kwargs) -> Tuple[Any, Any]:
        cand.verify()
        load_path, client_state = self._engine_load(self.checkpoint_dir, cand.dirname, kwargs)
        if load_path is None:
            raise CheckpointNotFoundError(f"DeepSpeed found no model-states file in {cand.path}")
        side = os.path.join(cand.path, sidecar_name(self.checkpointer.rank))
        if os.path.exists(side):
            rng.restore(load_sidecar(side)["rng"])
        return load_path, client_state

    def _native_load(self, load_dir: str, tag: Optional[str], kwargs) -> Tuple[Any, Any]:
        """DeepSpeed's own load of a directory snapckpt did not commit (no tiers, no manifest check)."""
        t0 = time.perf_counter()
        load_path, client_state = self._engine_load(load_dir, tag, kwargs)
        if load_path is not None:
            self.checkpointer.last_load = LoadInfo(int(self.engine.global_steps), StorageType.DISK,
                                                   time.perf_counter() - t0)
        return load_path, client_state

    def _engine_load(self, load_dir: str, tag: Optional[str], kwargs) -> Tuple[Any, Any]:
        try:
            return type(self.engine).load_checkpoint(self.engine, load_dir, tag=tag, **kwargs)
        except Exception as e:
            if "world size" in str(e) and "not currently supported" in str(e):
                raise IncompatibleCheckpointError(f"{e} {UNIVERSAL_CHECKPOINT_ADVICE}") from e
            raise


def _kind(tagdir: str) -> str:
    """What the directory of a tag is right now: ``"snapckpt"`` (it has snapckpt's manifest), ``"native"`` (a
    directory without one: DeepSpeed wrote it itself) or ``"none"`` (no such directory). The manifest is looked
    for before and after the directory: a re-commit's new copy that appeared in between is ``"snapckpt"``."""
    manifest = os.path.join(tagdir, SIDECAR, "manifest.json")
    if os.path.exists(manifest):
        return "snapckpt"
    if not os.path.isdir(tagdir):
        return "none"
    return "snapckpt" if os.path.exists(manifest) else "native"


def _tags(checkpoint_dir: str, most: int = 20) -> str:
    """The tag directories of ``checkpoint_dir`` for a message: sorted, hidden ones (snapckpt's) left out, at most
    ``most`` named."""
    try:
        names = sorted(n for n in os.listdir(checkpoint_dir)
                       if not n.startswith(".") and os.path.isdir(os.path.join(checkpoint_dir, n)))
    except OSError:
        return "none readable"
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(map(repr, names[:most])) + more
