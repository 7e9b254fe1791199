"""The digest of a plain state's slot layout: how a restarted process knows a memory snapshot fits its live state.

A slot written from one plain file (:func:`~snapckpt.formats.plain_layout.plain_layout`) whose every tensor is its
own whole, contiguous CPU span (the Stager's ``direct_all`` layout) carries ``"plain": <hex>`` in its index: the
SHA-256 of the file's name, the structure of its state read breadth-first (:mod:`snapckpt.formats.plain_levels`:
containers, keys, the types of the non-tensor values, where the tensors sit), every tensor's dtype, shape, and the
slot byte offset of its span. A process that never saved that slot (a restart) computes the same digest from its
live state, with the span offsets that the Stager's rule gives for those tensors
(:func:`snapckpt.engine.plain_restore.direct_offsets`); equal digests mean that unpickling the slot's skeleton
would give a state of the live state's structure whose tensors are the spans at those offsets, in walking order,
and whose non-tensor values have the live ones' types. The values themselves are not in the digest: a restarted
loop's step counter, learning rate or RNG state differs from the saved one, and the restore sets the saved values
from the slot's own list of them (:mod:`snapckpt.engine.plain_values`). Any other difference (another name,
structure, value type, dtype, shape or offset) gives another digest, and the general path; so does a state that
holds a container twice (the structure walk refuses it: no digest is written). The hash starts with
:data:`VERSION`, so a digest of an older rule (the depth-first key; before it, the values too) never equals one of
this rule. Nothing here is read as code: the digest is compared, never decoded. Beside the digest the slot may
carry a shape table (:func:`shape_table`), from which a restart derives the tensors' share of the digest without
reading the live tensors field by field; it is trusted only through the digest.
"""
from __future__ import annotations

import hashlib
import json
import math
from array import array
from itertools import chain, compress
from operator import attrgetter
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["Facts", "tensor_part", "digest", "VERSION", "ShapeTable", "shape_table", "read_table",
           "TABLE_MAX_SHAPES"]

#: The first bytes hashed: the rule of this module (rule 2 hashed the depth-first key of ``plain_layout``, the rule
#: before it the values too, without a prefix).
VERSION = b"snapckpt plain digest 3: levels\0"

_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")
_IS_MULTI_DIM = (1).__lt__


class Facts:
    """What the digest reads of each tensor, each field with one ``map`` (no Python step per tensor): ``kinds`` (each
    dtype once, in first-use order) and ``codes`` (each tensor's dtype as its index in ``kinds``), ``dims``,
    ``numels`` (int64 arrays in tensor order) and the shapes of the tensors of 2 dims or more, flat."""

    __slots__ = ("kinds", "codes", "dims", "numels", "multi_dim_sizes")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        t_ = torch.Tensor
        dtypes = list(map(_DTYPE, tensors))
        self.kinds = list(dict.fromkeys(dtypes))
        self.codes = array("q", map({d: i for i, d in enumerate(self.kinds)}.__getitem__, dtypes))
        self.dims = array("q", map(t_.dim, tensors))
        self.numels = array("q", map(t_.numel, tensors))
        self.multi_dim_sizes = array("q", chain.from_iterable(map(_SHAPE, compress(tensors, map(_IS_MULTI_DIM,
                                                                                                  self.dims)))))


def tensor_part(facts: Facts, offsets: Sequence[int]) -> bytes:
    """The tensors' share of the digest: dtypes, shapes (dims, element counts, the sizes of those of 2 dims or
    more) and span offsets (bytes from the slot start)."""
    return b"\0".join((repr(facts.kinds).encode(), facts.codes.tobytes(), facts.dims.tobytes(),
                       facts.numels.tobytes(), facts.multi_dim_sizes.tobytes(), array("q", offsets).tobytes()))


def digest(name: str, structure: bytes, tensors_part: bytes) -> str:
    """The hex SHA-256 of file ``name`` whose state has the structure ``structure``
    (:attr:`~snapckpt.formats.plain_levels.Levels.structure`: containers, keys and value types, breadth-first; no
    values) and :func:`tensor_part` ``tensors_part``."""
    h = hashlib.sha256(VERSION)
    h.update(repr(name).encode())
    h.update(b"\0%d\0" % len(structure))
    h.update(structure)
    h.update(tensors_part)
    return h.hexdigest()


