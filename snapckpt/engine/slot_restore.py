"""The memory-tier restore of a slot this process wrote, into a live state of the same layout: one copy per tensor.

``Checkpointer.load(state_dict)`` from memory reads a slot by unpickling its skeleton (a Python call per
tensor: seconds for 200,000 tensors) and walking it beside the live state. When the slot still holds what this
process's :class:`~snapckpt.engine.stager.Stager` wrote into it, that work is known in advance: :func:`find`
recognises the slot's bytes as those of a cached layout (the index and the pickle compared byte for byte, so a
slot rewritten since, by a later save or a fetch from a peer, is recognised only if it is the same layout) and
the live state as a state of that layout (:func:`~snapckpt.formats.plain_layout.plain_layout` key equal: the
same containers, keys and non-tensor values), and returns the copies from the slot's typed views (made by the
saves already) into the live tensors. Anything else (another layout, a state that differs, a tensor that is not
a whole contiguous CPU span, a shape that differs) gets ``None``: the caller reads the slot the general way,
which also names any incompatibility.

The small tensors a save writes into the slot file by ``pwritev`` (:mod:`snapckpt.engine.span_write`) are read back
by ``preadv`` with the same iovec table (its gaps into a scratch buffer) when the live tensors passed the guards and
still have the data pointers the table was filled with (one pass of ``data_ptr``): about 0.5 us per tensor with their
version bumps, against 1.3 us for ``torch._foreach_copy_``, which copies the others.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from operator import attrgetter, is_, itemgetter
from typing import Any, List, Optional, Tuple

import torch

from snapckpt import _native
from snapckpt.engine import mover
from snapckpt.engine.copy_plan import Sizes, layout_sizes
from snapckpt.engine.restore import copied_in_place as _copied_in_place, refuse_inference
from snapckpt.engine.slot_maps import MappedSlot
from snapckpt.engine.span_write import SlotFile, SpanWrites, read_back
from snapckpt.engine.stager import Stager, _Layout, direct_views, index_bytes
from snapckpt.errors import SnapshotError
from snapckpt.formats.plain_layout import has_repeats
from snapckpt.persister.arena import read_header

__all__ = ["SlotCopies", "find"]

_SHAPE = attrgetter("shape")
_SIZE = itemgetter(2)  # of a _Layout.direct_dst entry
_DATA_PTR = torch.Tensor.data_ptr
_IS_INFERENCE = torch.Tensor.is_inference


@dataclass
class SlotCopies:
    """A restore found by :func:`find`: ``torch._foreach_copy_(dsts, srcs)`` (live tensors, views of the slot; the small
    ones split among threads by :func:`snapckpt.engine.mover.foreach_copy`); with
    ``back`` (the mapping's slot file and the layout's :class:`~snapckpt.engine.span_write.SpanWrites`, filled with the
    live tensors' data pointers) the tensors at ``back[1].pos`` are read from the file by ``preadv`` instead (their
    versions bumped, as an in-place copy bumps them) and only what that did not read is copied by torch."""

    dsts: List[torch.Tensor]
    srcs: List[torch.Tensor]
    sizes: Sizes  # the layout's: torch's copy is split among threads by them (Sizes.split, made once)
    back: Optional[Tuple[SlotFile, SpanWrites]] = None
    read_by_file: int = 0  # how many tensors preadv read, for tests and profiles
    inference: bool = False  # some of dsts were made under torch.inference_mode()

    def run(self) -> None:
        """Copy (dtype and device follow the live tensors, as ``Tensor.copy_``).

        Raises:
            RuntimeError: a live tensor made under ``torch.inference_mode()``, restored outside it
                (:func:`~snapckpt.engine.restore.refuse_inference`), before anything is written.
        """
        dsts, srcs, rest = self.dsts, self.srcs, None
        if self.inference and not torch.is_inference_mode_enabled():
            refuse_inference()
        if self.back is not None:
            file, writes = self.back
            fd = file.descriptor(writes.end)
            if fd is not None:
                pos = writes.pos
                done = self.read_by_file = read_back(fd, writes)
                # the versions of the tensors read back, once (torch's copy of the others bumps theirs): after the
                # read, so that a read that stops leaves the rest to that copy alone
                if done:
                    _native.increment_version(dsts if done == len(dsts) else list(map(dsts.__getitem__, pos[:done])))
                rest = writes.rest if done == len(pos) else sorted(writes.rest + pos[done:])
                if len(rest) < len(dsts):
                    dsts, srcs = list(map(dsts.__getitem__, rest)), list(map(srcs.__getitem__, rest))
                else:
                    rest = None
        if dsts:  # under no_grad: a Parameter's copy must not enter autograd
            mover.foreach_copy(dsts, srcs, self.sizes.split(torch.get_num_threads(), rest))


def find(stager: Stager, mapped: MappedSlot, name: str, step: int, dst: Any) -> Optional[SlotCopies]:
    """The copies that restore ``dst`` (the live state of file ``name``) from ``mapped`` holding ``step``, or
    ``None`` when the slot or ``dst`` is not of a layout this process saved into that mapping (see the module)."""
    if not mapped.views or mapped.tensor is None:
        return None
    enabled = gc.isenabled()
    gc.disable()  # a state of many tensors: no full collections while its shapes are read
    try:
        return _find(stager, mapped, name, step, dst)
    finally:
        if enabled:
            gc.enable()


def _find(stager: Stager, mapped: MappedSlot, name: str, step: int, dst: Any) -> Optional[SlotCopies]:
    walked = stager.live_match(name, dst, distinct_tensors=False)  # _copies checks for a tensor met twice
    if walked is None:
        return None
    tensors, key, in_place = walked
    for layout in reversed(list(mapped.views)):  # the layouts copied into this mapping, newest first
        tk = layout.tail_key
        if (layout.direct_all and tk is not None and len(tk) == 3 and tk[0] == [name] and tk[2][0] == key
                and len(tensors) == len(layout.direct_dst) and _holds(mapped, layout, step)):
            return _copies(mapped, layout, dst, tensors, in_place)
    return None


def _holds(mapped: MappedSlot, layout: _Layout, step: int) -> bool:
    """Whether the slot holds a complete snapshot of ``step`` whose index and pickle are ``layout``'s."""
    buf = mapped.buf
    try:
        got, off, n = read_header(buf)
    except SnapshotError:
        return False
    if got != step or off != layout.tail_end or not layout.tail:
        return False
    index = index_bytes(step, layout)  # as Stager._prepare writes it
    # the tail: the pickle, and the plain restore's values (snapckpt.engine.plain_values) when the index says so.
    # Slices of the mapping are bytes (a memcpy, then a memcmp): far faster than comparing memoryviews, which
    # compare item by item
    return (n == len(index) and buf[off:off + n] == index
            and all(buf[o:o + len(data)] == data for o, data in layout.tail))


