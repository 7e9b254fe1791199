"""The memory-tier restore of a slot into a live state of its layout, in a process that did not write it (a restart).

A restarted rank builds its model, then ``load(state_dict)``; the general path unpickles the slot's skeleton (a
Python call per tensor, seconds for 200,000 tensors) and walks it beside the live state. :mod:`slot_restore`
avoids that only for slots this process wrote. Here the slot is recognised by content: its index carries the
digest of its plain layout (:mod:`snapckpt.formats.plain_digest`, written by the Stager when the snapshot is one
plain file of whole contiguous CPU tensors): structure, the types of the non-tensor values (not the values: a
restarted loop's step counter differs from the saved one), dtypes, shapes and offsets. :func:`find` computes the
same digest from the live state (its ``plain_layout`` walk, each tensor's dtype and shape, and the offsets the
Stager's rule gives them) and, when they are equal, sets the saved non-tensor values into the live state's entries
as the general path does (the slot's own small pickle of them, :mod:`snapckpt.engine.plain_values`) and copies
each span straight into its live tensor: tensors of 1 MiB or more with one
``torch._foreach_copy_`` from views of the slot, the others with one ``memmove`` each (a state of many small
tensors would otherwise spend most of the restore making a view of the slot per tensor), their autograd version
counters bumped as an in-place copy bumps them. Anything else (no digest or no values: an older slot, another
layout, a live tensor that is not a contiguous CPU tensor of the saved dtype, a tensor that the general path would
replace rather than copy into, a small live tensor sharing bytes with a large one) gets ``None``, and the caller
reads the slot the general way, which also names any incompatibility.
"""
from __future__ import annotations

import ctypes
import gc
import re
from array import array
from collections import deque
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, is_, setitem
from typing import Any, Callable, List, Optional, Tuple

import torch

from snapckpt.engine import plain_values
from snapckpt.engine.slot_maps import MappedSlot
from snapckpt.errors import SnapshotError
from snapckpt.engine.stager import ALIGN
from snapckpt.formats.plain_digest import Facts, digest, tensor_part
from snapckpt.persister.arena import HEADER_NBYTES, read_header

__all__ = ["PlainCopies", "find", "direct_offsets"]

#: Tensors of at least this many bytes are copied by torch (its copy of a large tensor runs on several threads).
LARGE_NBYTES = 1 << 20

# the start of the index the Stager writes (snapckpt.engine.stager.index_bytes): its step, the digest, and where the
# values are (slot byte offset, size); an index without "values" (an older one) does not match
_HEAD = re.compile(rb'\{"v":2,"step":(\d+),"plain":"([0-9a-f]{64})","values":\[(\d+),(\d+)\],')
_HEAD_MAX = 160  # bytes of the index read for it
_IS_CPU = attrgetter("is_cpu")


@dataclass
class PlainCopies:
    """A restore found by :func:`find`: ``dicts[i][keys[i]] = values[i]`` (the saved non-tensor values, fresh
    objects), the large tensors as ``torch._foreach_copy_(large_dsts, large_srcs)``, the others as
    ``memmove(dst_ptrs[i], src_ptrs[i], nbytes[i])`` into ``small`` (whose versions are bumped). ``slot`` keeps
    the mapping the sources point into alive until the copy ran."""

    large_dsts: List[torch.Tensor]
    large_srcs: List[torch.Tensor]
    small: List[torch.Tensor]
    dst_ptrs: List[int]
    src_ptrs: List[int]
    nbytes: List[int]
    slot: MappedSlot
    dicts: List[dict]
    keys: List[Any]
    values: List[Any]

    def run(self) -> None:
        """Copy (the live tensors have the saved dtypes: a copy of bytes)."""
        if self.slot.tensor is None:
            raise SnapshotError(f"the mapping of {self.slot.path} was closed before the restore copied from it")
        deque(map(setitem, self.dicts, self.keys, self.values), maxlen=0)
        if self.large_dsts:
            with torch.no_grad():  # a Parameter's copy must not enter autograd
                torch._foreach_copy_(self.large_dsts, self.large_srcs)
        if self.small:
            deque(map(ctypes.memmove, self.dst_ptrs, self.src_ptrs, self.nbytes), maxlen=0)
            torch.autograd.graph.increment_version(self.small)  # as an in-place copy would


