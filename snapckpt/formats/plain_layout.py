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
from collections import deque
from itertools import chain, compress, islice
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


def plain_layout(obj: Any, distinct_tensors: bool = True) -> Optional[Tuple[List[torch.Tensor], List[Any]]]:
    """``(tensors, key)`` of a plain ``obj``, or ``None`` when ``obj`` is not plain (or nests deeper than 100).

    ``tensors``: every tensor in pickling order, each once (the order of
    :func:`~snapckpt.formats.torch_zip.collect_tensors`). ``key``: a flat list that equals another state's key
    exactly when that state pickles to the same skeleton given the same tensor layout: container types and
    lengths, keys and atomic values with their types (``True`` and ``1``, ``0.0`` and ``-0.0`` differ), each
    tensor as its index in ``tensors``, and a container met again (pickle's memo) as its first position. Every
    atomic value is the item right after one of :data:`VALUE_MARKERS` (its type's; a dict key follows its type).
    Tensors are not checked here (their type only: a tensor subclass makes ``obj`` not plain).

    With ``distinct_tensors=False`` the values of a dict of many tensors are not looked up among the tensors met
    elsewhere (a pass over their ids, a set and a dict of them): a tensor object met twice may then be listed twice,
    with a key that is not ``obj``'s. The caller must refuse such tensors before it uses the key (PyTorch's
    ``TensorGuards`` refuse a repeated object; :func:`has_repeats`).
    """
    tensors: List[torch.Tensor] = []
    key: List[Any] = []
    ok = _walk(obj, tensors, {}, {}, key, 0, distinct_tensors)
    return (tensors, key) if ok else None


def _walk(obj: Any, out: List[torch.Tensor], seen: Dict[int, int], containers: Dict[int, int], key: List[Any],
          depth: int, distinct: bool = True) -> bool:
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
        return all(_walk(v, out, seen, containers, key, depth + 1, distinct) for v in obj)
    if not (len(obj) > 16 and _tensor_dict(obj, out, seen, key, distinct)):  # else walked by C calls
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
            elif not _walk(v, out, seen, containers, key, depth + 1, distinct):
                return False
    if t is _OD:
        extra = vars(obj)  # the live __dict__ (not a copy: its id must not be reused during the walk)
        if extra:
            key.append(_OD)
            return _walk(extra, out, seen, containers, key, depth + 1, distinct)
    return True


def _tensor_dict(obj: dict, out: List[torch.Tensor], seen: Dict[int, int], key: List[Any], distinct: bool = True
                 ) -> bool:
    """Walk ``obj`` without a Python step per entry when its keys are atomic (not float) and its values are
    tensors met nowhere else (not checked when not ``distinct``: see :func:`plain_layout`); ``False`` (nothing
    appended) otherwise."""
    values = list(obj.values())
    if not set(map(type, values)) <= _TENSOR_TYPES:
        return False
    keys = tuple(obj)
    key_types = set(map(type, keys))
    if not key_types <= _ATOMIC:
        return False
    start = len(out)
    if distinct:
        ids = list(map(id, values))
        if len(set(ids)) != len(ids) or not seen.keys().isdisjoint(ids):
            return False
        seen.update(zip(ids, range(start, start + len(ids))))
    out.extend(values)
    key.append(_TDICT)
    key.append(keys)
    key.append(str if key_types == {str} else tuple(map(type, keys)))  # True == 1 as keys: the types differ
    key.append(start)
    return True


_VALUES = methodcaller("values")
_CONTAINERS = frozenset({dict, _OD, list, tuple})
_MARKER_IDS = frozenset(map(id, VALUE_MARKERS))


class _Level:
    """One breadth-first level of a plain state: its containers and what their entries were."""

    __slots__ = ("types", "lens", "maps", "seqs", "ods", "ktypes", "vtypes", "keys", "kfloat_pos", "kfloat_hex",
                 "plain_vals", "float_vals", "cont_pos", "tensor_pos", "all_tensors", "replaced")


