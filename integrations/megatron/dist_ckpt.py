"""Megatron: ``save_checkpoint`` / ``load_checkpoint`` in Megatron's ``torch_dist`` layout through snapckpt.

Public face: :mod:`snapckpt.megatron_dist_ckpt` (the drop-in functions) and :mod:`snapckpt.megatron` (the
``--snapckpt`` flag). This module only gathers the drop-in names; each job has its own module. Layout
(Megatron-LM's, unchanged)::

    <save>/iter_0000100/__{rank}_{n}.distcp, .metadata, common.pt, metadata.json   (+ .snapckpt/manifest.json)
    <save>/latest_checkpointed_iteration.txt        written by the committer after the commit: "100"

Modules, in the order of the data path:

- :mod:`~snapckpt.integrations.megatron.registry`: the process's Checkpointer of each directory,
  :func:`fence`, :func:`poll`, :func:`close_all`;
- :mod:`~snapckpt.integrations.megatron.metrics`: each checkpoint's ``snapckpt/*`` metrics to a TensorBoard
  writer (``save_checkpoint(..., tensorboard_writer=)``), Megatron-LM's timers on the flag path;
- :mod:`~snapckpt.integrations.megatron.state`: the state dict Megatron-LM builds, and restoring it;
- :mod:`~snapckpt.integrations.megatron.save`: :func:`save_checkpoint`, this rank's files of a save
  (megatron-core's planning with :mod:`~snapckpt.integrations.megatron.torch_dist`'s writer, the
  memory-tier record of :mod:`~snapckpt.integrations.megatron.memory`), the cached DCP plans;
- :mod:`~snapckpt.integrations.megatron.tracker`: ``latest_checkpointed_iteration.txt``, directory names,
  directories megatron-core wrote natively;
- :mod:`~snapckpt.integrations.megatron.load`: :func:`load_checkpoint`, which checkpoint to read and
  restoring it;
- :mod:`~snapckpt.integrations.megatron.reshard`: megatron-core's stock loader (which reshards) and
  snapckpt's directories of another world size, verified first.

A load agrees on the newest step with every rank (``Checkpointer.load_with``): from memory the record is
mapped back onto a fresh sharded state dict (same parallel layout only; any mismatch falls back to disk);
from disk through stock ``megatron.core.dist_checkpointing.load``, which reshards (e.g. DP=2 to TP=2).
snapckpt's directories of another world size are loaded the same way, newest intact first, once every
saving rank's files passed their checksums (megatron-core reads any rank's files and checks nothing). A
directory megatron-core wrote natively (no ``.snapckpt`` sidecar at all: a sidecar without its manifest
is snapckpt's, damaged) is loaded through ``latest_checkpointed_iteration.txt`` and the stock loader; a
tracker naming a directory that does not exist is ignored with a warning.
"""
from snapckpt.integrations.megatron.load import load_checkpoint
from snapckpt.integrations.megatron.memory import MEMORY_FILE
from snapckpt.integrations.megatron.registry import close_all, fence, get_checkpointer, poll
from snapckpt.integrations.megatron.save import expect_checkpoint, save_checkpoint
from snapckpt.integrations.megatron.tracker import TRACKER, checkpoint_dirname

__all__ = ["save_checkpoint", "load_checkpoint", "expect_checkpoint", "get_checkpointer", "checkpoint_dirname",
           "TRACKER", "MEMORY_FILE", "close_all", "fence", "poll"]
