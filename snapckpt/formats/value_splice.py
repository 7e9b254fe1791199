"""A plain file's skeleton with its non-tensor values spliced in, so that a save whose values alone changed
(a step counter, a learning rate, a loss) does not pickle the whole state again.

A training loop's state changes a few scalars every save; pickling the skeleton of 200,000 tensors again for them
costs seconds. :class:`ValueTemplate` pickles the state once with every atomic value (``str`` / ``int`` / ``float``
/ ``bool`` / ``None``, in :func:`~snapckpt.formats.plain_layout.plain_layout` key order) replaced by a marker float
(a NaN whose bits name the value's index: a ``BINFLOAT`` opcode, which pickle never memoizes), finds the markers'
bytes, and keeps the bytes between them. :meth:`ValueTemplate.splice` puts each value's own opcode (no memo entry:
``BINUNICODE`` without ``BINPUT`` for a string) where its marker was. Neither a marker nor a spliced value touches
pickle's memo, so every memo index of the template stays right whatever the values: the result unpickles (stock,
``weights_only`` too) to the state with the new values. It differs from a fresh pickle's bytes only in that a
string value is written in full each time (a fresh pickle may refer back to an equal string object met before).

States in which a container is met twice (pickle's memo makes one object of it; the copy made here would make
two) get no template. Values are read from the key (:func:`values`), where a float is its exact hex or NaN bits.
"""
from __future__ import annotations

import collections
import pickle
import struct
from itertools import chain, compress
from operator import not_
from typing import Any, Callable, List, Optional, Tuple

import torch

from snapckpt.formats import plain_layout as _pl

__all__ = ["ValueTemplate", "split_key", "encode"]

_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_LEAVES = frozenset({str, int, float, bool, type(None)})
_OD = collections.OrderedDict
_MARKER_IDS = frozenset(map(id, _pl.VALUE_MARKERS))
_FLOAT_ID = id(_pl._FLOAT)  # noqa: SLF001 - the float marker: its item is a hex string, not the float
_STR_ID, _NONE_ID = id(_pl._VALUE_TYPE[str]), id(_pl._VALUE_TYPE[type(None)])  # noqa: SLF001
_BOOL_ID = id(_pl._VALUE_TYPE[bool])  # noqa: SLF001
# The markers: quiet NaNs 0x7ffa5ac3_xxxxxxxx (x: the value's index), pickled as b"G" + their 8 big-endian bytes.
_MAGIC = b"\x7f\xfa\x5a\xc3"
_OPCODE = b"G" + _MAGIC
_BE_DOUBLE = struct.Struct(">d")
_LEN = struct.Struct("<I")


def split_key(key: List[Any]) -> Tuple[List[Any], List[Any]]:
    """``(structure, values)`` of a :func:`plain_layout` key: the key without its atomic values (each value's
    marker stays, so a value's type is part of the structure), and those values' key items in order, each
    preceded by its marker's id. C-level passes, no Python step per item."""
    after_marker = list(chain((False,), map(_MARKER_IDS.__contains__, map(id, key))))[:len(key)]
    markers = list(map(id, compress(chain((None,), key), after_marker)))
    return list(compress(key, map(not_, after_marker))), list(zip(markers, compress(key, after_marker)))


def encode(marker_id: int, item: Any) -> bytes:
    """The pickle opcode of one value (``(marker id, key item)`` of :func:`split_key`), without a memo entry."""
    if marker_id == _FLOAT_ID:
        if item.startswith("nan:"):  # plain_layout's NaN: its little-endian bits
            return b"G" + bytes.fromhex(item[4:])[::-1]
        return b"G" + _BE_DOUBLE.pack(float.fromhex(item))
    if marker_id == _STR_ID:
        data = item.encode("utf-8", "surrogatepass")  # as pickle's BINUNICODE
        return b"X" + _LEN.pack(len(data)) + data
    if marker_id == _NONE_ID:
        return b"N"
    if marker_id == _BOOL_ID:
        return b"\x88" if item else b"\x89"
    return pickle.dumps(item, protocol=2)[2:-1]  # an int: BININT1/2, BININT or LONG1, never memoized