def find(live_layout: Callable[[str, Any], Optional[Tuple[List[torch.Tensor], List[Any]]]], mapped: MappedSlot,
         name: str, step: int, dst: Any) -> Optional[PlainCopies]:
    """The copies that restore ``dst`` (the live state of file ``name``) from ``mapped`` holding ``step``, or
    ``None`` when the slot's plain digest is absent or not that of ``dst`` (see the module). ``live_layout``:
    ``plain_layout`` of a file's object (:meth:`Stager.live_layout`)."""
    if mapped.tensor is None:
        return None
    try:
        got, index_offset, _n = read_header(mapped.buf)
    except SnapshotError:
        return None
    head = _HEAD.match(mapped.buf[index_offset:index_offset + _HEAD_MAX]) if got == step else None
    if head is None or int(head[1]) != step:
        return None
    values_at = (int(head[3]), int(head[4]))
    if values_at[0] + values_at[1] > index_offset:
        return None  # not where the Stager puts them (before the index): a damaged index
    enabled = gc.isenabled()
    gc.disable()  # a state of many tensors: no full collections while its layout is read
    try:
        return _find(live_layout, mapped, name, dst, head[2].decode(), index_offset, values_at)
    finally:
        if enabled:
            gc.enable()


def _find(live_layout: Callable, mapped: MappedSlot, name: str, dst: Any, saved: str, data_limit: int,
          values_at: Tuple[int, int]) -> Optional[PlainCopies]:
    walked = live_layout(name, dst)
    if walked is None:
        return None
    tensors, key = walked
    facts = Facts(tensors)
    ptrs = _data_ptrs(tensors, any(map(attrgetter("is_complex"), facts.kinds)))
    if ptrs is None:
        return None
    offsets, nbytes = direct_offsets(facts)
    if digest(name, key, tensor_part(facts, offsets.tolist())) != saved:  # no numpy: snapckpt does not need it
        return None
    if tensors and int(offsets[-1] + nbytes[-1]) > min(data_limit, mapped.nbytes):
        return None  # spans past the pickles: not a slot of this layout (a digest never lets this through)
    in_place: List[torch.Tensor] = []
    dicts: List[dict] = []
    keys: List[Any] = []
    # the general path replaces tensors inside lists and tuples: it decides those
    if (not plain_values.entries(dst, in_place, dicts, keys) or len(in_place) != len(tensors)
            or not all(map(is_, in_place, tensors))):
        return None
    values = plain_values.unpack(mapped.buf[values_at[0]:values_at[0] + values_at[1]])
    if values is None or len(values) != len(dicts):
        return None  # a damaged slot (a digest never lets another count through)
    sets = (dicts, keys, values)
    base = mapped.tensor.data_ptr()
    large = nbytes >= LARGE_NBYTES
    if not bool(large.any()):  # the common case of many tensors: all small
        return PlainCopies([], [], tensors, ptrs, offsets.add_(base).tolist(), nbytes.tolist(), mapped, *sets)
    small = large.logical_not()
    if _shared(torch.frombuffer(array("q", ptrs), dtype=torch.int64), nbytes, large, small):
        return None
    big = large.tolist()
    large_srcs = [mapped.tensor[o:o + n].view(t.dtype).view(t.shape) for t, o, n in
                  zip(compress(tensors, big), offsets[large].tolist(), nbytes[large].tolist())]
    few = small.tolist()
    return PlainCopies(list(compress(tensors, big)), large_srcs, list(compress(tensors, few)),
                       list(compress(ptrs, few)), offsets[small].add_(base).tolist(),
                       nbytes[small].tolist(), mapped, *sets)


