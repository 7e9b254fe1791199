"""Megatron's ``torch_dist`` checkpoint files, produced as snapckpt file specs instead of being written.

A ``torch_dist`` directory (megatron-core ``dist_checkpointing`` with the PyTorch DCP backend) holds:

- ``__{rank}_{n}.distcp``: rank ``rank``'s write items back to back (``n`` < the writer's
  ``thread_count``, one file per non-empty bucket of megatron-core's ``_split_by_size_and_type``); each
  tensor item is a complete ``torch.save`` archive of that tensor, each byte item (a ``ShardedObject``)
  its already-serialized bytes;
- ``.metadata``: the pickled DCP ``Metadata`` (tensor/bytes metadata, megatron's ``mcore_data``, and
  ``storage_data``: ``MetadataIndex -> _StorageInfo(relative_path, offset, length)`` for every item),
  written by the coordinator (rank 0) after gathering every rank's write results;
- ``common.pt`` (rank 0, ``torch.save`` of the non-sharded state) and ``metadata.json`` (the
  ``CheckpointingConfig``).

Sources: ``torch/distributed/checkpoint/filesystem.py`` (PyTorch 2.13: ``_write_item``,
``FileSystemWriter.finish``, ``FileSystemReader.read_data``) and megatron-core 0.16
``dist_checkpointing/strategies/{torch,filesystem_async,state_dict_saver}.py``.

Why the tensor items are ``torch.save`` archives: the stock reader (``FileSystemReader.read_data``)
decodes every tensor item with ``torch.load`` whatever serialization format the writer used, so raw
tensor bytes (``SerializationFormat.SAFETENSORS``) would not load through megatron-core. The size of a
``torch.save`` archive of one compact tensor depends only on its dtype and shape, and with zip CRC-32s off
(``torch.serialization.set_crc32_options(False)``, which ``torch.load`` accepts) its bytes outside the
tensor data do not depend on the values either. :func:`torch_save_parts` therefore takes the archive of a
same-shaped template once and returns ``(head, tensor, tail)``: the item is a :class:`Concat` part list
whose size is known up front and whose tensor bytes go straight into the arena. The planning
(``MCoreSavePlanner``, ``save_state_dict_async_plan``/``_finalize``: the same collectives and the same
``Metadata`` as a stock save) is megatron-core's own; :class:`ArenaDistcpWriter` only replaces the file
writes by part lists.
"""
from __future__ import annotations

import io
import pickle
import threading
from typing import Any, Dict, List, Tuple

import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync, _split_by_size_and_type)
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["torch_save_parts", "ArenaDistcpWriter"]

# The version FileSystemWriter.finish records in the metadata; PyTorch added it after 2.7
# (pytorch/pytorch#155343); on older releases their own writer records none, and so does this one.
_DCP_VERSION = getattr(_dcp_fs, "CURRENT_DCP_VERSION", None)

_TEMPLATES: Dict[Tuple[torch.dtype, Tuple[int, ...]], Tuple[bytes, bytes]] = {}
_TEMPLATE_LOCK = threading.Lock()


def _template(dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple[bytes, bytes]:
    """``(head, tail)`` of ``torch.save(<compact tensor of dtype, shape>)`` around its data record."""
    key = (dtype, shape)
    got = _TEMPLATES.get(key)
    if got is not None:
        return got
    with _TEMPLATE_LOCK:
        probe = torch.empty(shape, dtype=dtype)  # values are irrelevant: only the layout is kept
        buf = io.BytesIO()
        old = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(probe, buf)
        finally:
            torch.serialization.set_crc32_options(old)
        raw = buf.getvalue()
        reader = torch._C.PyTorchFileReader(io.BytesIO(raw))
        records = [r for r in reader.get_all_records() if r == "data/0" or r.endswith("/data/0")]
        nbytes = probe.numel() * probe.element_size()
        if len(records) != 1 or reader.get_record_size(records[0]) != nbytes:
            raise RuntimeError(f"unexpected torch.save layout for a {dtype} tensor of shape {shape}: records "
                               f"{reader.get_all_records()}; this torch version is not supported")
        offset = reader.get_record_offset(records[0])
        got = _TEMPLATES[key] = (raw[:offset], raw[offset + nbytes:])
        return got


def torch_save_parts(t: torch.Tensor) -> List[Any]:
    """``[head bytes, tensor, tail bytes]``: the bytes of ``torch.save(t.contiguous())`` as Concat parts.

    ``t``: a tensor of a plain dtype on any device (any shape; a non-contiguous tensor is copied); the
    snapshot copies a device tensor straight into host memory. The result is
    ``len(head) + t.nbytes + len(tail)`` bytes; ``torch.load`` of those bytes returns a tensor equal to
    ``t`` (zip CRC-32 fields are 0, as ``torch.save`` writes them with ``set_crc32_options(False)``; the
    storage location recorded is ``cpu``, which is where DCP's reader loads it anyway).
    """
    if not t.is_contiguous():
        t = t.contiguous()
    head, tail = _template(t.dtype, tuple(t.shape))
    return [head, t.detach(), tail]


def _parts_nbytes(parts: List[Any]) -> int:
    return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else len(p) for p in parts)


