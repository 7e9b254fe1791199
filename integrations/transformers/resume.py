"""Resume-time folder work of the Hugging Face Trainer integration (collective, at Trainer construction).

:class:`~snapckpt.integrations.transformers.callback.SnapckptCallback` calls :func:`materialize_newest`
from ``on_init_end``, before ``trainer.train(resume_from_checkpoint=True)`` looks for a checkpoint with
transformers' ``get_last_checkpoint`` (the newest ``checkpoint-<digits>`` folder of ``output_dir``):

1. Memory-tier resume: the ranks agree on the newest snapshot (:meth:`Checkpointer.load_with`). If it is
   held in memory only and is newer than every ``checkpoint-*`` folder, it is written out as the native
   folder ``checkpoint-N`` (:meth:`Checkpointer.write_out`, waiting for the commit), so the Trainer
   resumes natively from it. (With ``flush_on_crash=True``, the default, the persister itself usually
   writes that folder as soon as the crashed ranks are gone; this covers the case it has not, or is
   disabled.)
2. Damage: the folder ``get_last_checkpoint`` would pick is verified (sizes, checksums of every file, also
   when snapckpt's own candidates are of another world size: :meth:`Checkpointer.verify_directory`); a
   damaged one is renamed to a hidden ``.checkpoint-N.damaged-<time>``, down to the newest intact folder.
   When no intact one exists, :class:`~snapckpt.errors.CheckpointCorruptError` is raised and nothing is
   moved, so that no later start trains from step 0 while checkpoints exist.
3. Changed in place: damage is a listed file whose bytes differ from the committed ones. A folder whose
   set of files differs from its manifest's (the user re-sharded the weights, deleted ``optimizer.pt``)
   is no longer described by the manifest: it is left to the Trainer (not moved, resumed from as the
   Trainer would), with a warning naming it and the files; the listed files still there are verified.

Every function taking the ``Checkpointer`` is collective: each rank calls it in the same order, and the
decisions are rank 0's, shared through :attr:`Checkpointer.coordinator`.
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Dict, List, Optional, Tuple

from snapckpt import Checkpointer, StorageType
from snapckpt.errors import (CheckpointCorruptError, CheckpointNotFoundError, IncompatibleCheckpointError,
                             all_damaged_error)
from snapckpt.ondisk.manifest import check_sizes, file_set_changes, list_committed, present_files

__all__ = ["PREFIX", "materialize_newest", "newest_intact", "verify_folder", "agreed_last_native",
           "last_native", "size_damaged", "changed_in_place", "set_aside"]

log = logging.getLogger(__name__)

PREFIX = "checkpoint"
_NATIVE = re.compile(rf"^{PREFIX}-(\d+)$")  # transformers' own pattern (trainer_utils._re_checkpoint)


def _step(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def materialize_newest(ck: Checkpointer, output_dir: str,
                       resume_from_memory: bool) -> Optional[Tuple[int, StorageType]]:
    """Collective: make sure the folder the Trainer's ``get_last_checkpoint`` will resume from is intact,
    and (``resume_from_memory``) write the newest snapshot out as ``checkpoint-N`` if it is held in memory
    only, or if ``checkpoint-N`` of the same step is damaged (then that folder is moved aside first, and the
    newest complete step is resumed, not an older one).

    Damaged folders (a listed file of the wrong size or checksum) are moved aside (see :func:`set_aside`)
    only once an intact checkpoint to resume from is known: an intact folder, a folder the Trainer wrote
    itself (no snapckpt manifest), or the memory snapshot just written out. A folder changed in place
    (:func:`changed_in_place`) is the Trainer's: a warning names it, its remaining listed files are verified.

    Args:
        ck: the callback's Checkpointer of ``output_dir``.
        output_dir: ``TrainingArguments.output_dir``.
        resume_from_memory: write a memory-only snapshot out (``False``: only verify the folders).

    Returns:
        ``(step, StorageType.MEMORY)`` of the snapshot written out, else ``None``.

    Raises:
        CheckpointCorruptError: ``checkpoint-*`` folders exist, every one of snapckpt's is damaged and
            none is the Trainer's own; each is named with its cause and left in place, so that every
            later start raises too instead of training from step 0.
    """
    timeout = ck.options.coordination_timeout_secs
    # folders whose listed files no longer match their manifest's sizes (truncated by a power loss) are no
    # load candidates at all; rank 0 lists them, and the folders changed in place, for everyone
    scan = _scan(ck, output_dir) if ck.rank == 0 else ({}, {})
    damaged, changed = ck.coordinator.gather("hf-size-damaged", {"s": scan}, timeout)[0]["s"]
    if ck.rank == 0:
        for name in sorted(set(changed) - set(damaged), key=_step):
            log.warning("%s was changed since snapckpt committed it (%s): its manifest no longer describes it, "
                        "so its set of files is not counted as damage and the folder is left to the Trainer; the "
                        "listed files still there are verified", os.path.join(output_dir, name), changed[name])
    refused: Dict[str, str] = {}  # snapckpt's disk candidates tried: this rank's error ("" if it verified)
    verified: set = set()  # folders every rank verified (its share) while probing a memory candidate

    def probe(cand):
        if cand.tier == StorageType.MEMORY:  # every disk candidate tried before it was refused by some rank
            if not resume_from_memory:
                return None  # the folders are verified below
            native = agreed_last_native(ck, output_dir, set(damaged) | set(refused))
            if native is not None and cand.step == _step(native):
                # the folder of the same step decides: resume from it when intact, else write the memory
                # snapshot out in its place (the newest complete step is never given up for an older one)
                error = verify_folder(ck, output_dir, native)
                if not error:
                    verified.add(native)
                    return None
                damaged[native] = error  # the same on every rank: the errors were gathered
                native = agreed_last_native(ck, output_dir, set(damaged) | set(refused))
            return cand.files() if native is None or cand.step > _step(native) else None
        refused[cand.dirname] = ""
        try:
            cand.verify()
        except Exception as e:
            refused[cand.dirname] = f"{type(e).__name__}: {e}"
            raise
        return None

    files, cand = None, None
    try:
        files, cand = ck.load_with(probe)
    except (CheckpointNotFoundError, CheckpointCorruptError):
        pass  # no snapckpt candidate loads; the folders decide below (and name the damage)
    except IncompatibleCheckpointError as e:  # another world size: the Trainer's own resume copes
        log.info("snapckpt's own checkpoints are of another world size (%s); checking the folder the "
                 "Trainer resumes from", e)
    loaded = cand.dirname if cand is not None and cand.tier == StorageType.DISK else None
    causes: Dict[str, List[str]] = {}
    for p in ck.coordinator.gather("hf-refused", {"r": refused}, timeout):
        for name, error in p["r"].items():
            causes.setdefault(name, []).extend([error] if error else [])
    for name, errors in causes.items():
        if name != loaded and _NATIVE.match(name):
            damaged[name] = "; ".join(errors) or "refused by the load agreement"
    resumed_from = None
    if files is not None:  # an intact checkpoint to resume from: damaged folders may go (and free the name)
        name = f"{PREFIX}-{cand.step}"
        was = "its folder was damaged (moved aside)" if name in damaged else "it is held in memory only"
        set_aside(ck, output_dir, damaged)
        damaged = {}
        if ck.rank == 0:
            log.warning("the newest intact checkpoint is step %d in memory; %s: writing it to %s", cand.step,
                        was, os.path.join(output_dir, name))
        ck.write_out(files, cand.step, f"{PREFIX}-{cand.step}", modes=cand.modes())
        resumed_from = (cand.step, StorageType.MEMORY)
    trusted = {f"{PREFIX}-{cand.step}"} if files is not None else set(verified)
    if loaded is not None:
        trusted.add(loaded)  # verified by every rank in probe()
    intact = newest_intact(ck, output_dir, damaged, trusted)
    if intact is None and damaged:
        order = sorted(damaged, key=_step, reverse=True)
        raise all_damaged_error(output_dir, [f"{n}: {damaged[n]}" for n in order],
                                note=" (no folder was moved aside)")
    set_aside(ck, output_dir, damaged)
    return resumed_from


def newest_intact(ck: Checkpointer, output_dir: str, damaged: Dict[str, str], trusted: set) -> Optional[str]:
    """Collective: walk the ``checkpoint-*`` folders newest first, as ``get_last_checkpoint`` would pick
    them, skipping ``damaged``, and return the first intact one (``None``: none). A folder in ``trusted``
    or without a snapckpt manifest (the Trainer's own) counts as intact; any other has all its files'
    checksums verified (each rank a share); a damaged one is added to ``damaged`` with its cause."""
    while True:
        name = agreed_last_native(ck, output_dir, set(damaged))
        if name is None or name in trusted:
            return name
        error = verify_folder(ck, output_dir, name)
        if not error:
            return name
        damaged[name] = error
        if ck.rank == 0:
            log.warning("%s failed verification: %s", os.path.join(output_dir, name), error)


def verify_folder(ck: Checkpointer, output_dir: str, name: str) -> str:
    """Collective: :meth:`Checkpointer.verify_directory` of folder ``name``, the listed files still there
    (``""``: intact, changed in place with intact remaining files, or the Trainer's own folder without a
    manifest: a snapckpt one that lost its manifest is size-damaged, see :func:`size_damaged`); else the
    cause of the damage."""
    return ck.verify_directory(os.path.join(output_dir, name), name, present_only=True)


def agreed_last_native(ck: Checkpointer, output_dir: str, skip: set) -> Optional[str]:
    """Collective: :func:`last_native` as rank 0 sees ``output_dir``, the same on every rank."""
    name = last_native(output_dir, skip) if ck.rank == 0 else None
    return ck.coordinator.gather("hf-native", {"name": name})[0]["name"]


def last_native(output_dir: str, skip: set) -> Optional[str]:
    """The folder name ``get_last_checkpoint`` picks once the names in ``skip`` are gone (``None``: none)."""
    if not os.path.isdir(output_dir):
        return None
    names = [n for n in os.listdir(output_dir) if _NATIVE.match(n) and n not in skip
             and os.path.isdir(os.path.join(output_dir, n))]
    return max(names, key=_step) if names else None


def size_damaged(ck: Checkpointer, output_dir: str) -> Dict[str, str]:
    """``checkpoint-*`` folders of ``output_dir`` with a snapckpt manifest one of whose listed files (of
    those still there) is of the wrong size, or with a ``.snapckpt`` sidecar without a valid manifest:
    ``{folder name: what is wrong}``. Reads through :attr:`Checkpointer.storage`."""
    return _scan(ck, output_dir)[0]


def changed_in_place(ck: Checkpointer, output_dir: str) -> Dict[str, str]:
    """``checkpoint-*`` folders of ``output_dir`` whose set of files is no longer their manifest's (listed
    files gone, files not listed: :func:`snapckpt.ondisk.manifest.file_set_changes`): ``{folder name: the
    files}``. Not damage: the Trainer resumes from such a folder, so snapckpt leaves it to the Trainer."""
    return _scan(ck, output_dir)[1]


def _scan(ck: Checkpointer, output_dir: str) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``(size_damaged, changed_in_place)`` in one listing of ``output_dir``."""
    problems: List[str] = []
    damaged: Dict[str, str] = {}
    changed: Dict[str, str] = {}
    if not os.path.isdir(output_dir):
        return damaged, changed
    for c in list_committed(ck.storage, output_dir, quick_check=False, problems=problems):
        if not _NATIVE.match(c.dirname):
            continue
        missing, extra = file_set_changes(ck.storage, c.path, c.manifest)
        if missing or extra:
            changed[c.dirname] = "; ".join(
                ([f"gone: {', '.join(missing)}"] if missing else []) + ([f"not in it: {', '.join(extra)}"]
                                                                         if extra else []))
        try:
            check_sizes(ck.storage, c.path, present_files(ck.storage, c.path, c.manifest))
        except CheckpointCorruptError as e:
            damaged[c.dirname] = str(e)
    for p in problems:
        name, _, why = p.partition(": ")
        if _NATIVE.match(name):
            damaged[name] = why
    return damaged, changed


def set_aside(ck: Checkpointer, output_dir: str, damaged: Dict[str, str]) -> None:
    """Rank 0 renames the ``damaged`` checkpoint folders (``{name: cause}``, the same on every rank) to
    hidden ``.<name>.damaged-<unix time>`` (kept, never deleted), so that the Trainer's
    ``get_last_checkpoint`` resumes from the newest intact one; collective."""
    if damaged and ck.rank == 0:
        for name in sorted(damaged, key=_step, reverse=True):
            src = os.path.join(output_dir, name)
            dst = os.path.join(output_dir, f".{name}.damaged-{int(time.time())}")
            log.error("%s is damaged (%s); moved aside to %s so that the Trainer resumes from the newest "
                      "intact checkpoint", src, damaged[name], dst)
            os.rename(src, dst)
    ck.coordinator.gather("hf-damaged-done", {})