def _shared(ptrs: torch.Tensor, nbytes: torch.Tensor, large: torch.Tensor, small: torch.Tensor) -> bool:
    """Whether a small live tensor shares bytes with a large one (a view beside its base, tied weights): copy_into
    copies in walking order, :meth:`PlainCopies.run` the large tensors first, so the last copy into the shared
    bytes would differ; such a state is left to the general path. (Among the small ones, or among the large ones,
    the copies keep the walking order.) Tensor ``i`` holds bytes ``[ptrs[i], ptrs[i] + nbytes[i])``; ``large``
    and ``small`` are the masks of the two kinds.

    A few large tensors, any number of small ones: a small one (under :data:`LARGE_NBYTES`) that overlaps a large
    one starts less than that before it, so one lookup of every start among those widened ranges (merged) finds
    the few candidates, which are then checked exactly."""
    starts, order = ptrs[large].sort()
    ends = starts.add(nbytes[large][order])
    bounds: List[int] = []  # the widened ranges, merged: [lo, hi) pairs, ascending
    for lo, hi in zip(starts.sub(LARGE_NBYTES - 1).tolist(), ends.tolist()):
        if bounds and lo <= bounds[-1]:
            bounds[-1] = max(bounds[-1], hi)
        else:
            bounds += [lo, hi]
    near = torch.searchsorted(torch.tensor(bounds, dtype=torch.int64), ptrs, right=True).bitwise_and_(1)
    if int(near.sum()) == len(starts):  # the large tensors themselves only
        return False
    cand = (near.bool() & small).nonzero().flatten()
    a, b = ptrs[cand], ptrs[cand].add(nbytes[cand])
    reach = ends.cummax(0).values  # the furthest end of the large ranges up to each
    i = torch.searchsorted(starts, a, right=True)  # the large ranges starting at or before each candidate
    before = i.gt(0) & reach[i.sub(1).clamp_(min=0)].gt(a)
    after = i.lt(len(starts)) & starts[i.clamp(max=len(starts) - 1)].lt(b)
    return bool((before | after).any())


def _data_ptrs(tensors: List[torch.Tensor], complex_dtypes: bool) -> Optional[List[int]]:
    """The live tensors' data pointers when every one can take its bytes by a copy of bytes: on the CPU, with a
    storage (strided), contiguous, without a conjugate or negative bit (views whose bytes are not their values;
    the conjugate bit only on complex dtypes, ``complex_dtypes``: whether any is); ``None`` otherwise."""
    t_ = torch.Tensor
    if not all(map(_IS_CPU, tensors)):
        return None
    try:  # a tensor without a storage (sparse, nested) raises on either
        ptrs = list(map(t_.data_ptr, tensors))
        if not all(map(t_.is_contiguous, tensors)):
            return None
    except RuntimeError:
        return None
    if any(map(t_.is_neg, tensors)) or (complex_dtypes and any(map(t_.is_conj, tensors))):
        return None
    return ptrs


def direct_offsets(facts: Facts) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(slot byte offsets, byte sizes)`` (int64 tensors) of tensors laid out as the Stager lays out tensors that
    are each their own whole span, in order: from the end of the slot header, each span ``ALIGN``-aligned after the
    previous one."""
    if not facts.numels:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    itemsizes = torch.tensor([d.itemsize for d in facts.kinds], dtype=torch.int64)
    nbytes = itemsizes[torch.frombuffer(facts.codes, dtype=torch.int64)].mul_(torch.frombuffer(facts.numels,
                                                                                              dtype=torch.int64))
    aligned = nbytes.add(ALIGN - 1).div_(ALIGN, rounding_mode="floor").mul_(ALIGN)
    return aligned.cumsum(0).sub_(aligned).add_(HEADER_NBYTES), nbytes
