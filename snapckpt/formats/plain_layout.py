"""The layout of a *plain* state: its tensors in pickling order, and a key of everything else it pickles.

A plain state holds only tensors (``torch.Tensor`` / ``nn.Parameter``), ``dict`` / ``OrderedDict`` with atomic
keys, lists, tuples and ``str`` / ``int`` / ``float`` / ``bool`` / ``None``; anything else is walked by
pickling it (:func:`snapckpt.formats.torch_zip.collect_tensors`). Two plain states with equal keys
(:func:`plain_layout`) whose tensors have the same plan pickle to the same skeleton, so the Stager pickles it
once per layout, not once per save (a state of 200,000 tensors: seconds per save otherwise).
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["plain_layout"]

_ATOMIC = frozenset({str, int, bool, type(None)})
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_OD = collections.OrderedDict
# markers in a key (never equal to a value of the state: module-private objects)
_T, _ALIAS, _FLOAT, _TDICT = object(), object(), object(), object()


def plain_layout(obj: Any) -> Optional[Tuple[List[torch.Tensor], List[Any]]]:
    """``(tensors, key)`` of a plain ``obj``, or ``None`` when ``obj`` is not plain (or nests deeper than 100).

    ``tensors``: every tensor in pickling order, each once (the order of
    :func:`~snapckpt.formats.torch_zip.collect_tensors`). ``key``: a flat list that equals another state's key
    exactly when that state pickles to the same skeleton given the same tensor layout: container types and
    lengths, keys and atomic values with their types (``True`` and ``1``, ``0.0`` and ``-0.0`` differ), each
    tensor as its index in ``tensors``, and a container met again (pickle's memo) as its first position.
    Tensors are not checked here (their type only: a tensor subclass makes ``obj`` not plain).
    """
    tensors: List[torch.Tensor] = []
    key: List[Any] = []
    ok = _walk(obj, tensors, {}, {}, key, 0)
    return (tensors, key) if ok else None


def _walk(obj: Any, out: List[torch.Tensor], seen: Dict[int, int], containers: Dict[int, int], key: List[Any],
          depth: int) -> bool:
    t = type(obj)
    if t in _ATOMIC:
        key.append(t)
        key.append(obj)
        return True
    if t is float:
        key.append(_FLOAT)
        key.append(obj.hex())  # exact, and -0.0 != 0.0
        return True
    if t in _TENSOR_TYPES:
        i = seen.get(id(obj))
        if i is None:
            i = seen[id(obj)] = len(out)
            out.append(obj)
        key.append(_T)
        key.append(i)
        return True
    if depth > 100 or not (t is dict or t is _OD or t is list or t is tuple):
        return False
    first = containers.get(id(obj))
    if first is not None:  # pickled as a reference to the first occurrence
        key.append(_ALIAS)
        key.append(first)
        return True
    containers[id(obj)] = len(key)
    key.append(t)
    key.append(len(obj))
    if t is list or t is tuple:
        return all(_walk(v, out, seen, containers, key, depth + 1) for v in obj)
    if not (len(obj) > 16 and _tensor_dict(obj, out, seen, key)):  # else walked by C calls
        append = key.append
        for k, v in obj.items():
            tk = type(k)
            if tk is float:
                k = k.hex()
            elif tk not in _ATOMIC:
                return False
            append(tk)
            append(k)
            tv = type(v)
            if tv in _TENSOR_TYPES:  # inline: most entries of a large state are tensors
                i = seen.get(id(v))
                if i is None:
                    i = seen[id(v)] = len(out)
                    out.append(v)
                append(_T)
                append(i)
            elif not _walk(v, out, seen, containers, key, depth + 1):
                return False
    if t is _OD:
        extra = vars(obj)  # the live __dict__ (not a copy: its id must not be reused during the walk)
        if extra:
            key.append(_OD)
            return _walk(extra, out, seen, containers, key, depth + 1)
    return True


def _tensor_dict(obj: dict, out: List[torch.Tensor], seen: Dict[int, int], key: List[Any]) -> bool:
    """Walk ``obj`` without a Python step per entry when its keys are atomic (not float) and its values are
    tensors met nowhere else; ``False`` (nothing appended) otherwise."""
    values = list(obj.values())
    if not set(map(type, values)) <= _TENSOR_TYPES:
        return False
    keys = tuple(obj)
    key_types = set(map(type, keys))
    if not key_types <= _ATOMIC:
        return False
    ids = list(map(id, values))
    if len(set(ids)) != len(ids) or not seen.keys().isdisjoint(ids):
        return False
    start = len(out)
    seen.update(zip(ids, range(start, start + len(ids))))
    out.extend(values)
    key.append(_TDICT)
    key.append(keys)
    key.append(str if key_types == {str} else tuple(map(type, keys)))  # True == 1 as keys: the types differ
    key.append(start)
    return True
