"""Reading a slot's contents: the header and JSON index the Stager wrote, and the snapshot itself.

A slot holds a fixed header (:mod:`snapckpt.persister.arena`), the storage spans, the pickled skeletons
and a JSON index of them. :func:`read_index` is what the persister reads before writing a slot's files
(never a pickle); :func:`read_slot` is the memory-tier load of a training rank (the reverse of
:meth:`snapckpt.engine.stager.Stager.copy_into`).
"""
from __future__ import annotations

import gc
import json
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from snapckpt.errors import SnapshotError
from snapckpt.persister.arena import read_header

if TYPE_CHECKING:
    import torch

__all__ = ["read_index", "read_index_at", "read_slot"]


def read_index(buf, source: str = "arena slot") -> Dict[str, Any]:
    """Parse the header and index of a slot (JSON only, never a pickle); ``SnapshotError`` naming
    ``source`` (the slot file's path) when they are damaged."""
    try:
        step, off, n = read_header(buf)
    except SnapshotError as e:
        raise SnapshotError(f"{e} ({source})") from e
    try:
        index = json.loads(bytes(buf[off:off + n]))
    except (ValueError, RecursionError) as e:
        raise SnapshotError(f"arena slot index of step {step} in {source} is damaged: {str(e)[:200]}") from e
    if not isinstance(index, dict) or not isinstance(index.get("files"), list):
        raise SnapshotError(f"arena slot index of step {step} in {source} is not a snapckpt index")
    if index.get("step") != step:
        raise SnapshotError(f"arena slot header of {source} says step {step} but its index says {index.get('step')}")
    return index


def read_index_at(buf, offset: int, nbytes: int, step: int, source: str = "arena slot") -> Dict[str, Any]:
    """Parse the index of a slot whose header is not written yet (a streamed save: the rank named where the
    index lies, ``offset``/``nbytes`` in bytes from the slot start); ``SnapshotError`` naming ``source`` when it
    is not the index of ``step``."""
    try:
        index = json.loads(bytes(buf[offset:offset + nbytes]))
    except (ValueError, RecursionError) as e:
        raise SnapshotError(f"arena slot index of step {step} in {source} is damaged: {str(e)[:200]}") from e
    if not isinstance(index, dict) or not isinstance(index.get("files"), list) or index.get("step") != step:
        raise SnapshotError(f"arena slot {source} holds no snapckpt index of step {step} at byte {offset}")
    return index


def read_slot(buf, slot: "torch.Tensor", *, weights_only: bool, source: str = "arena slot",
              copy: bool = True, index: Optional[Dict[str, Any]] = None) -> Tuple[int, Dict[str, Any]]:
    """Copy a snapshot out of a slot: ``(step, {relative path: object})`` with CPU tensors.

    ``TorchSave`` files come back unpickled (``weights_only``: the trust decision, as ``torch.load``; a plain
    state's skeleton goes through :func:`~snapckpt.formats.skeleton_unpickler.load_plain` first, which loads a
    subset of what ``weights_only=True`` loads, at C speed); ``RawBytes``/``Concat`` files as ``bytes`` (the
    whole file). ``source`` (the slot file) is named in errors. With ``copy=False`` the tensors are views of the
    slot itself (no copy, no fresh memory): for a caller that copies them into live tensors at once and drops
    them before the slot can be reused. ``index``: the slot's index when the caller has read it already
    (:func:`read_index`).
    """
    if index is None:
        index = read_index(buf, source)
    enabled = gc.isenabled()
    gc.disable()  # many small objects are made here: no full collections meanwhile
    try:
        return index["step"], _read_files(buf, slot, index, weights_only, copy)
    finally:
        if enabled:
            gc.enable()


def _read_files(buf, slot: "torch.Tensor", index: Dict[str, Any], weights_only: bool, copy: bool) -> Dict[str, Any]:
    import torch

    from snapckpt.formats.skeleton_unpickler import load_plain
    from snapckpt.formats.torch_zip import unpickle_skeleton

    out: Dict[str, Any] = {}
    for f in index["files"]:
        if f.get("kind", "torch") == "bytes":
            out[f["path"]] = b"".join(bytes(buf[o:o + n]) for o, n in f["chunks"])
            continue
        records = {key: (off, n) for key, off, n in f["records"]}

        made: Dict[str, "torch.UntypedStorage"] = {}  # shared by both unpicklers: each span read once

        def storage(key: str) -> "torch.UntypedStorage":
            st = made.get(key)
            if st is not None:
                return st
            off, n = records[key]
            if not copy:
                st = (torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off) if n
                      else torch.empty(0, dtype=torch.uint8)).untyped_storage()
            else:
                dst = torch.empty(n, dtype=torch.uint8)
                dst.copy_(slot[off:off + n])
                st = dst.untyped_storage()
            made[key] = st
            return st

        po, pn = f["pkl"]
        pkl = bytes(buf[po:po + pn])
        try:
            out[f["path"]] = load_plain(pkl, storage)
        except Exception:  # noqa: BLE001 - not a plain skeleton (or damaged): PyTorch's unpickler decides
            out[f["path"]] = unpickle_skeleton(pkl, {key: storage(key) for key in records},
                                               weights_only=weights_only)
    return out
