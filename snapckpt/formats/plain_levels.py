"""A plain state's structure breadth-first, a level per pass: what a restarted process hashes and restores by.

The plain restore of a restarted process (:mod:`snapckpt.engine.plain_restore`) hashes a description of its live
state's structure (:mod:`snapckpt.formats.plain_digest`) and compares it with the digest the saving process wrote. A
depth-first walk costs a Python step per container (a GPT state's optimizer holds a small dict per parameter: 7,000
containers, 10 ms, and a key of 80,000 items that took another 20 ms to hash); :func:`walk` reads the state a level
at a time, with C-level passes (``map``/``chain``/``compress`` over all the level's containers and entries) and
bytes that hash without a Python step per item. (The tensors and the replaced entries in walking order come from
:func:`snapckpt.engine.plain_values.entries`, which walks the mappings only, leaf mappings by C calls.)

The structure of each level (:attr:`Levels.structure`): the containers' types and lengths, the mappings' keys (their
types, and their ``repr``; a float key as its hex, as :mod:`~snapckpt.formats.plain_layout` writes it) and each
entry's type (a tensor, one of the containers, or an atomic value's type: the values themselves are not in it).
Level ``i + 1`` holds the containers among level ``i``'s entries in entry order (the mappings' entries, then the
sequences'), then each ``OrderedDict``'s attribute dict: with every container met once, equal descriptions are
equal trees. ``None`` for anything else: a top that is not a ``dict`` / ``OrderedDict``, a type that is not plain,
deeper than 100 levels. A container met again (the skeleton's memo: a list held at two keys) is an entry of its own
code with the number of its first occurrence, and is not walked again.
"""
from __future__ import annotations

import collections
import struct
from array import array
from itertools import chain, compress
from operator import methodcaller
from typing import Any, List, Optional, Tuple

import torch

from snapckpt.formats.plain_layout import _float_key

__all__ = ["Levels", "walk"]

_OD = collections.OrderedDict
# a type's code in the description; a Parameter is a tensor (the restore copies bytes into either)
_CODES = {dict: 1, _OD: 2, list: 3, tuple: 4, torch.Tensor: 5, torch.nn.Parameter: 5, str: 6, int: 7, bool: 8,
          type(None): 9, float: 10}
_KEY_TYPES = frozenset({str, int, bool, type(None), float})
_TENSOR = 5
_ALIAS, _MAP_ALIAS = 11, 12  # an entry holding a list / tuple, a mapping, met before (the skeleton's memo)
_IS_MAP = (3).__gt__  # codes 1, 2
_IS_SEQ = frozenset({3, 4}).__contains__
_IS_OD = (2).__eq__
_IS_CONTAINER = (5).__gt__  # codes 1-4
_CONTAINER_TYPES = frozenset({dict, _OD, list, tuple})
_FEW = 64  # containers in a level read one by one (more: the level in one pass)
_MAX_LEVELS = 101  # as plain_layout: a state nested deeper (or a container holding itself) is not plain
_VALUES = methodcaller("values")
_LEN = struct.Struct("<q").pack


class Levels:
    """What :func:`walk` found: ``structure``, the levels' descriptions as one ``bytes`` (length-prefixed parts, see
    the module), and ``n_tensors``, how many tensor entries the state holds (a tensor at two places counts twice)."""

    __slots__ = ("structure", "n_tensors")

    def __init__(self, structure: bytes, n_tensors: int) -> None:
        self.structure, self.n_tensors = structure, n_tensors


def walk(obj: Any) -> Optional[Levels]:
    """The :class:`Levels` of plain ``obj``, or ``None`` (see the module)."""
    if type(obj) is not dict and type(obj) is not _OD:
        return None
    parts: List[bytes] = []
    seen = {id(obj): 0}  # each container's number, in the order first met
    cur: List[Any] = [obj]
    n_tensors = 0
    for _ in range(_MAX_LEVELS):
        ct = bytes(map(_CODES.__getitem__, map(type, cur)))  # only containers are queued
        maps = list(compress(cur, map(_IS_MAP, ct)))
        keys = list(chain.from_iterable(maps))
        vals, vc, nxt = _entries(maps, list(compress(cur, map(_IS_SEQ, ct))))
        key_types = set(map(type, keys))
        if vc is None or not key_types <= _KEY_TYPES:
            return None  # a value or a key of a type that is not plain
        ids = list(map(id, nxt))
        aliases = b""
        if seen.keys().isdisjoint(ids) and len(set(ids)) == len(ids):
            seen.update(zip(ids, range(len(seen), len(seen) + len(ids))))
        else:
            nxt, vc, aliases = _aliases(vals, vc, seen)
        parts += [ct, array("q", map(len, cur)).tobytes(), _codes(keys, key_types), _keys_bytes(keys, key_types), vc,
                  aliases]
        n_tensors += vc.count(_TENSOR)
        attrs = list(map(vars, compress(cur, map(_IS_OD, ct))))
        seen.update(zip(map(id, attrs), range(len(seen), len(seen) + len(attrs))))
        nxt.extend(attrs)
        if not nxt:
            return Levels(b"".join(chain.from_iterable((_LEN(len(p)), p) for p in parts)), n_tensors)
        cur = nxt
    return None  # deeper than 100 levels


