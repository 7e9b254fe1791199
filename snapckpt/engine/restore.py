"""Restore: the last hop of a load, from the files read back into the caller's live state.

``Checkpointer.load(state_dict)`` reads a rank's files (:mod:`snapckpt.engine.loader`) and hands them to
:func:`copy_into`, which checks every tensor's shape first, then copies in place. :func:`check_step` is
the one validation of a step number, used by save and load alike (and by the integrations).
"""
from __future__ import annotations

import copy
import gc
from operator import attrgetter, ne
from typing import AbstractSet, Any, Iterator, List, Optional, Tuple

import torch

from snapckpt.errors import IncompatibleCheckpointError

__all__ = ["MAX_STEP", "check_shapes", "check_step", "copy_into", "copied_in_place", "pairs", "refuse_inference"]

_SHAPE = attrgetter("shape")
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_EXACT_TENSOR_TYPES = frozenset(_TENSOR_TYPES)
_MISSING = object()
MAX_STEP = 2**63 - 1  # steps are signed 64-bit integers in the arena's slot header


def refuse_inference() -> None:
    """Raise what torch's ``copy_`` into a tensor made under ``torch.inference_mode()`` raises outside it, for the
    restores that write live tensors by their addresses (``preadv``, ``memmove``: past torch's check), before they
    write anything (torch's own ``copy_`` writes the tensor, then raises).

    Raises:
        RuntimeError: always.
    """
    raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed: the live state "
                       "holds tensors made under torch.inference_mode(); load inside torch.inference_mode(), or "
                       "clone them into normal tensors first (snapckpt wrote nothing into them)")


def check_step(step: Any, what: str = "step") -> None:
    """``ValueError`` unless ``step`` is an ``int`` in ``[0, 2**63 - 1]`` (not a bool, float or string);
    ``what`` names it in the message (``"iteration"`` for Megatron)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"{what} must be an int in [0, 2**63 - 1], got {step!r} ({type(step).__name__})")


def check_shapes(dst: Any, src: Any, path: str = "") -> None:
    """Raise :class:`IncompatibleCheckpointError` naming every tensor (up to 10) whose shape in ``src``
    differs from ``dst``'s at the same key (what :func:`copy_into` checks before it copies anything)."""
    bad: List[str] = []
    _shape_mismatches(dst, src, path, bad)
    if bad:
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise IncompatibleCheckpointError(
            f"{len(bad)} tensor(s) of the checkpoint do not fit the live state (nothing was copied):\n  "
            + "\n  ".join(bad[:10]) + more
            + "\nload into a model built with the checkpoint's configuration, or load without a state_dict "
              "(ckpt.load()) to inspect what was saved")


def pairs(dst: Any, src: Any) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(live tensor, loaded tensor)`` for every tensor :func:`copy_into` would copy, in its order."""
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            if k in dst:
                yield from pairs(dst[k], v)
    elif isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        yield dst, src


def copied_in_place(obj: Any, out: List[torch.Tensor]) -> None:
    """Append the tensors of ``obj`` that :func:`copy_into` copies into in place when the loaded state has ``obj``'s
    structure: those reached through dicts only (one in a list or tuple is replaced by a copy), in its walking order
    (a dict of tensors only by one C-level pass). A function of ``obj``'s structure only: the containers' types and
    keys and where the tensors are."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        values = list(obj.values())
        if set(map(type, values)) <= _EXACT_TENSOR_TYPES:
            out.extend(values)
            return
        for v in values:
            if isinstance(v, (dict, torch.Tensor)):
                copied_in_place(v, out)


def copy_into(dst: Any, src: Any, path: str = "", own: bool = False, skip: AbstractSet[int] = frozenset()) -> Any:
    """Copy ``src`` into ``dst`` in place where both hold tensors at the same key; return ``dst``.

    Tensors are copied with ``Tensor.copy_`` (so dtype and device follow ``dst``, as
    ``load_state_dict`` does); other values replace ``dst``'s (deep copies of them with ``own``: ``src``
    then views memory that is not the caller's, an arena slot; one deep-copy memo for the whole call
    keeps tensors that share storage sharing it). Every shape is checked before anything is copied, so a
    refused load leaves ``dst`` as it was.

    Args:
        dst: the live state (nested dicts of tensors and values), changed in place.
        src: what was loaded, of the same nesting.
        path: key path of ``dst`` inside the whole state, for messages (``""`` at the top).
        own: deep-copy the values taken from ``src`` (``src`` views an arena slot or a memory-mapped file).
        skip: ``id()`` of live tensors already holding their bytes (read straight into them from disk by
            :mod:`snapckpt.engine.disk_restore`): not copied again.

    Raises:
        IncompatibleCheckpointError: some tensor's shape differs (names every such key path, up to 10).
    """
    dsts: List[torch.Tensor] = []
    srcs: List[torch.Tensor] = []
    sets: List[Tuple[dict, Any, Any]] = []
    enabled = gc.isenabled()
    gc.disable()  # a state of many tensors: no full collections while its pairs are gathered
    try:
        _gather(dst, src, dsts, srcs, sets)
    finally:
        if enabled:
            gc.enable()
    if any(map(ne, map(_SHAPE, dsts), map(_SHAPE, srcs))):
        check_shapes(dst, src, path)  # raises, naming the key paths; nothing changed yet
    memo: Optional[dict] = {} if own else None
    for d, k, v in sets:
        d[k] = copy.deepcopy(v, memo) if own else v
    if skip:
        kept = [i for i, t in enumerate(dsts) if id(t) not in skip]
        dsts, srcs = [dsts[i] for i in kept], [srcs[i] for i in kept]
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)  # one call: per tensor as Tensor.copy_ (dtype and device follow dst)
    both = (isinstance(dst, dict) and isinstance(src, dict)) or (isinstance(dst, torch.Tensor)
                                                                  and isinstance(src, torch.Tensor))
    return dst if both else (copy.deepcopy(src, memo) if own else src)


def _shape_mismatches(dst: Any, src: Any, path: str, out: List[str]) -> None:
    """Append ``"<key path>: checkpoint shape (..) != live shape (..)"`` for every tensor ``copy_into``
    would copy with another shape."""
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            if k in dst:
                _shape_mismatches(dst[k], v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape != src.shape:
        out.append(f"{path or 'tensor'}: checkpoint shape {tuple(src.shape)} != live shape {tuple(dst.shape)}")


def _gather(dst: Any, src: Any, dsts: List[torch.Tensor], srcs: List[torch.Tensor],
            sets: List[Tuple[dict, Any, Any]]) -> None:
    """Walk ``dst`` and ``src`` as :func:`copy_into` does, changing nothing: the tensor pairs to copy go to
    ``dsts`` / ``srcs``, the values to replace to ``sets`` as ``(dict, key, value from src)``, in walk order."""
    if not (isinstance(dst, dict) and isinstance(src, dict)):
        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
            dsts.append(dst)
            srcs.append(src)
        return
    for k, v in src.items():
        d = dst.get(k, _MISSING)
        if d is not _MISSING and type(v) in _TENSOR_TYPES and isinstance(d, torch.Tensor):
            dsts.append(d)
            srcs.append(v)
        elif d is not _MISSING and ((isinstance(d, dict) and isinstance(v, dict))
                                    or (isinstance(d, torch.Tensor) and isinstance(v, torch.Tensor))):
            _gather(d, v, dsts, srcs, sets)
        else:
            sets.append((dst, k, v))