class ArenaDistcpWriter(FileSystemWriterAsync):
    """A DCP storage writer that computes a ``torch_dist`` save's files instead of writing them.

    Sequence (driven by megatron-core's ``save_state_dict_async_plan`` / ``save_state_dict_async_finalize``,
    the same calls a stock torch_dist save makes):

    1. every rank: ``set_up_storage_writer``, ``prepare_local_plan`` (no directory is created), the plan
       collectives, ``prepare_decentralized_global_plan`` (prefix ``__{rank}_``);
    2. every rank: :meth:`prepare_write_data` resolves its items (``planner.resolve_data``) and lays out each
       ``.distcp`` file as Concat parts, so the write results (offset and length of every item) are known
       without writing a byte; :attr:`files` then maps each file name to its part list;
    3. finalize: the write results are gathered on the coordinator, whose :meth:`finish` stores the
       pickled ``Metadata`` (exactly what ``FileSystemWriter.finish`` writes) in :attr:`metadata_bytes`.

    Args:
        path: the checkpoint directory the files will end up in (recorded in the metadata's
            ``storage_meta.checkpoint_id``; nothing is created there).
        thread_count: number of ``.distcp`` buckets per rank (megatron-core's default save strategy
            uses 2).
    """

    def __init__(self, path: str, thread_count: int = 2) -> None:
        super().__init__(path, thread_count=thread_count, sync_files=False)
        self.files: Dict[str, List[Any]] = {}
        self.item_locations: Dict[Any, Tuple[str, int, int]] = {}
        self.metadata_bytes: bytes = b""
        self._results: List[WriteResult] = []

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return ``plan`` unchanged (a stock writer would create the directory here)."""
        return plan

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Lay out this rank's ``.distcp`` files (see the class docstring, step 2)."""
        prefix = plan.storage_data.prefix
        count = 0
        for bucket in _split_by_size_and_type(self.thread_count, plan.items):
            byte_items = [it for it in bucket if it.type == WriteItemType.BYTE_IO]
            tensor_items = [it for it in bucket if it.type != WriteItemType.BYTE_IO]
            if not byte_items and not tensor_items:
                continue
            name = f"{prefix}{count}{DEFAULT_SUFFIX}"
            count += 1
            parts: List[Any] = []
            offset = 0
            for item in byte_items + tensor_items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    item_parts = [bytes(data.getbuffer())]
                else:
                    item_parts = torch_save_parts(data.detach())
                length = _parts_nbytes(item_parts)
                self._results.append(WriteResult(index=item.index, size_in_bytes=length,
                                                 storage_data=_StorageInfo(name, offset, length)))
                self.item_locations[item.index] = (name, offset, length)
                parts += item_parts
                offset += length
            self.files[name] = parts
        self.write_buckets = []  # nothing for FileSystemWriterAsync's writer processes to do

    def retrieve_write_results(self) -> List[WriteResult]:
        """This rank's write results, computed by :meth:`prepare_write_data`."""
        return list(self._results)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Coordinator: complete ``metadata`` as ``FileSystemWriter.finish`` does and keep its pickle."""
        if _DCP_VERSION is not None:
            metadata.version = _DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        self.metadata_bytes = pickle.dumps(metadata)
