"""The per-rank memory record of a Megatron snapshot and its mapping back onto a sharded state dict.

A rank's record (``MEMORY_FILE``, a ``MemoryOnly`` file of DISK saves, the whole snapshot of MEMORY saves)
holds what ``dist_checkpointing.load`` would return for this rank's shards in the same parallel layout:
each ShardedTensor by a key of (key, global offset, flattened range), either as a tensor or, for the
tensors this rank itself wrote into a ``.distcp`` file, as ``(file, offset, length)`` of its
``torch.save`` item in that file (no second copy); each ShardedObject; and the common state.
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Tuple

import torch

from snapckpt.errors import IncompatibleCheckpointError

__all__ = ["MEMORY_FILE", "memory_record", "from_memory"]

MEMORY_FILE = "snapckpt_memory.pt"


def _sid(sh: Any) -> str:
    """A key naming one ShardedTensor/ShardedObject of this rank (stable across saves of one layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(sh, ShardedObject):
        return f"O|{sh.unique_key}"
    fr = sh.flattened_range
    flat = "" if fr is None else f"{fr.start}:{fr.stop}"
    return f"T|{sh.key}|{tuple(sh.global_offset)}|{flat}"


def memory_record(sharded: Dict[str, Any], common: Dict[str, Any],
                  written: Dict[Tuple[str, Tuple[int, ...]], Tuple[str, int, int]]) -> Dict[str, Any]:
    """The per-rank record a memory-tier load maps back: tensors (those not in ``written``), references
    ``(file, offset, length)`` into this rank's ``.distcp`` files for those in it, objects, common state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tensors: Dict[str, torch.Tensor] = {}
    refs: Dict[str, List[Any]] = {}
    objects: Dict[str, Any] = {}
    for sh in nested_values(sharded):
        sid = _sid(sh)
        if isinstance(sh, ShardedObject):
            objects[sid] = sh.data
            continue
        where = written.get((sh.key, tuple(sh.global_offset))) if sh.flattened_range is None else None
        if where is not None:
            refs[sid] = list(where)
        else:
            tensors[sid] = sh.data.detach()  # a device tensor is copied straight into host memory
    return {"format_version": 1, "tensors": tensors, "refs": refs, "objects": objects, "common": common}


def from_memory(sharded_sd: Dict[str, Any], files: Dict[str, Any]) -> Dict[str, Any]:
    """Map this rank's memory record back onto ``sharded_sd`` (what ``dist_checkpointing.load`` returns).

    Raises:
        IncompatibleCheckpointError: a shard is missing or of another shape (the parallel layout changed).
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    if MEMORY_FILE not in files:
        raise IncompatibleCheckpointError(f"the memory snapshot has no {MEMORY_FILE} (not a Megatron snapshot)")
    rec = files[MEMORY_FILE]
    sharded, nonpersistent, factories = load_preprocess(sharded_sd)
    state = rec["common"]
    merge(state, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)

    def fill(sh: Any) -> Any:
        if not isinstance(sh, ShardedBase):
            return sh
        sid = _sid(sh)
        if isinstance(sh, ShardedObject):
            if sid not in rec["objects"]:
                raise IncompatibleCheckpointError(f"memory snapshot lacks sharded object {sid}")
            return rec["objects"][sid]
        if sid in rec["tensors"]:
            t = rec["tensors"][sid]
        elif sid in rec["refs"]:
            name, off, length = rec["refs"][sid]
            t = torch.load(io.BytesIO(memoryview(files[name])[off:off + length]), map_location="cpu",
                           weights_only=True)
        else:
            raise IncompatibleCheckpointError(f"memory snapshot lacks shard {sid} (parallel layout changed?)")
        if tuple(t.shape) != tuple(sh.data.shape) and t.numel() == sh.data.numel():
            t = t.reshape(sh.data.shape)
        if tuple(t.shape) != tuple(sh.data.shape):
            raise IncompatibleCheckpointError(f"memory snapshot shard {sid} has shape {tuple(t.shape)}, the "
                                              f"model needs {tuple(sh.data.shape)}")
        return t

    dict_list_map_inplace(fill, sharded)
    merge(state, sharded)
    return apply_factory_merges(state, factories)
