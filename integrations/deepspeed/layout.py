"""Names in a DeepSpeed checkpoint directory: the ``latest`` tracker, snapckpt's sidecar, the tags allowed.

Both sides of the data path read these: the save side (:mod:`.save`) names the sidecar and checks the tag
before a snapshot, the load side (:mod:`.load`) reads ``latest`` and the sidecar back. The layout itself is
DeepSpeed's (``<dir>/<tag>/mp_rank_00_model_states.pt``, ``zero_pp_rank_*_optim_states.pt``, ``<dir>/latest``);
snapckpt adds only ``<tag>/.snapckpt/`` (the manifest and one RNG sidecar per rank), which DeepSpeed ignores.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Dict, Optional

import torch

from snapckpt.errors import UnsafeCheckpointError
from snapckpt.ondisk.manifest import SIDECAR, validate_dirname

__all__ = ["TRACKER", "RESERVED_TAGS", "sidecar_name", "check_tag", "load_sidecar", "read_tracker",
           "same_directory"]

TRACKER = "latest"  # DeepSpeed's tracker file (engine.save_checkpoint / engine.load_checkpoint)
RESERVED_TAGS = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")


def sidecar_name(rank: int) -> str:
    """The path, relative to the tag directory, of rank ``rank``'s sidecar (``{"tag", "rng"}``)."""
    return f"{SIDECAR}/deepspeed_rank_{rank:05d}.pt"


def same_directory(path: "str | os.PathLike[str]", checkpoint_dir: str) -> bool:
    """Whether ``path`` is ``checkpoint_dir`` once symlinks and ``..`` are resolved."""
    return os.path.realpath(path) == os.path.realpath(checkpoint_dir)


def read_tracker(checkpoint_dir: str) -> Optional[str]:
    """The tag ``<checkpoint_dir>/latest`` names (stripped), or ``None`` when it cannot be read."""
    try:
        with open(os.path.join(checkpoint_dir, TRACKER), encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def load_sidecar(path: str) -> Dict[str, Any]:
    """Load snapckpt's own sidecar ``{"tag", "rng"}`` with ``weights_only=True`` whatever the trust option:
    it holds only tensors, ints, floats and strings (:mod:`snapckpt.rng`), so a pickle planted there is never
    run.

    Raises:
        UnsafeCheckpointError: the file holds other objects (names the file).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{path} is snapckpt's RNG sidecar but holds objects other than tensors and "
                                    f"plain values, which are never unpickled: the file was replaced ({e})") from e


def check_tag(tag: str) -> None:
    """A tag DeepSpeed can load back: one path component (``validate_dirname``), none of ``*?[`` (DeepSpeed's
    loader finds a tag's files with ``glob``), no leading or trailing whitespace (DeepSpeed strips what it
    reads from ``latest``), and not a name DeepSpeed uses in the save directory itself.

    Raises:
        ValueError: naming the problem.
    """
    validate_dirname(tag, what="DeepSpeed tag (the tag= argument of engine.save_checkpoint)")
    bad = sorted(set(tag) & set("*?["))
    if bad:
        raise ValueError(f"DeepSpeed tag {tag!r} contains {bad}: DeepSpeed's load_checkpoint finds a tag's files "
                         "with glob, which treats these as patterns, so the checkpoint could not be loaded; "
                         "choose a tag without them")
    if tag != tag.strip():
        raise ValueError(f"DeepSpeed tag {tag!r} starts or ends with whitespace, which DeepSpeed strips when it "
                         "reads `latest`; choose a tag without it")
    if tag in RESERVED_TAGS:
        raise ValueError(f"DeepSpeed tag {tag!r} is the name of a file DeepSpeed keeps in the checkpoint directory "
                         f"({', '.join(RESERVED_TAGS)}); choose another tag")