#: At most this many distinct (dtype, shape) pairs in a :func:`shape_table` (a restart makes a reference tensor of
#: each: a state whose tensors nearly all differ in shape gets no table, and is checked tensor by tensor).
TABLE_MAX_SHAPES = 4096
# no tensor has this many bytes: a table's sizes stay below it, so its byte counts and their sums are int64s
_MAX_NBYTES = 1 << 62
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class ShapeTable:
    """What :func:`shape_table` wrote: ``kinds`` (dtypes, in :class:`Facts` order), ``shapes`` (each distinct
    ``(index in kinds, sizes)`` once, in first-use order) and ``ids`` (per tensor, its index in ``shapes``: an
    ``array("i")``)."""

    __slots__ = ("kinds", "shapes", "ids")

    def __init__(self, kinds: List[torch.dtype], shapes: List[Tuple[int, Tuple[int, ...]]], ids: array) -> None:
        self.kinds, self.shapes, self.ids = kinds, shapes, ids


def shape_table(tensors: Sequence[torch.Tensor], facts: Facts) -> bytes:
    """The dtypes and shapes of ``tensors`` (:class:`Facts` ``facts`` of them) as a restarted process reads them
    without a Python step per tensor (:mod:`snapckpt.engine.plain_restore`): a JSON line ``{"kinds": [dtype names],
    "shapes": [[kind index, [sizes]], ...]}`` (each distinct pair once), then each tensor's index into ``"shapes"``
    (int32, native byte order). ``b""`` when there are more than :data:`TABLE_MAX_SHAPES` distinct pairs. Nothing in
    it is trusted by itself: the restore hashes what it derives from it into the digest, which must be the saved
    one."""
    pairs = list(zip(facts.codes, map(tuple, map(_SHAPE, tensors))))
    first = dict.fromkeys(pairs)
    if len(first) > TABLE_MAX_SHAPES:
        return b""
    where = {p: i for i, p in enumerate(first)}
    head = json.dumps({"kinds": list(map(str, facts.kinds)), "shapes": [[c, list(s)] for c, s in first]},
                      separators=(",", ":"))
    return head.encode() + b"\n" + array("i", map(where.__getitem__, pairs)).tobytes()


def read_table(data: bytes) -> Optional[ShapeTable]:
    """The :class:`ShapeTable` of :func:`shape_table`'s ``data``, or ``None`` when it is not one (damaged: an unknown
    dtype, an index out of range, sizes that are not positive ints, a shape of ``2**62`` bytes or more: its byte
    counts would not be int64s)."""
    try:
        cut = data.index(b"\n")
        head = json.loads(data[:cut])
        kinds = [_DTYPES[k] for k in head["kinds"]]
        shapes = [(int(c), tuple(map(int, s))) for c, s in head["shapes"]]
        ids = array("i")
        ids.frombytes(data[cut + 1:])
    except (ValueError, KeyError, TypeError):
        return None
    if not all(0 <= c < len(kinds) and all(x > 0 for x in s) and math.prod(s) * kinds[c].itemsize < _MAX_NBYTES
               for c, s in shapes):
        return None  # numel 0 is never a direct tensor, a negative size no shape, and no tensor has 2**62 bytes
    if ids and not (0 <= _min(ids) and _max(ids) < len(shapes)):
        return None
    return ShapeTable(kinds, shapes, ids)


#: Items per torch reduction of :func:`_min` / :func:`_max`: under PyTorch's grain size (32,768), so that no call
#: wakes its thread pool (in a fresh process that costs more than Python's ``min`` of 200,000 items, 5 ms).
_ROWS = 32_000


def _min(ids: array) -> int:
    t = torch.frombuffer(ids, dtype=torch.int32)
    return min(int(t[a:a + _ROWS].min()) for a in range(0, len(ids), _ROWS))


def _max(ids: array) -> int:
    t = torch.frombuffer(ids, dtype=torch.int32)
    return max(int(t[a:a + _ROWS].max()) for a in range(0, len(ids), _ROWS))
