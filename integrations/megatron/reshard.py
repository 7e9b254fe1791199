"""Loads through megatron-core's own loader, which reshards: the disk side of a Megatron load.

:func:`stock_load` is stock ``megatron.core.dist_checkpointing.load`` of one directory into a fresh
sharded state dict; it reads any rank's files and maps them onto the current parallel layout (e.g. saved
at DP=2, loaded at TP=2). :func:`load_resharded` uses it for snapckpt's directories saved by another number
of ranks, which ``Checkpointer.load_with`` does not offer as candidates: newest first, each one only after
every saving rank's files passed their manifest checksums (``Checkpointer.verify_directory``), because
megatron-core checks nothing. :mod:`~snapckpt.integrations.megatron.load` calls both.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from snapckpt import Checkpointer, LoadInfo, StorageType
from snapckpt.errors import CheckpointCorruptError, IncompatibleCheckpointError, all_damaged_error
from snapckpt.ondisk.manifest import list_committed

__all__ = ["stock_load", "other_world_sizes", "load_resharded", "newest_snapckpt"]

log = logging.getLogger(__name__)

FreshFn = Callable[[Dict[str, Any]], Dict[str, Any]]  # common state -> a fresh sharded state dict to load into


def stock_load(fresh: FreshFn, path: str, strictness: str = "assume_ok_unexpected") -> Dict[str, Any]:
    """Stock ``dist_checkpointing.load`` of ``path`` into ``fresh(common state)`` (collective), with
    Megatron-LM's ``--dist-ckpt-strictness``.

    Args:
        fresh: builds the sharded state dict to load into from the checkpoint's common state.
        path: the checkpoint's directory (``<load>/iter_%07d``).
        strictness: megatron-core's ``StrictHandling`` value.
    Returns:
        the loaded state dict.
    """
    import argparse

    from megatron.core import dist_checkpointing

    # common.pt holds Megatron-LM's args when they were saved; megatron-core loads it with torch.load's
    # default weights_only=True, so allow the Namespace as Megatron-LM itself does.
    torch.serialization.add_safe_globals([argparse.Namespace])
    common = dist_checkpointing.load_common_state_dict(path)
    state = dist_checkpointing.load(fresh(common), path, strict=strictness)
    return state[0] if isinstance(state, tuple) else state  # strictness modes that also return mismatches


def other_world_sizes(ck: Checkpointer) -> Dict[str, Any]:
    """Collective: snapckpt's committed directories saved by another number of ranks, newest first
    (``"dirs"``: ``[step, dirname, world_size]``; files present with their sizes, checksums not read yet),
    and its directories skipped as damaged (``"damaged"``: one line each; a ``.snapckpt`` sidecar marks
    them, megatron-core's own directories are not listed), as rank 0 lists them."""
    mine: Dict[str, Any] = {}
    if ck.rank == 0:
        problems: List[str] = []
        dirs = [[c.step, c.dirname, c.manifest["world_size"]]
                for c in list_committed(ck.storage, ck.checkpoint_dir, problems=problems)
                if c.manifest["world_size"] != ck.world_size]
        mine = {"dirs": sorted(dirs, reverse=True), "damaged": problems}
    return ck.coordinator.gather("megatron-other-ws", mine)[0]


def load_resharded(ck: Checkpointer, fresh: FreshFn, strictness: str) -> Optional[Tuple[Dict[str, Any], str]]:
    """Load the newest intact snapckpt directory saved by another number of ranks through megatron-core's
    loader (which reshards); collective. Every rank's files of a directory are verified against its
    manifest's checksums first (the files of saving rank ``r`` by rank ``r % world_size``), because
    megatron-core reads any rank's files and checks nothing. A damaged directory is skipped with a warning
    naming it and the next older one is tried.

    Sets ``ck.last_load`` (the core's ``load_with`` does, for the candidates it offers; these directories
    are not among them).

    Returns:
        ``(state, source)``, or None when snapckpt has no directory here at all (intact or damaged).

    Raises:
        CheckpointCorruptError: snapckpt's directories exist but none is intact; names each one and why.
    """
    found = other_world_sizes(ck)
    if not found["dirs"] and not found["damaged"]:
        return None
    t0 = time.perf_counter()
    refused: List[str] = []
    for step, dirname, ws in found["dirs"]:
        path = os.path.join(ck.checkpoint_dir, dirname)
        bad = ck.verify_directory(path, dirname)
        if bad:
            msg = f"iteration {step} ({dirname}, saved by {ws} ranks) is damaged: {bad}"
            log.warning("%s; trying the next older checkpoint", msg)
            refused.append(msg)
            continue
        if refused or found["damaged"]:
            log.warning("loading iteration %d, not the newest: %s", step,
                        " | ".join(refused + [f"{d} (skipped as damaged)" for d in found["damaged"]]))
        state = stock_load(fresh, path, strictness)
        ck.last_load = LoadInfo(step, StorageType.DISK, time.perf_counter() - t0, tuple(refused))
        return state, f"disk step {step} (saved by {ws} ranks, resharded by megatron-core)"
    raise all_damaged_error(ck.checkpoint_dir, refused, skipped=found["damaged"])


def newest_snapckpt(ck: Checkpointer) -> Optional[int]:
    """Newest step snapckpt holds here of any world size (None if none, or every one is damaged); collective."""
    try:
        return ck.latest_step()
    except CheckpointCorruptError:  # snapckpt's own are all damaged (logged)
        return None
    except IncompatibleCheckpointError:  # only directories of another world size
        dirs = other_world_sizes(ck)["dirs"]
        return dirs[0][0] if dirs else None