class LayoutMemo:
    """:func:`plain_layout` of one file's state, remembered so that a later save of an equal structure skips the walk.

    The memo holds the structure breadth-first, level by level: container types and lengths, every key, every
    atomic value's type and its place in the key (strong references to keys and atomic values only: never a
    container nor a tensor of the state) and where the containers and tensors sit. :meth:`match` checks a state
    against it with C-level passes (``map``/``chain`` over each level, no Python step per entry) and returns the
    state's own tensors in walking order with its key (the remembered one with the state's atomic values put in
    place: a step counter or a loss that changes every save still matches), or ``None`` (the caller walks
    again) on any difference of structure: a container's type or length, a key, a value's type (``True`` /
    ``1``, ``1`` / ``1.0``, a ``str`` subclass), a tensor where a value was (or the reverse), a container or
    tensor met twice (aliasing; a memo is not made for such states). Tensors are only found here, not checked:
    a replaced or resized tensor is the plan's business (:func:`snapckpt.engine.layout_check.signature`).

    Attributes:
        order: per tensor in walking order, its position in breadth-first order; ``None`` when the two orders
            are the same (a flat dict of tensors, a model's state: no reordering pass).
        value_at: the key position of each atomic value's item, in the order :meth:`match` meets them (per level:
            the non-float values, then the floats).
        items: those items of ``key`` (a float's as :func:`_float_key`), to tell an unchanged state cheaply.
        replaced_order: per value of an entry reached from the top through mappings only that is neither a
            tensor nor a mapping (the values a load replaces, :func:`snapckpt.engine.plain_values.entries`), in
            depth-first order, its position in the order :meth:`match` meets them; ``None`` when the two orders
            are the same.
    """

    __slots__ = ("levels", "order", "key", "value_at", "items", "replaced_order")

    def __init__(self, levels: List[_Level], order: Optional[List[int]], key: List[Any], value_at: Tuple[int, ...],
                 items: List[Any], replaced_order: Optional[List[int]] = None) -> None:
        self.levels, self.order, self.key, self.value_at, self.items = levels, order, key, value_at, items
        self.replaced_order = replaced_order

    @classmethod
    def build(cls, obj: Any, tensors: List[torch.Tensor], key: List[Any]) -> Optional["LayoutMemo"]:
        """The memo of ``obj`` whose :func:`plain_layout` is ``(tensors, key)``; ``None`` when ``obj`` is not a
        container, a container or tensor occurs twice in it, or its values are not found in ``key`` where and as
        expected (the walk is then kept)."""
        if type(obj) not in _CONTAINERS:
            return None
        index = {id(t): i for i, t in enumerate(tensors)}
        met: set = set()
        levels: List[_Level] = []
        order: List[int] = []
        owners: List[List[Tuple[int, int]]] = []  # per level, per entry: (id of its container, its index there)
        replaced_no: Dict[Tuple[int, int], int] = {}  # (id of a mapping, entry index) -> depth-first number
        _number_replaced(obj, replaced_no, 0)
        replaced: List[int] = []  # those numbers in match's order
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
            owners.append([(id(cur[i]), j) for i in lv.maps + lv.seqs for j in range(len(cur[i]))])
            lv.replaced = tuple(j for j, o in enumerate(owners[-1]) if o in replaced_no)
            replaced.extend(replaced_no[owners[-1][j]] for j in lv.replaced)
            lv.ktypes = tuple(map(type, keys))
            lv.vtypes = tuple(map(type, vals))
            leaf_pos = [j for j, t in enumerate(lv.vtypes) if t not in _TENSOR_TYPES and t not in _CONTAINERS]
            lv.plain_vals = tuple(j for j in leaf_pos if lv.vtypes[j] is not float)
            lv.float_vals = tuple(j for j in leaf_pos if lv.vtypes[j] is float)
            lv.cont_pos = tuple(j for j, t in enumerate(lv.vtypes) if t in _CONTAINERS)
            lv.tensor_pos = tuple(j for j, t in enumerate(lv.vtypes) if t in _TENSOR_TYPES)
            lv.all_tensors = len(lv.tensor_pos) == len(vals)
            lv.keys = keys
            lv.kfloat_pos = tuple(j for j, k in enumerate(keys) if type(k) is float)
            lv.kfloat_hex = [_float_key(keys[j]) for j in lv.kfloat_pos]
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
        value_at = _value_places(obj, key, levels, owners)
        if value_at is None or len(replaced) != len(replaced_no):
            return None
        replaced_order = [0] * len(replaced)  # the inverse, as for order
        for k, no in enumerate(replaced):
            replaced_order[no] = k
        return cls(levels, None if walked == list(range(len(walked))) else walked, key, value_at,
                   list(map(key.__getitem__, value_at)),
                   None if replaced_order == list(range(len(replaced))) else replaced_order)

    def match(self, obj: Any, distinct_tensors: bool = True, replaced: Optional[List[Any]] = None
              ) -> Optional[Tuple[List[torch.Tensor], List[Any]]]:
        """``plain_layout(obj)`` (its tensors and key) when ``obj`` has the memo's structure; ``None`` when that is
        not certain (the caller walks ``obj``). The key is the memo's own ``key`` when the values are its too.

        With ``distinct_tensors=False`` the tensors are not checked for one object met twice: the caller then
        must, before it uses the key (the Stager's quick plan check makes that check anyway), and walk ``obj``
        when one is (the key of such a state marks the repeat).

        ``replaced``: when given and ``obj`` matches, ``obj``'s values that a load replaces are appended to it, as
        :func:`snapckpt.engine.plain_values.entries` finds them (see :attr:`replaced_order`), without its walk."""
        cur = [obj]
        ids: List[int] = []
        found: List[torch.Tensor] = []
        items: List[Any] = []
        values: List[Any] = []
        for lv in self.levels:
            if tuple(map(type, cur)) != lv.types or tuple(map(len, cur)) != lv.lens:
                return None
            keys, vals = _entries(cur, lv)
            # exact types: True / 1, 1 / 1.0 and subclasses cannot pass (nor can True == 1 as keys below)
            if tuple(map(type, vals)) != lv.vtypes or tuple(map(type, keys)) != lv.ktypes:
                return None
            if keys != lv.keys:
                return None
            if lv.kfloat_pos and list(map(_float_key, map(keys.__getitem__, lv.kfloat_pos))) != lv.kfloat_hex:
                return None  # -0.0 == 0.0
            items.extend(map(vals.__getitem__, lv.plain_vals))
            if lv.float_vals:
                items.extend(map(_float_key, map(vals.__getitem__, lv.float_vals)))
            found.extend(vals if lv.all_tensors else map(vals.__getitem__, lv.tensor_pos))
            if lv.replaced and replaced is not None:
                values.extend(map(vals.__getitem__, lv.replaced))
            ids.extend(map(id, cur))
            nxt = list(map(vals.__getitem__, lv.cont_pos))
            if lv.ods:
                nxt.extend(map(vars, map(cur.__getitem__, lv.ods)))
            cur = nxt
        if _repeats(ids) or (distinct_tensors and has_repeats(found)):
            return None  # a container or a tensor met twice now
        key = self.key
        if items != self.items:  # the same types at each place: equal items are equal key items
            key = key.copy()
            deque(map(key.__setitem__, self.value_at, items), maxlen=0)
        if replaced is not None:
            replaced.extend(values if self.replaced_order is None else map(values.__getitem__, self.replaced_order))
        return (found if self.order is None else list(map(found.__getitem__, self.order))), key


