"""The non-tensor values of a plain state that a load replaces, kept apart from the skeleton for a restart's restore.

``Checkpointer.load(state_dict)`` (:func:`~snapckpt.engine.restore.copy_into`) walks the loaded state beside the
live one through dicts: a tensor is copied into the live tensor, a dict is walked, and any other value (an int, a
float, a string, ``None``, a list or tuple, each as a whole) replaces the live one, as a deep copy. The plain
restore of a restarted process (:mod:`snapckpt.engine.plain_restore`) does the same without unpickling the
skeleton: the Stager pickles those values alone, in :func:`entries` order (:func:`pack`, a few bytes per value,
written beside the skeleton in the slot), and the restore sets them into the live state's entries found by the same
walk (:func:`unpack`). The digest that lets a slot through (:mod:`snapckpt.formats.plain_digest`) covers the
structure and the values' types, so both walks meet the same entries in the same order. Aliasing among the values
survives as in the general path (one pickle: a list met twice is one list after either load).
"""
from __future__ import annotations

import collections
import io
import pickle
from itertools import chain
from operator import methodcaller
from typing import Any, List, Optional

import torch

__all__ = ["entries", "pack", "pack_values", "unpack"]

_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_DICT_TYPES = frozenset({dict, collections.OrderedDict})
_VALUES = methodcaller("values")
_MAX_DEPTH = 100  # as plain_layout: deeper (or cyclic) states are left to the general path


def entries(obj: Any, tensors: List[torch.Tensor], dicts: List[dict], keys: List[Any], depth: int = 0) -> bool:
    """Walk ``obj`` as ``copy_into`` walks a loaded state of ``obj``'s structure: append each tensor it copies into
    in place to ``tensors`` (those reached through dicts only: a dict of tensors only, or of such dicts only, by
    C-level passes) and each entry whose value it replaces to ``dicts`` / ``keys`` (``dicts[i][keys[i]]``), in its
    walking order. ``False`` when ``obj`` nests deeper than 100 dicts (a dict that holds itself), with the lists
    partly filled."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return True
    if not isinstance(obj, dict):
        return True
    if depth > _MAX_DEPTH:
        return False
    values = list(obj.values())
    types = set(map(type, values))
    if types <= _TENSOR_TYPES:
        tensors.extend(values)
        return True
    if types <= _DICT_TYPES and depth < _MAX_DEPTH:  # a dict of dicts (an optimizer's state): of tensors only?
        inner = list(chain.from_iterable(map(_VALUES, values)))
        if set(map(type, inner)) <= _TENSOR_TYPES:
            tensors.extend(inner)  # the order of walking each dict in turn
            return True
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, dict):
            if not entries(v, tensors, dicts, keys, depth + 1):
                return False
        else:
            dicts.append(obj)
            keys.append(k)
    return True


def pack(obj: Any) -> Optional[bytes]:
    """The values a load replaces in a state of plain ``obj``'s structure (:func:`entries`), pickled as one list;
    ``None`` when one of them holds a tensor (``copy_into`` replaces a list of tensors by copies: the plain
    restore leaves such states to the general path) or ``obj`` nests too deep."""
    dicts: List[dict] = []
    keys: List[Any] = []
    if not entries(obj, [], dicts, keys):
        return None
    return pack_values([d[k] for d, k in zip(dicts, keys)])


def pack_values(values: List[Any]) -> Optional[bytes]:
    """:func:`pack` of a state whose :func:`entries` values are ``values`` (in that order), found without the walk
    (:meth:`snapckpt.formats.plain_layout.LayoutMemo.match` finds them by their places); ``None`` when one of them
    holds a tensor."""
    if any(map(_holds_tensor, values)):
        return None
    return pickle.dumps(values, protocol=4)


def _holds_tensor(v: Any, depth: int = 0) -> bool:
    """Whether the plain value ``v`` holds a tensor (``True`` too past 100 levels: a container that holds itself)."""
    t = type(v)
    if t in _TENSOR_TYPES or depth > _MAX_DEPTH:
        return True
    if t is list or t is tuple:
        return any(_holds_tensor(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return (any(_holds_tensor(x, depth + 1) for x in v.values())
                or (t is collections.OrderedDict and bool(vars(v)) and _holds_tensor(vars(v), depth + 1)))
    return False


class _Unpickler(pickle.Unpickler):
    """Plain values only: the one global a plain value names is ``collections.OrderedDict``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain value")


def unpack(data: bytes) -> Optional[List[Any]]:
    """The list :func:`pack` pickled into ``data``; ``None`` when ``data`` is not such a list (damaged, or naming
    another global): the caller takes the general path."""
    try:
        values = _Unpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any damage (UnpicklingError, EOFError, ValueError...): the general path
        return None
    return values if type(values) is list else None