def _copies(mapped: MappedSlot, layout: _Layout, dst: Any, tensors: List[torch.Tensor],
            in_place: Optional[bool] = None) -> Optional[SlotCopies]:
    """The copies of :func:`find` once ``dst`` (whose tensors are ``tensors``) is known to be of ``layout``'s key;
    ``in_place``: whether :func:`~snapckpt.engine.restore.copy_into` copies every one of them in place (known when
    the Stager's memo found ``dst``: :meth:`Stager.live_match`), ``None`` when not known (found here)."""
    # The save's check of types, dtypes, shapes and strides (C++): passes when the state is the saved one; it also
    # refuses a tensor object met twice (see layout_check.Recheck), which the memo's match left to this check.
    r = layout.recheck
    writes, file = layout.span_writes, getattr(mapped, "file", None)
    back = bool(writes) and writes.ptrs is not None and file is not None
    # the native loop (when built) checks the guards' fields and that the data pointers are the ones the last save
    # read (which fill the pwritev table) in one pass, and that no tensor object occurs twice; it changes nothing
    # (the versions are bumped by the copy: a restore found here may not be run, when another rank refuses the step)
    fast = r is not None and r.native_same(tensors)
    same = fast or (r is not None and r.same_tensors(tensors))
    if not same and (list(map(_SHAPE, tensors)) != list(map(_SIZE, layout.direct_dst)) or has_repeats(tensors)):
        return None  # the general path names the mismatches (a tensor twice: the key is not the saved one)
    if in_place is None and layout.restore_ok is None:
        # copy_into copies a tensor in place only when dicts lead to it (one in a list or tuple is replaced by
        # a copy): this path, which copies every tensor in place, is taken only when that is every tensor.
        dsts: List[torch.Tensor] = []
        _copied_in_place(dst, dsts)
        layout.restore_ok = len(dsts) == len(tensors) and all(map(is_, dsts, tensors))
    ok = layout.restore_ok if in_place is None else in_place
    if not ok:
        return None
    srcs = direct_views(layout, mapped.tensor, mapped.views)
    # inference tensors may be written inside torch.inference_mode(), not outside it; once known for tensors that
    # pass the guards (which compare dispatch keys), it holds for the next ones that pass (layout_check.Recheck)
    if torch.is_inference_mode_enabled():
        inference = False
    elif fast:  # inference or not as the tensors the native records were made from (not cached: see above)
        inference = r.table_inference
    elif same and r.inference is not None:
        inference = r.inference
    else:
        inference = any(map(_IS_INFERENCE, tensors))
        if same:
            r.inference = inference
    # the save's pwritev table read back: only into the addresses it was filled with (a tensor given new memory since,
    # or one of another shape, which the guards refuse, takes torch's copy)
    if same and back and ((fast and writes.ptrs is r.ptrs) or list(map(_DATA_PTR, tensors)) == writes.ptrs):
        return SlotCopies(tensors, srcs, layout_sizes(layout), (file, writes), inference=inference)
    return SlotCopies(tensors, srcs, layout_sizes(layout), inference=inference)