def _value_places(obj: Any, key: List[Any], levels: List[_Level], owners: List[List[Tuple[int, int]]]
                  ) -> Optional[Tuple[int, ...]]:
    """The key position of each atomic value of ``obj`` (a container met once each) in :meth:`LayoutMemo.match`'s
    order, or ``None`` when the key's values are not ``obj``'s in walking order (then no memo)."""
    walk_no: Dict[Tuple[int, int], int] = {}  # (id of a container, entry index) -> its value's walking number
    _number_values(obj, walk_no)
    # the items right after a marker (C-level passes: a key may hold millions of items)
    places = list(compress(range(1, len(key)), map(_MARKER_IDS.__contains__, map(id, islice(key, len(key) - 1)))))
    if len(places) != len(walk_no):
        return None
    value_at: List[int] = []
    cur = [obj]
    for lv, own in zip(levels, owners):
        _, vals = _entries(cur, lv)
        for group in (lv.plain_vals, lv.float_vals):
            for j in group:
                p = places[walk_no[own[j]]]
                v = vals[j]
                if key[p - 1] is not (_FLOAT if type(v) is float else _VALUE_TYPE[type(v)]):
                    return None
                item = _float_key(v) if type(v) is float else v
                if type(key[p]) is not type(item) or key[p] != item:
                    return None
                value_at.append(p)
        cur = [vals[j] for j in lv.cont_pos] + [vars(cur[i]) for i in lv.ods]
    return tuple(value_at)