def _entries(maps: List[Any], seqs: List[Any]) -> Tuple[List[Any], Optional[bytes], List[Any]]:
    """``(values, their codes, the containers among them)`` of a level's mappings, then its sequences; codes ``None``
    when a value is of no plain type. A level of few containers (a flat dict of many tensors beside a few small
    ones) is read container by container: one type in a container needs no step per value for its codes."""
    vals = list(chain.from_iterable(map(_VALUES, maps)))
    vals.extend(chain.from_iterable(seqs))
    if len(maps) + len(seqs) > _FEW:
        types = set(map(type, vals))
        vc = _codes(vals, types)
        if vc is None or types.isdisjoint(_CONTAINER_TYPES):
            return vals, vc, []
        return vals, vc, list(compress(vals, map(_IS_CONTAINER, vc)))
    pieces: List[bytes] = []
    nxt: List[Any] = []
    for c in chain(maps, seqs):
        vs = c.values() if type(c) is dict or type(c) is _OD else c
        types = set(map(type, vs))
        code = _codes(vs, types)
        if code is None:
            return vals, None, []
        pieces.append(code)
        if not types.isdisjoint(_CONTAINER_TYPES):
            nxt.extend(compress(vs, map(_IS_CONTAINER, code)))
    return vals, b"".join(pieces), nxt


def _codes(items: Any, types: set) -> Optional[bytes]:
    """Each item's type code (:data:`_CODES`), or ``None`` when one is of no plain type. ``types``: the items' types
    (one type: no step per item)."""
    try:
        if len(types) == 1:
            return bytes((_CODES[next(iter(types))],)) * len(items)
        return bytes(map(_CODES.__getitem__, map(type, items)))
    except KeyError:
        return None


def _keys_bytes(keys: List[Any], types: set) -> bytes:
    """The mappings' keys of a level, told apart with their types (:func:`_codes`): ``"\\0"``-joined when they are
    strings without a NUL (a ``j`` first), else their ``repr`` (an ``r`` first; a float as its hex; where an int is
    too long for ``repr``, each int as its hex, an ``h`` first)."""
    if types == {str}:
        joined = "\0".join(keys)
        if joined.count("\0") == len(keys) - 1:
            return b"j" + joined.encode("utf-8", "surrogatepass")
    if float in types:
        keys = [_float_key(k) if type(k) is float else k for k in keys]
    try:
        return b"r" + repr(keys).encode()
    except ValueError:  # an int key of more digits than Python converts (4,300): its hex (an ``h`` first)
        return b"h" + repr([hex(k) if type(k) is int else k for k in keys]).encode()


def _aliases(vals: List[Any], codes: bytes, seen: dict) -> Tuple[List[Any], bytes, bytes]:
    """A level whose containers include one met before (in ``seen``, or earlier in ``vals``): ``(the containers met
    first here, the codes with each repeat's code :data:`_ALIAS` or :data:`_MAP_ALIAS` (a mapping), the repeats'
    (entry index, number of the container) pairs as int64 bytes)``; ``seen`` takes the new ones."""
    out = bytearray(codes)
    first: List[Any] = []
    refs = array("q")
    for j, v in enumerate(vals):
        if out[j] < _TENSOR:
            no = seen.get(id(v))
            if no is None:
                seen[id(v)] = len(seen)
                first.append(v)
            else:
                refs.extend((j, no))
                out[j] = _MAP_ALIAS if out[j] < 3 else _ALIAS
    return first, bytes(out), refs.tobytes()