class ValueTemplate:
    """The bytes of a plain file's pickle around its atomic values (see the module docstring)."""

    __slots__ = ("pieces", "keys")

    def __init__(self, pieces: List[bytes], keys: List[str]) -> None:
        self.pieces, self.keys = pieces, keys

    @classmethod
    def build(cls, obj: Any, key: List[Any], pickle_fn: Callable[[Any], Tuple[bytes, List[str]]]
              ) -> Optional["ValueTemplate"]:
        """The template of plain ``obj`` whose :func:`plain_layout` key is ``key``; ``pickle_fn`` pickles a state
        (``(bytes, span keys)``, :func:`snapckpt.formats.torch_zip.pickle_skeleton` with the file's tensor refs).
        ``None`` when a container is met twice in ``obj`` or the markers' bytes are not found exactly once each,
        in order, and nowhere else (a float dict key of a marker's bits, an int key whose bytes hold a marker's
        opcode: the byte ``0xfa`` never occurs in a string's UTF-8, so a key string cannot hold one)."""
        if _pl._ALIAS in key:  # noqa: SLF001 - a container met twice: the copy would pickle it twice
            return None
        count = [0]
        shadow = _shadow(obj, count, 0)
        if shadow is None or count[0] >= 1 << 32:
            return None
        pkl, skeys = pickle_fn(shadow)
        # Every marker's opcode is there; one more occurrence (inside an int key's LONG1 bytes, where it may even
        # end inside the real marker after it and so read as that marker) gives no template. The 5 bytes cannot
        # overlap themselves, so count() finds every occurrence.
        if pkl.count(_OPCODE) != count[0]:
            return None
        pieces: List[bytes] = []
        pos = 0
        for i in range(count[0]):
            at = pkl.find(_OPCODE, pos)
            if at < 0 or pkl[at + 5:at + 9] != i.to_bytes(4, "big"):
                return None  # the marker bytes occur elsewhere (inside a string): no template
            pieces.append(pkl[pos:at])
            pos = at + 9
        if pkl.find(_OPCODE, pos) >= 0:
            return None
        pieces.append(pkl[pos:])
        return cls(pieces, skeys)

    def splice(self, values: List[Tuple[int, Any]]) -> bytes:
        """The pickle of the template's structure with ``values`` (:func:`split_key`'s, one per marker)."""
        if len(values) != len(self.pieces) - 1:
            raise ValueError(f"{len(values)} values for a template of {len(self.pieces) - 1}")
        ops = [encode(m, v) for m, v in values]
        out = [self.pieces[0]]
        for op, piece in zip(ops, self.pieces[1:]):
            out.append(op)
            out.append(piece)
        return b"".join(out)


def _marker(i: int) -> float:
    return _BE_DOUBLE.unpack(_MAGIC + i.to_bytes(4, "big"))[0]


def _shadow(obj: Any, count: List[int], depth: int) -> Any:
    """A copy of plain ``obj`` with each atomic value replaced by its marker, in ``plain_layout``'s order (a dict's
    entries, then an ``OrderedDict``'s attributes); containers without a value are kept as they are. ``None``
    past 100 levels."""
    t = type(obj)
    if t in _LEAVES:
        count[0] += 1
        return _marker(count[0] - 1)
    if t in _TENSOR_TYPES:
        return obj
    if depth > 100:
        return None
    if t is list or t is tuple:
        if set(map(type, obj)) <= _TENSOR_TYPES:
            return obj
        items = [_shadow(v, count, depth + 1) for v in obj]
        if any(v is None for v in items):
            return None
        return items if t is list else tuple(items)
    extra = vars(obj) if t is _OD else None
    if not extra and set(map(type, obj.values())) <= _TENSOR_TYPES:
        return obj
    new = t()
    for k, v in obj.items():
        s = _shadow(v, count, depth + 1)
        if s is None:
            return None
        new[k] = s
    if extra:
        s = _shadow(extra, count, depth + 1)
        if s is None:
            return None
        vars(new).update(s)
    return new
