"""Megatron-LM's tracker file and directory names, read at the start of a load.

``<save>/latest_checkpointed_iteration.txt`` names the newest iteration (``"100"``, or ``"release"``);
snapckpt's committer writes it last, after the commit (the save passes :data:`TRACKER` to
``Checkpointer.save_files``). A load reads it to find a directory megatron-core wrote itself (*native*: no
``.snapckpt`` sidecar), which snapckpt's candidates do not include: rank 0 reads it and every rank gets
rank 0's reading (:func:`agreed_tracker`), so the ranks never disagree about it.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict

from snapckpt import Checkpointer
from snapckpt.errors import CheckpointCorruptError
from snapckpt.ondisk.manifest import SIDECAR

__all__ = ["TRACKER", "checkpoint_dirname", "read_tracker", "is_native", "agreed_tracker"]

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_\d{7,}")


def checkpoint_dirname(iteration: int, release: bool = False) -> str:
    """Megatron-LM's directory name of an iteration: ``iter_%07d`` (``release`` for a release)."""
    return "release" if release else f"iter_{iteration:07d}"


def is_native(path: str) -> bool:
    """``path`` is a directory megatron-core wrote itself: no snapckpt sidecar (with or without its manifest),
    and megatron-core's own files present."""
    return (not os.path.exists(os.path.join(path, SIDECAR))
            and all(os.path.exists(os.path.join(path, n)) for n in (".metadata", "metadata.json")))


def read_tracker(directory: str) -> Dict[str, Any]:
    """What ``latest_checkpointed_iteration.txt`` names: ``{"dirname", "iteration" (-1 for a release),
    "native"}``; ``dirname`` None if there is no tracker.

    ``native`` is True when megatron-core wrote the directory itself: it has neither a snapckpt manifest
    nor a ``.snapckpt`` sidecar (a sidecar without its manifest is snapckpt's, damaged: never native). A
    tracker naming a directory that does not exist is ignored with a warning naming it; the newest native
    directory found (``iter_*`` with megatron-core's ``.metadata`` and ``metadata.json``, no sidecar) is
    named instead, if any (``"ignored"`` then holds the warning).

    Raises:
        CheckpointCorruptError: the tracker holds neither an iteration nor ``release``.
    """
    path = os.path.join(directory, TRACKER)
    try:
        with open(path) as f:
            content = f.read().strip()
    except FileNotFoundError:
        return {"dirname": None, "iteration": -1, "native": False}
    if content != "release" and not content.isdigit():
        raise CheckpointCorruptError(f"{path} holds {content!r}, not an iteration; fix or delete it")
    dirname = checkpoint_dirname(int(content), release=content == "release")
    if not os.path.isdir(os.path.join(directory, dirname)):
        natives = sorted((int(n[5:]), n) for n in os.listdir(directory)
                         if _ITER_DIR.fullmatch(n) and is_native(os.path.join(directory, n)))
        msg = (f"{path} names {dirname}, which does not exist (deleted, or the tracker was edited by hand); "
               "ignoring it: resuming from the newest intact checkpoint there")
        log.warning("%s", msg)
        if not natives:
            return {"dirname": None, "iteration": -1, "native": False, "ignored": msg}
        return {"dirname": natives[-1][1], "iteration": natives[-1][0], "native": True, "ignored": msg}
    native = is_native(os.path.join(directory, dirname))
    return {"dirname": dirname, "iteration": -1 if content == "release" else int(content), "native": native}


def agreed_tracker(ck: Checkpointer) -> Dict[str, Any]:
    """Rank 0's reading of the tracker (:func:`read_tracker`), given to every rank (collective; ranks never
    disagree about it).

    Raises:
        CheckpointCorruptError: on every rank, when rank 0 found the tracker unreadable.
    """
    mine: Dict[str, Any] = {}
    if ck.rank == 0:
        try:
            mine = read_tracker(ck.checkpoint_dir)
        except CheckpointCorruptError as e:
            mine = {"error": str(e)}
    theirs = ck.coordinator.gather("megatron-tracker", mine)[0]
    if "error" in theirs:
        raise CheckpointCorruptError(theirs["error"])
    return theirs
