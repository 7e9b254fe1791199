"""The layout of a *plain* state: its tensors in pickling order, and a key of everything else it pickles.

A plain state holds only tensors (``torch.Tensor`` / ``nn.Parameter``), ``dict`` / ``OrderedDict`` with atomic
keys, lists, tuples and ``str`` / ``int`` / ``float`` / ``bool`` / ``None``; anything else is walked by
pickling it (:func:`snapckpt.formats.torch_zip.collect_tensors`). Two plain states with equal keys
(:func:`plain_layout`) whose tensors have the same plan pickle to the same skeleton, so the Stager pickles it
once per layout, not once per save (a state of 200,000 tensors: seconds per save otherwise).
:class:`LayoutMemo` finds a later save's tensors and key without the Python walk while the structure is equal.
"""
from __future__ import annotations

import collections
import operator
import struct
from itertools import chain, islice
from operator import methodcaller
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["plain_layout", "LayoutMemo", "VALUE_MARKERS", "has_repeats"]

_ATOMIC = frozenset({str, int, bool, type(None)})
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_OD = collections.OrderedDict
# markers in a key (never equal to a value of the state: module-private objects)
_T, _ALIAS, _FLOAT, _TDICT = object(), object(), object(), object()
# an atomic value's type in a key, as a marker of its own (a dict key's type is the type itself): the value is the
# item after it, so a key's values can be told from its dict keys (snapckpt.formats.plain_digest hashes their
# types only); _FLOAT marks a float value the same way
_VALUE_TYPE = {t: object() for t in (str, int, bool, type(None))}
VALUE_MARKERS = (*_VALUE_TYPE.values(), _FLOAT)
_PACK_DOUBLE = struct.Struct("<d").pack


def _float_key(x: float) -> str:
    """A float as a key item: its hex (exact, and ``-0.0`` != ``0.0``), or for a NaN its bits (``float.hex`` gives
    ``'nan'`` for every NaN, whose sign and payload pickle keeps)."""
    return x.hex() if x == x else "nan:" + _PACK_DOUBLE(x).hex()