def _number_values(obj: Any, walk_no: Dict[Tuple[int, int], int]) -> None:
    """Number ``obj``'s atomic values in :func:`plain_layout`'s order (a mapping's values, then an
    ``OrderedDict``'s attributes; a sequence's items), each by its container's id and index there."""
    for j, v in enumerate(obj if type(obj) is list or type(obj) is tuple else obj.values()):
        t = type(v)
        if t in _CONTAINERS:
            _number_values(v, walk_no)
        elif t not in _TENSOR_TYPES:
            walk_no[(id(obj), j)] = len(walk_no)
    if type(obj) is _OD and vars(obj):
        _number_values(vars(obj), walk_no)


def _number_replaced(obj: Any, numbers: Dict[Tuple[int, int], int], depth: int) -> None:
    """Number the entries of ``obj`` reached from it through mappings only whose values are neither tensors nor
    mappings, depth-first in entry order (:func:`snapckpt.engine.plain_values.entries`: the values a load
    replaces), each by its mapping's id and index there; an ``OrderedDict``'s attributes are not entries."""
    if (type(obj) is not dict and type(obj) is not _OD) or depth > 100:
        return
    for j, v in enumerate(obj.values()):
        t = type(v)
        if t is dict or t is _OD:
            _number_replaced(v, numbers, depth + 1)
        elif t not in _TENSOR_TYPES:
            numbers[(id(obj), j)] = len(numbers)


def has_repeats(objects: List[Any]) -> bool:
    """Whether an object occurs twice in ``objects`` (by identity)."""
    return _repeats(list(map(id, objects)))


def _repeats(ids: List[int]) -> bool:
    """Whether ``ids`` holds a value twice (sorted: a set of 200,000 object addresses is several times slower)."""
    ids.sort()
    return any(map(operator.eq, ids, islice(ids, 1, None)))


def _entries(cur: List[Any], lv: _Level) -> Tuple[List[Any], List[Any]]:
    """(keys, values) of a level's containers, flat: the mappings' entries first, then the sequences'."""
    maps = cur if len(lv.maps) == len(cur) else list(map(cur.__getitem__, lv.maps))  # all mappings: in order
    keys = list(chain.from_iterable(maps))
    # dict.values is twice as fast as a method call per mapping (thousands of optimizer-state dicts); not for an
    # OrderedDict, whose order is its own (move_to_end), not its dict's
    vals = list(chain.from_iterable(map(_VALUES if lv.ods else dict.values, maps)))
    vals.extend(chain.from_iterable(map(cur.__getitem__, lv.seqs)))
    return keys, vals
