"""Drop-in replacements for Megatron-LM's checkpoint functions (torch_dist format, through snapckpt).

    # from megatron.training.checkpointing import save_checkpoint, load_checkpoint
    from snapckpt.megatron_dist_ckpt import save_checkpoint, load_checkpoint

See :mod:`snapckpt.integrations.megatron.dist_ckpt` for the layout and the sequence of a save and a load.
"""
from snapckpt.events import StorageType
from snapckpt.integrations.megatron.dist_ckpt import (close_all, expect_checkpoint, fence, get_checkpointer,
                                                     load_checkpoint, poll, save_checkpoint)

__all__ = ["save_checkpoint", "load_checkpoint", "expect_checkpoint", "get_checkpointer", "fence", "poll", "close_all",
           "StorageType"]