def plain_layout(obj: Any) -> Optional[Tuple[List[torch.Tensor], List[Any]]]:
    """``(tensors, key)`` of a plain ``obj``, or ``None`` when ``obj`` is not plain (or nests deeper than 100).

    ``tensors``: every tensor in pickling order, each once (the order of
    :func:`~snapckpt.formats.torch_zip.collect_tensors`). ``key``: a flat list that equals another state's key
    exactly when that state pickles to the same skeleton given the same tensor layout: container types and
    lengths, keys and atomic values with their types (``True`` and ``1``, ``0.0`` and ``-0.0`` differ), each
    tensor as its index in ``tensors``, and a container met again (pickle's memo) as its first position. Every
    atomic value is the item right after one of :data:`VALUE_MARKERS` (its type's; a dict key follows its type).
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
        key.append(_VALUE_TYPE[t])
        key.append(obj)
        return True
    if t is float:
        key.append(_FLOAT)
        key.append(_float_key(obj))
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
                k = _float_key(k)
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


_VALUES = methodcaller("values")
_CONTAINERS = frozenset({dict, _OD, list, tuple})


class _Level:
    """One breadth-first level of a plain state: its containers and what their entries were."""

    __slots__ = ("types", "lens", "maps", "seqs", "ods", "ktypes", "vtypes", "leaf_pos", "leaves", "float_pos",
                 "float_hex", "cont_pos", "tensor_pos", "all_tensors")


class LayoutMemo:
    """:func:`plain_layout` of one file's state, remembered so that a later save of an equal structure skips the walk.

    The memo holds the structure breadth-first, level by level: container types and lengths, every key and
    atomic value (strong references to those only: never a container nor a tensor of the state) and where
    the containers and tensors sit. :meth:`match` checks a state against it with C-level passes
    (``map``/``chain`` over each level, no Python step per entry) and returns the state's own tensors in
    walking order with the remembered key, or ``None`` (the caller walks again) on any difference: a
    container's type or length, a key, a value or its type (``True`` / ``1``, ``0.0`` / ``-0.0``), a tensor
    where a value was (or the reverse), a container or tensor met twice (aliasing; a memo is not made for
    such states). Tensors are only found here, not checked: a replaced or resized tensor is the plan's
    business (:func:`snapckpt.engine.stager._signature`).

    Attributes:
        order: per tensor in walking order, its position in breadth-first order; ``None`` when the two orders
            are the same (a flat dict of tensors, a model's state: no reordering pass).
    """

    __slots__ = ("levels", "order", "key")

    def __init__(self, levels: List[_Level], order: Optional[List[int]], key: List[Any]) -> None:
        self.levels, self.order, self.key = levels, order, key

    @classmethod
    def build(cls, obj: Any, tensors: List[torch.Tensor], key: List[Any]) -> Optional["LayoutMemo"]:
        """The memo of ``obj`` whose :func:`plain_layout` is ``(tensors, key)``; ``None`` when a container or
        tensor occurs twice in it, or ``obj`` is not a container (a bare value or tensor: nothing to skip)."""
        if type(obj) not in _CONTAINERS:
            return None
        index = {id(t): i for i, t in enumerate(tensors)}
        met: set = set()
        levels: List[_Level] = []
        order: List[int] = []
        cur = [obj]
        while cur:
            lv = _Level()
            met.update(map(id, cur))
            lv.types = tuple(map(type, cur))
            lv.lens = tuple(map(len, cur))
            lv.maps = tuple(i for i, t in enumerate(lv.types) if t is dict or t is _OD)
            lv.seqs = tuple(i for i, t in enumerate(lv.types) if t is list or t is tuple)
            lv.ods = tuple(i for i, t in enumerate(lv.types) if t is _OD)
            keys, vals = _entries(cur, lv)
            lv.ktypes = tuple(map(type, keys))
            lv.vtypes = tuple(map(type, vals))
            lv.leaf_pos = tuple(j for j, t in enumerate(lv.vtypes) if t not in _TENSOR_TYPES and t not in _CONTAINERS)
            lv.cont_pos = tuple(j for j, t in enumerate(lv.vtypes) if t in _CONTAINERS)
            lv.tensor_pos = tuple(j for j, t in enumerate(lv.vtypes) if t in _TENSOR_TYPES)
            lv.all_tensors = len(lv.tensor_pos) == len(vals)
            lv.leaves = keys + [vals[j] for j in lv.leaf_pos]
            lv.float_pos = tuple(j for j, v in enumerate(lv.leaves) if type(v) is float)
            lv.float_hex = [_float_key(lv.leaves[j]) for j in lv.float_pos]
            order.extend(index[id(vals[j])] for j in lv.tensor_pos)
            cur = [vals[j] for j in lv.cont_pos] + [vars(cur[i]) for i in lv.ods]
            if len(met) != sum(len(x.types) for x in levels) + len(lv.types) or not met.isdisjoint(map(id, cur)):
                return None  # a container met twice
            levels.append(lv)
        if len(order) != len(tensors):
            return None  # a tensor met twice
        # order[k] is the walking position of the k-th tensor met breadth-first; match needs the inverse
        walked = [0] * len(order)
        for k, w in enumerate(order):
            walked[w] = k
        return cls(levels, None if walked == list(range(len(walked))) else walked, key)

    def match(self, obj: Any, distinct_tensors: bool = True) -> Optional[List[torch.Tensor]]:
        """``obj``'s tensors in :func:`plain_layout` order when ``plain_layout(obj)`` is ``(those, self.key)``;
        ``None`` when that is not certain (the caller walks ``obj``).

        With ``distinct_tensors=False`` the tensors are not checked for one object met twice: the caller then
        must, before it uses the key (the Stager's quick plan check makes that check anyway), and walk ``obj``
        when one is (the key of such a state marks the repeat)."""
        cur = [obj]
        ids: List[int] = []
        found: List[torch.Tensor] = []
        for lv in self.levels:
            if tuple(map(type, cur)) != lv.types or tuple(map(len, cur)) != lv.lens:
                return None
            keys, vals = _entries(cur, lv)
            if tuple(map(type, vals)) != lv.vtypes or tuple(map(type, keys)) != lv.ktypes:
                return None
            keys.extend(map(vals.__getitem__, lv.leaf_pos))
            if keys != lv.leaves:  # exact types compared above: True == 1 cannot pass
                return None
            if lv.float_pos and list(map(_float_key, map(keys.__getitem__, lv.float_pos))) != lv.float_hex:
                return None  # -0.0 == 0.0
            found.extend(vals if lv.all_tensors else map(vals.__getitem__, lv.tensor_pos))
            ids.extend(map(id, cur))
            nxt = list(map(vals.__getitem__, lv.cont_pos))
            if lv.ods:
                nxt.extend(map(vars, map(cur.__getitem__, lv.ods)))
            cur = nxt
        if _repeats(ids) or (distinct_tensors and has_repeats(found)):
            return None  # a container or a tensor met twice now
        return found if self.order is None else list(map(found.__getitem__, self.order))


def has_repeats(objects: List[Any]) -> bool:
    """Whether an object occurs twice in ``objects`` (by identity)."""
    return _repeats(list(map(id, objects)))


def _repeats(ids: List[int]) -> bool:
    """Whether ``ids`` holds a value twice (sorted: a set of 200,000 object addresses is several times slower)."""
    ids.sort()
    return any(map(operator.eq, ids, islice(ids, 1, None)))


def _entries(cur: List[Any], lv: _Level) -> Tuple[List[Any], List[Any]]:
    """(keys, values) of a level's containers, flat: the mappings' entries first, then the sequences'."""
    maps = list(map(cur.__getitem__, lv.maps))
    keys = list(chain.from_iterable(maps))
    vals = list(chain.from_iterable(map(_VALUES, maps)))
    vals.extend(chain.from_iterable(map(cur.__getitem__, lv.seqs)))
    return keys, vals
