"""The plain layout of :class:`snapckpt.Checkpointer` (integrations bring their own names).

::

    <checkpoint_dir>/step_00000100/rank_00000.pt   rank 0's state dict, a torch.save file
    <checkpoint_dir>/step_00000100/.snapckpt/manifest.json
    <checkpoint_dir>/latest                         tracker: the name of the newest committed directory

A shard loads without snapckpt: ``torch.load("ckpt/step_00000100/rank_00000.pt", weights_only=False)``.
"""
from __future__ import annotations

import re

__all__ = ["step_dirname", "rank_filename", "TRACKER", "STEP_DIR_PATTERN"]

TRACKER = "latest"
#: Names :func:`step_dirname` makes (a directory so named without a manifest is a damaged checkpoint).
STEP_DIR_PATTERN = re.compile(r"step_\d{8,}")


def step_dirname(step: int) -> str:
    """Directory name of a step: ``step_%08d``."""
    return f"step_{step:08d}"


def rank_filename(rank: int) -> str:
    """File of a rank's state dict: ``rank_%05d.pt``."""
    return f"rank_{rank:05d}.pt"
