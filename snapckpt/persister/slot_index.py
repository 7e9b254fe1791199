"""Reading a slot's contents: the header and JSON index the Stager wrote, and the snapshot itself.

A slot holds a fixed header (:mod:`snapckpt.persister.arena`), the storage spans, the pickled skeletons
and a JSON index of them. :func:`read_index` is what the persister reads before writing a slot's files
(never a pickle); :func:`read_slot` is the memory-tier load of a training rank (the reverse of
:meth:`snapckpt.engine.stager.Stager.copy_into`).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Dict, Tuple

from snapckpt.errors import SnapshotError
from snapckpt.persister.arena import read_header

if TYPE_CHECKING:
    import torch

__all__ = ["read_index", "read_slot"]


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


def read_slot(buf, slot: "torch.Tensor", *, weights_only: bool, source: str = "arena slot",
              copy: bool = True) -> Tuple[int, Dict[str, Any]]:
    """Copy a snapshot out of a slot: ``(step, {relative path: object})`` with CPU tensors.

    ``TorchSave`` files come back unpickled (``weights_only``: the trust decision, as ``torch.load``);
    ``RawBytes``/``Concat`` files as ``bytes`` (the whole file). ``source`` (the slot file) is named in errors.
    With ``copy=False`` the tensors are views of the slot itself (no copy, no fresh memory): for a caller
    that copies them into live tensors at once and drops them before the slot can be reused.
    """
    import torch  # here, not at module level: the persister imports this module and starts without torch

    from snapckpt.formats.torch_zip import unpickle_skeleton

    index = read_index(buf, source)
    out: Dict[str, Any] = {}
    for f in index["files"]:
        if f.get("kind", "torch") == "bytes":
            out[f["path"]] = b"".join(bytes(buf[o:o + n]) for o, n in f["chunks"])
            continue
        storages = {}
        for key, off, n in f["records"]:
            if not copy:
                storages[key] = (torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off) if n
                                 else torch.empty(0, dtype=torch.uint8)).untyped_storage()
                continue
            dst = torch.empty(n, dtype=torch.uint8)
            dst.copy_(slot[off:off + n])
            storages[key] = dst.untyped_storage()
        po, pn = f["pkl"]
        out[f["path"]] = unpickle_skeleton(bytes(buf[po:po + pn]), storages, weights_only=weights_only)
    return index["step"], out
