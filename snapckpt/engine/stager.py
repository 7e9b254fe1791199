"""The Stager: copies a rank's state into an arena slot (the only part on the training critical path).

Sequence for one snapshot (all on the training process, no collective, no allocation of tensor memory):

1. :meth:`Stager.prepare` walks the state once to find its tensors (a plain state by
   :func:`~snapckpt.formats.plain_layout.plain_layout`, else :func:`collect_tensors`), groups them by the
   storage they live in, and looks up the cached :class:`_Layout` (a :class:`Plan` and what later saves reuse)
   for that exact layout, keyed on every tensor's aliasing, offset, shape, stride, dtype, device, type and
   ``requires_grad`` (:func:`_signature`, contract 3), so a changed layout (a replaced optimizer tensor, a new
   parameter group, a new shape) always gets a new plan. The skeleton (``data.pkl``) of each file is pickled
   here, with user objects pickled by the training process itself, so the persister never unpickles anything;
   a plain state's skeleton and the slot index are reused while its non-tensor values are equal, and its skeleton
   is spliced with the new values when only they changed (:mod:`snapckpt.formats.value_splice`).
2. :meth:`Stager.copy_into` copies each storage span into the slot by the layout's :class:`_CopyPlan` (the tensors
   that are whole spans into typed views of the slot, cached per mapping: by ``torch._foreach_copy_``, small ones by
   ``pwritev`` of the slot file, large ones possibly by :mod:`snapckpt.engine.mover`), then writes the pickles, the
   index and the header. CUDA spans may be queued beforehand on a side stream into page-locked memory
   (:mod:`snapckpt.engine.device_copy`); the copy thread of ``overlap=True`` runs this step off the training
   thread, and :meth:`Checkpointer.fence` waits for both.

:func:`snapckpt.persister.slot_index.read_slot` is the reverse (memory-tier load).
"""
from __future__ import annotations

import bisect
import gc
import json
import logging
import math
import time
from collections import deque
from itertools import compress, islice, starmap
from operator import attrgetter, eq, is_, itemgetter, mul, not_, sub
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from snapckpt.persister.arena import HEADER_NBYTES, watermark_view, write_header
from snapckpt._internal import faultpoints as faults
from snapckpt.errors import SnapshotError
from snapckpt.formats.plain_layout import LayoutMemo, has_repeats, plain_layout
from snapckpt.formats import plain_levels
from snapckpt.formats.plain_digest import Facts, digest, shape_table, tensor_part
from snapckpt.engine import mover
from snapckpt.engine.plain_values import pack, pack_values
from snapckpt.engine.restore import copied_in_place
from snapckpt.engine.span_write import SMALL_NBYTES, SlotFile, SpanWrites, write_spans
from snapckpt.formats.specs import Concat, RawBytes, TorchSave, unwrap
from snapckpt.formats.value_splice import ValueTemplate, split_key
from snapckpt.formats.torch_zip import (TensorRef, _check_supported, collect_tensors, find_unpicklable, pickle_skeleton,
                                        weights_only_refusal)

__all__ = ["Stager", "Prepared", "Plan"]

ALIGN = 64

log = logging.getLogger(__name__)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class _Span:
    key: str
    start_nbytes: int  # byte offset of the span in its source storage
    nbytes: int  # bytes copied and written
    arena_offset: int  # byte offset of the span in the slot


@dataclass(frozen=True)
class Plan:
    """Where every span of a given state layout goes in a slot.

    Attributes:
        spans: one per byte range of a source storage that tensors use (see :func:`_clusters`), in
            first-use order of the storages.
        tensor_span: per collected tensor (collection order), the index of its span.
        refs: per collected tensor, its :class:`TensorRef` (offset relative to its span).
        data_end: first byte after the last span (bytes from the slot start).
    """

    spans: Tuple[_Span, ...]
    tensor_span: Tuple[int, ...]
    refs: Tuple[TensorRef, ...]
    data_end: int


_DTYPE, _SHAPE, _DEVICE, _GRAD = (attrgetter(a) for a in ("dtype", "shape", "device", "requires_grad"))
_ITEMSIZE = attrgetter("itemsize")
_DATA_PTR, _OFFSET = torch.Tensor.data_ptr, torch.Tensor.storage_offset


def _signature(tensors: List[torch.Tensor]) -> tuple:
    """The cache key of a plan: everything :func:`_build_plan` and the skeleton's tensors read.

    Per tensor: storage offset, shape, stride, dtype, device, type (``nn.Parameter`` or not), ``requires_grad``, and
    which storage it views, as the index of that storage in first-use order (its data pointer stands in only for the
    grouping: ``None`` when every tensor has a storage of its own, the common case, found without a Python loop); and
    whether any tensor has a lazy conjugate or negative bit. Two states whose tensors are fresh allocations of the
    same layout (a new ``torch.get_rng_state()`` every save, optimizer state replaced by clones) get the same key and
    share a plan; a change of aliasing (tied tensors untied), shape, stride, dtype, device or offset changes the key
    (contract 3 (docs/design/contracts.md)). The plan holds no tensor handles: :meth:`Stager.prepare` takes the copy
    sources from the live tensors at every save, so reusing a plan across allocations is safe. Each field is read with
    one ``map`` over the tensors (C calls, no Python frame per tensor).

    Raises:
        RuntimeError: a tensor without strides (sparse, nested): the caller checks the tensors then.
        SnapshotError: a tensor whose storage was freed (:func:`_check_storages`).
    """
    t_ = torch.Tensor
    offs = tuple(map(t_.storage_offset, tensors))
    dtypes = tuple(map(_DTYPE, tensors))
    devices = tuple(map(_DEVICE, tensors))
    ptrs, itemsizes = list(map(_DATA_PTR, tensors)), tuple(map(_ITEMSIZE, dtypes))
    _check_storages(tensors, ptrs, offs, itemsizes)
    groups = _groups(ptrs, offs, itemsizes, devices, len(set(devices)) <= 1)
    # a lazy conjugate (complex dtypes only) or negation, refused when a plan is built: the direct tensors' copies
    # (pwritev, memmove) take raw bytes, so a plan found for such a state would save the values unconjugated
    lazy = (any(d.is_complex for d in set(dtypes)) and any(map(t_.is_conj, tensors))) or any(map(t_.is_neg, tensors))
    return (len(tensors), groups, offs, dtypes, devices, tuple(map(_SHAPE, tensors)), tuple(map(t_.stride, tensors)),
            tuple(map(type, tensors)), tuple(map(_GRAD, tensors)), lazy)


def _check_storages(tensors: List[torch.Tensor], ptrs: List[int], offs: tuple, itemsizes: tuple) -> None:
    """Refuse a tensor with elements whose storage has no memory (a null start: its storage was freed in place,
    ``untyped_storage().resize_(0)``, as FSDP frees resharded parameters): a copy of it reads from address 0, which
    kills the process (torch's own ``copy_`` too). ``ptrs``: the tensors' data pointers; ``offs``, ``itemsizes``:
    their storage offsets (elements) and element sizes (bytes).

    Raises:
        SnapshotError: naming the tensor's shape and dtype.
    """
    starts = list(map(sub, ptrs, map(mul, offs, itemsizes))) if any(offs) else ptrs
    if 0 not in starts:  # the common case: one C-level scan
        return
    for i in compress(range(len(starts)), map(not_, starts)):
        t = tensors[i]
        if t.numel():
            _check_supported(t)  # a meta tensor has no memory either: its own message
            raise SnapshotError(
                f"cannot snapshot a tensor of shape {tuple(t.shape)} ({t.dtype}) whose storage holds no memory "
                "(freed in place, e.g. untyped_storage().resize_(0), as FSDP does to resharded parameters): save "
                "the state while its storage is allocated, or its sharded form")


def _groups(ptrs: List[int], offs: tuple, itemsizes: tuple, devices: tuple, one_device: bool) -> Optional[tuple]:
    """:func:`_signature`'s storage grouping of tensors with data pointers ``ptrs`` (a function of ``ptrs``,
    ``offs``, ``itemsizes`` and ``devices`` only): ``None`` when every tensor has a storage of its own (on one
    device: ``one_device``)."""
    # every offset 0 (the common case): the data pointers are the storages' starts (two passes fewer)
    starts = list(map(sub, ptrs, map(mul, offs, itemsizes)) if any(offs) else ptrs)
    empty = starts.count(0)  # no storage (a null data pointer): a group of its own each
    # sorted, not a set: a set of 200,000 aligned pointers is several times slower (hash collisions, misses)
    ordered = sorted(starts)
    if one_device and list(map(eq, ordered, islice(ordered, 1, None))).count(True) == max(empty - 1, 0):
        return None
    ids: Dict[tuple, int] = {}
    return tuple(ids.setdefault((d, p) if p else ("empty", i), len(ids))
                 for i, (d, p) in enumerate(zip(devices, starts)))


try:  # PyTorch's C++ check of many tensors' dtype, device, shape, stride, requires_grad (and dispatch keys)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every supported torch has it; the full signature is the fallback
    _TensorGuards = None


class _Recheck:
    """A quick way to tell that tensors have their layout's :func:`_signature`, without reading it (a plan-cache hit).

    The tensors are read in chunks of :data:`_CHUNK`, each chunk by three C-level passes while its tensors are in the
    CPU's caches (one pass per field over 200,000 tensors misses them three times): the storage offsets (and with them
    the count), PyTorch's ``TensorGuards`` (a C++ loop: each tensor's Python type, dtype, device, shape, stride,
    ``requires_grad`` and dispatch keys, the lazy conjugate and negative bits among them, against the tensors the
    entry was made from), and the data pointers. The storage grouping is then compared: when the data pointers are
    those of the last tensors that passed (``ptrs``: the same training state saved again, the common case), it is
    theirs, since the grouping is a function of the pointers, offsets, element sizes and devices, all equal then; else
    it is recomputed from the pointers (with the known element sizes). Every field of the signature is compared, so a
    hit means the same signature; any failure (or a guard that cannot be made) falls back to the full
    :func:`_signature`.

    A hit also means that no tensor object occurs twice, so :meth:`Stager._prepare` leaves that check of a memo's
    match to this one: ``TensorGuards.check`` refuses repeated objects within its chunk (dynamo relies on it; a
    unit test pins it); across chunks, when the pointers are the last ones and those are distinct but for null
    ones (``distinct``: each tensor its own bytes, the common case), only the tensors without data can be one
    object twice, and those few are compared; otherwise every tensor is (:func:`has_repeats`).

    ``whole``: one ``TensorGuards`` of all the tensors (with ``restorable``: a layout the in-process restore takes,
    :mod:`snapckpt.engine.slot_restore`), for :meth:`same_tensors`: the restore reads no data pointers, and one
    check of every tensor refuses a repeat without a sort (16 MiB and 70 ms to make for 200,000 tensors, once
    per check made).
    """

    __slots__ = ("n", "offsets", "chunks", "whole", "itemsizes", "devices", "one_device", "groups", "ptrs",
                 "distinct", "nulls", "inference")

    def __init__(self, tensors: List[torch.Tensor], sig: tuple, restorable: bool = False) -> None:
        self.n, self.offsets = len(tensors), sig[2]
        self.chunks = [(_TensorGuards(*tensors[i:i + _CHUNK], dynamic_dims_sizes=None, dynamic_dims_strides=None),
                        self.offsets[i:i + _CHUNK]) for i in range(0, self.n, _CHUNK)]
        self.whole = self.chunks[0][0] if len(self.chunks) == 1 else (
            _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None) if restorable else None)
        self.itemsizes = tuple(map(_ITEMSIZE, sig[3]))
        self.devices, self.groups = sig[4], sig[1]
        self.one_device = len(set(self.devices)) <= 1
        # whether the tensors that pass same_tensors outside torch.inference_mode() include some made under it: found
        # by the first restore that needs it (slot_restore). Checked outside it, the guards' dispatch keys tell the
        # two kinds apart (whichever mode made them), so every tensor list that passes there is of that one answer
        self.inference: Optional[bool] = None
        self._remember(list(map(_DATA_PTR, tensors)))

    def _remember(self, ptrs: List[int]) -> None:
        self.ptrs = ptrs
        ordered = sorted(ptrs)
        self.nulls = nulls = ordered.count(0)  # first: pointers are not negative
        self.distinct = not any(map(eq, islice(ordered, nulls, None), islice(ordered, nulls + 1, None)))

    def _scan(self, tensors: List[torch.Tensor], offsets: bool) -> Optional[List[int]]:
        """The data pointers of ``tensors`` when every chunk passes its guards (and has the storage offsets of
        the entry's tensors, with ``offsets``); ``None`` otherwise."""
        if len(tensors) != self.n:
            return None
        ptrs: List[int] = []
        for i, (guards, offs) in zip(range(0, self.n, _CHUNK), self.chunks):
            part = tensors[i:i + _CHUNK]
            if (offsets and tuple(map(_OFFSET, part)) != offs) or not guards.check(*part):
                return None
            ptrs.extend(map(_DATA_PTR, part))
        return ptrs

    def _once_each(self, tensors: List[torch.Tensor], ptrs: List[int]) -> bool:
        """Whether no tensor object occurs twice in ``tensors``, whose chunks passed their guards and whose data
        pointers ``ptrs`` are the remembered ones (see the class)."""
        if len(self.chunks) <= 1:
            return True  # one TensorGuards.check saw every pair
        if not self.distinct:
            return not has_repeats(tensors)
        return self.nulls < 2 or not has_repeats(list(compress(tensors, map(not_, ptrs))))

    def matches(self, tensors: List[torch.Tensor]) -> bool:
        """Whether ``tensors`` have the entry's signature and no tensor object occurs twice.

        Raises:
            SnapshotError: data pointers changed and a tensor's storage was freed (:func:`_check_storages`).
        """
        ptrs = self._scan(tensors, True)
        if ptrs is None:
            return False
        if ptrs != self.ptrs:
            _check_storages(tensors, ptrs, self.offsets, self.itemsizes)
            if _groups(ptrs, self.offsets, self.itemsizes, self.devices, self.one_device) != self.groups:
                return False
            self._remember(ptrs)
        return self._once_each(tensors, ptrs)

    def same_tensors(self, tensors: List[torch.Tensor]) -> bool:
        """Whether ``tensors`` pass the guards (type, dtype, device, shape, stride, ``requires_grad``; offsets and
        grouping not compared) and no tensor object occurs twice (a restore's check, :mod:`slot_restore`)."""
        if len(tensors) != self.n:
            return False
        if self.whole is not None:
            return self.whole.check(*tensors)
        return (all(guards.check(*tensors[i:i + _CHUNK])
                    for i, (guards, _) in zip(range(0, self.n, _CHUNK), self.chunks))
                and not has_repeats(tensors))


#: Tensors per chunk of the quick check (:class:`_Recheck`): their tensor structs stay in the CPU's caches for its
#: three passes.
_CHUNK = 1024


_RECHECKS_KEPT = 2  # quick checks made for one layout before it goes without (see Stager._plan_for)


def _extent_nbytes(t: torch.Tensor) -> Tuple[int, int]:
    es = t.element_size()
    lo = t.storage_offset() * es
    if t.numel() == 0:
        return lo, lo
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return lo, (last + 1) * es


def _build_plan(tensors: List[torch.Tensor]) -> Plan:
    from torch.serialization import location_tag

    groups: Dict[tuple, int] = {}
    members: List[List[int]] = []
    for i, t in enumerate(tensors):
        st = t.untyped_storage()
        gkey = (str(t.device), st.data_ptr()) if st.data_ptr() != 0 else ("empty", i)
        g = groups.setdefault(gkey, len(members))
        if g == len(members):
            members.append([])
        members[g].append(i)
    spans: List[_Span] = []
    tensor_span = [0] * len(tensors)
    refs: List[TensorRef] = [None] * len(tensors)  # type: ignore[list-item]
    offset = HEADER_NBYTES
    for g, idx in enumerate(members):
        dtypes = {tensors[i].dtype for i in idx}
        if len(dtypes) > 1:
            raise SnapshotError(
                f"tensors that view one storage as different dtypes {sorted(map(str, dtypes))} cannot be "
                "saved (torch.save refuses them too); clone one of them")
        t0 = tensors[idx[0]]
        es = t0.element_size()
        location = location_tag(t0.untyped_storage())
        for lo, hi, cluster in _clusters(tensors, idx):
            key = str(len(spans))
            for i in cluster:
                t = tensors[i]
                tensor_span[i] = len(spans)
                refs[i] = TensorRef(key, (t.storage_offset() * es - lo) // es, tuple(t.shape),
                                    tuple(t.stride()), t.dtype, location, (hi - lo) // es)
            spans.append(_Span(key, lo, hi - lo, offset))
            offset = _align(offset + hi - lo)
    return Plan(tuple(spans), tuple(tensor_span), tuple(refs), offset)


def _clusters(tensors: List[torch.Tensor], idx: List[int]) -> List[Tuple[int, int, List[int]]]:
    """Split the tensors ``idx`` of one storage into ``(lo, hi, members)`` byte ranges to save.

    Tensors whose byte extents overlap or nearly touch (a gap under ``ALIGN`` bytes) share a range, so
    they come back sharing one storage; a gap between them starts a new range, so a few small views
    into a large buffer write about their own size, not the gaps (case D3). ``lo`` is ``ALIGN``-aligned.
    """
    extents = sorted((_extent_nbytes(tensors[i]) + (i,) for i in idx), key=lambda e: e[0])
    out: List[list] = []
    for lo, hi, i in extents:
        lo = lo // ALIGN * ALIGN
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
            out[-1][2].append(i)
        else:
            out.append([lo, max(hi, lo), [i]])
    return [(lo, hi, members) for lo, hi, members in out]


@dataclass(eq=False)  # hashed by identity: the key of a mapping's cache of views
class _Layout:
    """A cached plan and what later saves of the same layout reuse (one per :func:`_signature`).

    Attributes:
        plan: the spans.
        direct: collected-tensor indices whose span is exactly that tensor, contiguous and on the CPU: copied
            by one ``torch._foreach_copy_`` from the live tensors into typed views of the slot (no per-save
            view of their storage); ``direct_all``: that is every tensor, in collection order.
        direct_dst: per ``direct`` tensor, ``(slot byte offset, dtype, shape, stride)`` of its view.
        spans: ``(span index, a collected-tensor index viewing its storage)`` of the other spans, copied as
            bytes of the storage (views of several tensors, CUDA tensors, gaps); their tensors are checked
            (:func:`_check_supported`) at every save, the direct ones when the plan is built.
        tensor_nbytes: the sum of span sizes.
        tail_key, tail, files_json: the last skeleton made with this plan: the key of the files it was made
            from (``None``: not reusable), the pickles ``(slot offset, bytes)`` and the index's ``"files"``
            JSON; ``tail_end``: the first byte after the pickles (the index's offset).
        pickles: per plain file, its last pickle (see :meth:`Stager._skeletons`).
        recheck: the quick check of tensors of this layout (:class:`_Recheck`), ``None`` until made or when
            it cannot be; ``rechecks_made``: how many were made (a layout whose check keeps missing while its
            signature hits stops getting new ones).
        restore_ok: whether a live state of the tail's key takes a slot of this layout by one copy per tensor
            (:mod:`snapckpt.engine.slot_restore`); ``None``: not known yet (reset with the tail).
        plain_part, index_head: see :mod:`snapckpt.formats.plain_digest`: the digest written into the index when
            the tail is one plain file and every tensor is direct (a restarted process restores such a slot
            straight into its live state, :mod:`snapckpt.engine.plain_restore`), with where the tail holds the
            values that restore sets (:mod:`snapckpt.engine.plain_values`: then the tail's last entry).
    """

    plan: Plan
    direct: Tuple[int, ...]
    direct_all: bool
    direct_dst: Tuple[Tuple[int, torch.dtype, Tuple[int, ...], Tuple[int, ...]], ...]
    spans: Tuple[Tuple[int, int], ...]
    tensor_nbytes: int
    tail_key: Optional[list] = None
    pickles: Dict[str, tuple] = field(default_factory=dict)
    tail: Optional[List[Tuple[int, bytes]]] = None
    files_json: bytes = b""
    tail_end: int = 0
    recheck: Optional[_Recheck] = None
    rechecks_made: int = 0
    restore_ok: Optional[bool] = None
    stream_steps: Optional[List[tuple]] = None  # the streamed copy's steps (:func:`_stream_steps`), made once
    plain_part: Optional[bytes] = None  # the tensors' share of the plain digest (:func:`tensor_part`), made once
    sizes: Optional["_Sizes"] = None  # its direct tensors by size (:func:`_sizes`), made once
    # the copy plans of a save through the mapping only and of one by file too (:func:`_copy_plan`), made when needed
    copy_plans: List[Optional["_CopyPlan"]] = field(default_factory=lambda: [None, None])
    ways: "_Ways" = field(default_factory=lambda: _Ways())  # how its large tensors are copied (:class:`_Ways`)
    plain_table: bytes = b""  # their dtypes and shapes for a restart (:func:`shape_table`), made with plain_part
    index_head: bytes = b""  # the index's ``"plain":...,"values":...,`` entries of the tail's files, or nothing
    plain_hex: Optional[tuple] = None  # (file name, key structure, digest): reused while both stay (values change)
    file_json: Dict[Optional[str], tuple] = field(default_factory=dict)  # the index's last JSON (Stager._skeletons)
    # the small direct tensors' pwritev (snapckpt.engine.span_write), made with the first plan by file; False: none
    span_writes: Any = None


#: Bytes a streamed copy copies between two watermark stores (a batch of small tensors, or a piece of a large one).
STREAM_BATCH_NBYTES = 32 << 20


def _stream_steps(layout: _Layout, batch_nbytes: int = STREAM_BATCH_NBYTES) -> List[tuple]:
    """The copies of a streamed save in ascending slot offset, in batches of about ``batch_nbytes`` bytes, each
    with the watermark it publishes (the end of its last byte: every span before it is copied by then). A step
    is ``("direct", i, j, end)`` (direct tensors ``i:j`` by one ``_foreach_copy_``), ``("piece", i, a, b, end)``
    (elements ``a:b`` of a large direct tensor ``i``) or ``("span", k, a, b, end)`` (bytes ``a:b`` of span copy
    ``k``). Cached in the layout: its spans never move."""
    if layout.stream_steps is not None:
        return layout.stream_steps
    plan = layout.plan
    items = [(off, "direct", i, dtype.itemsize, math.prod(size)) for i, (off, dtype, size, _st)
             in enumerate(layout.direct_dst)]
    items += [(plan.spans[s].arena_offset, "span", k, 1, plan.spans[s].nbytes) for k, (s, _i) in enumerate(layout.spans)]
    items.sort(key=lambda x: x[0])
    steps: List[tuple] = []
    run: Optional[list] = None  # an open batch of consecutive direct tensors: [first, last + 1, bytes, end]
    for off, kind, i, es, n in items:
        nbytes = n * es
        if kind == "direct" and nbytes <= batch_nbytes:
            if run is not None and run[1] == i and run[2] + nbytes <= batch_nbytes:
                run[1], run[2], run[3] = i + 1, run[2] + nbytes, off + nbytes
                continue
            if run is not None:
                steps.append(("direct", run[0], run[1], run[3]))
            run = [i, i + 1, nbytes, off + nbytes]
            continue
        if run is not None:
            steps.append(("direct", run[0], run[1], run[3]))
            run = None
        per = max(1, batch_nbytes // es)  # elements per piece
        for a in range(0, n, per):
            b = min(n, a + per)
            steps.append(("piece" if kind == "direct" else "span", i, a, b, off + b * es))
    if run is not None:
        steps.append(("direct", run[0], run[1], run[3]))
    layout.stream_steps = steps
    return steps


def _layout(tensors: List[torch.Tensor], plan: Plan) -> _Layout:
    members: List[List[int]] = [[] for _ in plan.spans]
    for i, s in enumerate(plan.tensor_span):
        members[s].append(i)
    direct, dst, spans = [], [], []
    for s, idx in enumerate(members):
        span = plan.spans[s]
        if len(idx) == 1:
            t, ref = tensors[idx[0]], plan.refs[idx[0]]
            if (t.device.type == "cpu" and t.numel() and ref.storage_offset == 0 and t.is_contiguous()
                    and span.nbytes == t.numel() * t.element_size()):
                direct.append(idx[0])
                dst.append((span.arena_offset, t.dtype, ref.size, ref.stride))
                continue
        if idx:
            spans.append((s, idx[0]))
    return _Layout(plan, tuple(direct), direct == list(range(len(tensors))), tuple(dst), tuple(spans),
                   sum(s.nbytes for s in plan.spans))


@dataclass
class Prepared:
    """A snapshot ready to be copied: what to copy where, plus the bytes that follow the data.

    Attributes:
        step: the step being snapshotted.
        total_nbytes: bytes the slot must hold (header, spans, pickles, index).
        span_copies: ``(source uint8 tensor view, slot byte offset)`` per span copied as bytes (CUDA sources
            among them); :attr:`copies` lists every copy that way.
        tail: ``(slot byte offset, bytes)`` for each pickle and the index.
        index_offset, index_nbytes: where the index (JSON) sits.
        tensor_nbytes: bytes of tensor data (the sum of span sizes).
        persistable: whether any file is for disk; a snapshot of ``MemoryOnly`` files only is never written
            by the persister's flush after a crash (it is not a checkpoint in any layout).
        direct: the CPU tensors copied whole into typed views of the slot (:class:`_Layout`), and their
            layout (the key of the views' cache, :attr:`views`).
        views: the slot mapping's cache of typed views (``MappedSlot.views``), set by the caller of
            :meth:`Stager.copy_into`; ``None``: the views are made for this copy only.
        streamed: set by :meth:`Stager.begin_stream` (a streamed DISK save).
        ptrs: the data pointers of the save's tensors (collection order) when the plan's quick check read them this
            save (a list never changed: the key of the iovec table's addresses, :mod:`snapckpt.engine.span_write`);
            ``None``: not known, no ``pwritev``.
        slot_file: the mapped slot file (``MappedSlot.file``, a :class:`~snapckpt.engine.span_write.SlotFile`: it keeps
            the descriptor), set by the caller of :meth:`Stager.copy_into` like :attr:`views`; ``None``: every copy
            through the mapping.
        on_caller: set by the caller of :meth:`Stager.copy_into` when it copies on the thread that saves (no copy
            thread): the direct tensors of the ``"torch"`` steps are then copied by ``memmove`` when :attr:`ptrs` is
            known (:meth:`_CopyStep.memmoves`).
    """

    step: int
    total_nbytes: int
    span_copies: List[Tuple[torch.Tensor, int]]
    tail: List[Tuple[int, bytes]]
    index_offset: int
    index_nbytes: int
    tensor_nbytes: int
    persistable: bool = True  # some file of the snapshot is written to disk (not all MemoryOnly)
    direct: Sequence[torch.Tensor] = ()
    layout: Optional[_Layout] = None
    views: Optional[Dict[Any, List[torch.Tensor]]] = None
    streamed: bool = False  # Stager.begin_stream ran: copy_into publishes the watermark
    ptrs: Optional[List[int]] = None
    slot_file: Optional[SlotFile] = None
    on_caller: bool = False

    @property
    def copies(self) -> List[Tuple[torch.Tensor, int]]:
        """Every copy as ``(source uint8 tensor view, slot byte offset)``: :attr:`span_copies`, then a byte
        view of each direct tensor (made at each access: for tests and tools, not the save path)."""
        out = list(self.span_copies)
        if self.layout is not None:
            for t, (off, _dtype, _size, _stride) in zip(self.direct, self.layout.direct_dst):
                out.append((t.detach().reshape(-1).view(torch.uint8), off))
        return out


_VIEWS_KEPT = 4  # layouts whose slot views a mapping keeps (as the Stager's plan cache)


class _Ways:
    """Which way copies a layout's large direct tensors: ``"torch"`` (one ``torch._foreach_copy_``: an OpenMP region
    per tensor, the fastest on idle cores) or ``"mover"`` (:mod:`snapckpt.engine.mover`: chunks by ``memmove`` that
    threads take in turn, 2-3x faster when other processes hold the cores, about 4% slower on idle ones; measured in
    docs/performance.md). The first two timed copies try one way each; then the way with the lower median of its last
    :data:`KEPT` copies is used, and every :data:`TRY_EVERY`-th copy tries the other way, so that a host whose load
    changes gets the other way back. Seconds only compare copies of the same layout (the same bytes)."""

    KEPT = 3
    TRY_EVERY = 16

    def __init__(self) -> None:
        self.secs: Dict[str, List[float]] = {"torch": [], "mover": []}
        self.picks = 0

    def pick(self) -> str:
        """The way of the next copy."""
        self.picks += 1
        torch_s, mover_s = self.secs["torch"], self.secs["mover"]
        if not torch_s or not mover_s:
            return "torch" if not torch_s else "mover"
        best = "torch" if sorted(torch_s)[len(torch_s) // 2] <= sorted(mover_s)[len(mover_s) // 2] else "mover"
        if self.picks % self.TRY_EVERY == 0:
            return "mover" if best == "torch" else "torch"
        return best

    def record(self, way: str, secs: float) -> None:
        """A copy by ``way`` took ``secs`` seconds."""
        kept = self.secs[way]
        kept.append(secs)
        del kept[:-self.KEPT]


@dataclass(frozen=True)
class _Sizes:
    """A layout's direct tensors by size, the one partition its copy plans are cut from (:func:`_sizes`).

    Attributes:
        small: positions (in the direct list, ascending) of the tensors under
            :data:`~snapckpt.engine.span_write.SMALL_NBYTES` bytes: those a save by file may write by ``pwritev``.
        large: positions of the others of at least :data:`~snapckpt.engine.mover.MIN_TENSOR_NBYTES` bytes: copied by
            torch or by :mod:`snapckpt.engine.mover`, whichever was faster lately (:class:`_Ways`).
        nbytes: each direct tensor's size in bytes.
    """

    small: Tuple[int, ...]
    large: Tuple[int, ...]
    nbytes: Tuple[int, ...] = ()


def _sizes(layout: _Layout) -> _Sizes:
    """``layout``'s :class:`_Sizes` (made once per layout)."""
    if layout.sizes is None:
        dst = layout.direct_dst
        nbytes = list(map(mul, map(_ITEMSIZE, map(itemgetter(1), dst)), map(math.prod, map(itemgetter(2), dst))))
        small = tuple(j for j, n in enumerate(nbytes) if n < SMALL_NBYTES)  # a direct tensor is never empty
        large = tuple(j for j, n in enumerate(nbytes) if n >= max(mover.MIN_TENSOR_NBYTES, SMALL_NBYTES))
        layout.sizes = _Sizes(small, large, tuple(nbytes))
    return layout.sizes


@dataclass(eq=False)
class _CopyStep:
    """One step of a :class:`_CopyPlan`.

    Attributes:
        kind: ``"spans"`` (the span copies ``pick`` selects, a slice: bytes of a storage, CUDA ones among them),
            ``"torch"`` (one ``_foreach_copy_`` of the direct tensors that ``pick`` takes from a list of them),
            ``"write"`` (the plan's :class:`SpanWrites` by ``pwritev``), ``"large"`` (the direct tensors ``pick`` takes
            by torch or in chunks by :mod:`snapckpt.engine.mover`, :class:`_Ways`) or ``"fault"`` (the mid-copy fault
            point).
        pick: see ``kind``: a callable (a list -> its items of this step) or a slice.
        offsets: ``"large"``: the slot byte offsets of its tensors (the mover's destinations).
        at, mid: ``"write"`` holding the fault point: the call before which it fires, and the first span (position
            in ``SpanWrites.pos``) of that call; ``None`` otherwise.
        chunks: ``"large"``: ``(slot address, source addresses, mover chunks)`` of its last copy by the mover, reused
            while both addresses stay (the data pointers are all that changes between saves).
        items: ``"torch"``: its positions in the direct list.
        moves: ``"torch"``: ``(slot address, the save's data pointers, memmove arguments)`` of its last copy by
            ``memmove`` (:meth:`memmoves`), reused while the slot and the pointers list are the same objects.
    """

    kind: str
    pick: Any = None
    offsets: Tuple[int, ...] = ()
    at: Optional[int] = None
    mid: Optional[int] = None
    chunks: Optional[tuple] = None
    items: Sequence[int] = ()
    moves: Optional[tuple] = None

    def memmoves(self, base: int, ptrs: List[int], layout: "_Layout") -> List[Tuple[int, int, int]]:
        """``(slot address, source address, nbytes)`` of each direct tensor of this ``"torch"`` step, for a slot
        at address ``base`` and the save's data pointers ``ptrs`` (collection order, :attr:`Prepared.ptrs`)."""
        last = self.moves
        if last is None or last[0] != base or last[1] is not ptrs:
            dst, direct, nbytes = layout.direct_dst, layout.direct, _sizes(layout).nbytes
            last = self.moves = (base, ptrs, [(base + dst[j][0], ptrs[direct[j]], nbytes[j]) for j in self.items])
        return last[2]

    def mover_chunks(self, base: int, srcs: List[torch.Tensor]) -> list:
        """The mover's chunks copying ``srcs`` (this step's sources) into the slot at address ``base``."""
        ptrs = list(map(_DATA_PTR, srcs))
        last = self.chunks
        if last is None or last[0] != base or last[1] != ptrs:
            last = self.chunks = (base, ptrs, mover.chunks_of([base + off for off in self.offsets], srcs))
        return last[2]


@dataclass(eq=False)
class _CopyPlan:
    """How a non-streamed save of a layout copies its spans into the slot: :attr:`steps` in order (made once per
    layout, :func:`_copy_plan`; a save only fills in its addresses), walked by :meth:`Stager._copy_planned`.

    The span copies come first, then the direct tensors copied by torch (mid-sized ones, small ones outside long runs
    or without a slot file), then the small ones by ``pwritev`` (:attr:`writes`), then the large ones. Exactly one
    step holds the mid-copy fault point: the one at which half of the tensors (span copies and direct tensors, in
    that order) are copied, split around it (a ``"fault"`` step), or a ``"write"`` step, which fires it between its
    calls. A layout with no tensor has no step.
    """

    steps: List[_CopyStep]
    writes: Optional[SpanWrites]


def _picker(items: Sequence[int], n: int) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """A function that takes the items at positions ``items`` (ascending, not empty) of a sequence of ``n``."""
    first, count = items[0], len(items)
    if items[-1] - first + 1 == count:  # a run: a slice (the whole list as it is)
        return _same if count == n else itemgetter(slice(first, first + count))
    return itemgetter(*items) if count > 1 else (lambda seq: [seq[first]])


def _same(seq: Sequence[Any]) -> Sequence[Any]:
    return seq


def _copy_plan(layout: _Layout, by_file: bool) -> _CopyPlan:
    """``layout``'s :class:`_CopyPlan` for a save through the mapping only or one that may write by file
    (``by_file``: the save knows the slot file and its data pointers), made at its first such save."""
    plan = layout.copy_plans[by_file]
    if plan is None:
        plan = layout.copy_plans[by_file] = _build_copy_plan(layout, by_file)
    return plan


def _build_copy_plan(layout: _Layout, by_file: bool) -> _CopyPlan:
    """A new :class:`_CopyPlan` of ``layout`` (see :func:`_copy_plan`); the first by file makes the layout's
    :attr:`~_Layout.span_writes` from its :class:`_Sizes`."""
    sizes, n = _sizes(layout), len(layout.direct_dst)
    if by_file and layout.span_writes is None:
        layout.span_writes = SpanWrites.make(layout.direct, layout.direct_dst, sizes.small) or False
    writes = (layout.span_writes or None) if by_file else None
    others = set(sizes.large).union(writes.pos if writes else ())
    by_torch = [j for j in range(n) if j not in others] if others else range(n)
    parts = [("spans", range(len(layout.spans))), ("torch", by_torch), ("write", writes.pos if writes else ()),
             ("large", sizes.large)]
    half = (len(layout.spans) + n) // 2  # the fault point's tensor, counted in the order of the steps
    steps: List[_CopyStep] = []
    for kind, items in parts:
        here = 0 <= half < len(items)
        if kind == "write" and items:
            step = _CopyStep("write")
            if here:  # between two calls: the first of the call that holds that span
                step.at = bisect.bisect_right([b[0] for b in writes.batches], half) - 1
                step.mid = writes.batches[step.at][0]
            steps.append(step)
        else:
            cut = half if here else len(items)
            steps += [_copy_step(kind, part, layout, n) for part in (items[:cut], items[cut:]) if part]
            if here:
                steps.insert(len(steps) - 1, _CopyStep("fault"))
        half -= len(items)
    return _CopyPlan(steps, writes)


def _copy_step(kind: str, items: Sequence[int], layout: _Layout, n: int) -> _CopyStep:
    """The :class:`_CopyStep` of ``kind`` over ``items`` (span copy indices, or positions in the direct list of
    ``n``)."""
    if kind == "spans":
        return _CopyStep(kind, slice(items[0], items[-1] + 1))
    offsets = tuple(layout.direct_dst[j][0] for j in items) if kind == "large" else ()
    return _CopyStep(kind, _picker(items, n), offsets, items=items if kind == "torch" else ())


def direct_views(layout: _Layout, slot: torch.Tensor, cache: Optional[Dict[Any, List[torch.Tensor]]]
                  ) -> List[torch.Tensor]:
    """The typed views of ``slot`` that ``layout``'s direct tensors are copied into (cached per mapping)."""
    views = cache.get(layout) if cache is not None else None
    if views is not None:
        return views
    bases: Dict[torch.dtype, torch.Tensor] = {}
    views = []
    for off, dtype, size, stride in layout.direct_dst:
        base = bases.get(dtype)
        if base is None:
            es = dtype.itemsize
            base = bases[dtype] = slot[:slot.numel() // es * es].view(dtype)
        views.append(base.as_strided(size, stride, off // dtype.itemsize))
    if cache is not None:
        while len(cache) >= _VIEWS_KEPT:
            cache.pop(next(iter(cache)))
        cache[layout] = views
    return views


def _warn_if_unsafe(name: str, pkl: bytes, warned: set) -> None:
    """Log one warning if ``load()`` with ``weights_only=True`` would refuse this skeleton, unless the same
    reason was already logged (``warned``: the reasons logged so far, updated)."""
    why = weights_only_refusal(pkl)
    if why is None or why in warned:
        return
    warned.add(why)
    log.warning(
        "%s: this state saves, but load() will refuse it: the Checkpointer loads with weights_only=True and "
        "torch says: %s Fix: convert such values to tensors or plain types before saving (a numpy array: "
        "torch.from_numpy(a); an argparse.Namespace: vars(ns)), or, if you trust the checkpoint directory, "
        "pass weights_only=False to the Checkpointer or allow the class with "
        "torch.serialization.add_safe_globals([...]) before load(). (Checked once per state layout.)",
        name, why.split(" Please use")[0].rstrip(".") + ".")


def _unpicklable_error(name: str, obj: Any, err: BaseException) -> SnapshotError:
    """A :class:`SnapshotError` naming the key path of the first value of ``obj`` that cannot be pickled."""
    found = find_unpicklable(obj)
    where, value, cause = found if found is not None else ("state", obj, err)
    return SnapshotError(
        f"{name}: {where} cannot be pickled ({type(value).__name__}: {type(cause).__name__}: {cause}); a "
        "checkpoint holds tensors, numbers, strings and containers of them (and other picklable objects): "
        "remove that value from the state, or replace it with something picklable (a function by its name, "
        "a config as a dict)")


@dataclass
class _FileMemo:
    """What the Stager keeps of one plain file's walk between saves.

    Attributes:
        key: the :func:`plain_layout` key of its last walked save.
        memo: its :class:`LayoutMemo`, made once two saves in a row walked to keys of equal structure (values
            aside: :func:`split_key`), ``None`` before.
        memoizable: ``False`` once a memo could not be made of this structure (a container or tensor met twice):
            not tried again until the structure changes.
        structure: ``split_key(key)[0]``, once computed (``None`` before).
        split: ``(memo, the structure of its key, the key positions of its values in key order, the marker ids
            before them)``, made with the memo (:func:`_memo_split`): :func:`split_key` of a key the memo found,
            without its passes over the key (``None`` before).
        in_place: made with the memo: whether :func:`~snapckpt.engine.restore.copy_into` copies every tensor of a
            state of its structure in place (:func:`_all_in_place`; ``None`` before), which an in-process restore
            asks (:meth:`Stager.live_match`) instead of walking the state.
    """

    key: List[Any]
    memo: Optional[LayoutMemo] = None
    memoizable: bool = True
    structure: Optional[List[Any]] = None
    split: Optional[tuple] = None
    in_place: Optional[bool] = None


def _memo_split(memo: LayoutMemo, structure: Optional[List[Any]] = None) -> tuple:
    """A :attr:`_FileMemo.split` of ``memo`` (``structure``: ``split_key(memo.key)[0]`` when known, else computed:
    one pass over a key of millions of items, 10 ms for 20,000 tensors)."""
    at = sorted(memo.value_at)  # every value's item, in key order (split_key's)
    return (memo, split_key(memo.key)[0] if structure is None else structure, at, [id(memo.key[p - 1]) for p in at])


def _all_in_place(obj: Any, tensors: List[torch.Tensor]) -> bool:
    """Whether :func:`~snapckpt.engine.restore.copy_into` copies each of ``tensors`` (``obj``'s, in walking order) in
    place: all of them are reached through dicts only (a property of ``obj``'s structure)."""
    dsts: List[torch.Tensor] = []
    copied_in_place(obj, dsts)
    return len(dsts) == len(tensors) and all(map(is_, dsts, tensors))


class Stager:
    """Turns ``{relative file path: object}`` into slot bytes. One per training process and rank.

    The plan cache holds the plans of the last few layouts (a state that alternates between two layouts,
    such as memory and disk snapshots of different contents, keeps both).
    """

    def __init__(self, cache_size: int = 4) -> None:
        self._layouts: Dict[tuple, _Layout] = {}  # signature -> layout, oldest first
        self._cache_size = cache_size
        self.plan_builds = 0  # how many plans were built (observable by tests of contract 3)
        self._unsafe_warned: set = set()  # weights_only refusals already warned about
        self._memos: Dict[str, _FileMemo] = {}  # per plain file: what its next save may reuse of its walk

    def _plan_for(self, tensors: List[torch.Tensor], check_repeats: bool = False) -> Optional[Tuple[_Layout, bool]]:
        """The layout of these tensors and whether it was built now (not found in the cache). With
        ``check_repeats`` (tensors from a memo's match that left that check here): ``None`` when a tensor object
        occurs twice, checked only when no quick check hits (a hit rules a repeat out, :class:`_Recheck`).

        A cached layout is found by its quick check (:class:`_Recheck`), else by the full :func:`_signature`;
        a layout found by its signature gets a new quick check, at most ``_RECHECKS_KEPT`` in its life (one
        whose check keeps missing, for something the signature does not hold, goes on by the signature alone
        instead of paying for a check per save).

        Raises:
            SnapshotError: a tensor snapckpt cannot snapshot (checked when a plan is built), or one whose storage was
                freed (:func:`_check_storages`).
        """
        try:
            for cached in reversed(self._layouts.values()):  # newest first
                r = cached.recheck
                if r is not None and r.matches(tensors):
                    return cached, False
            if check_repeats and has_repeats(tensors):
                return None
            sig = _signature(tensors)
        except RuntimeError:  # no strides or storage (sparse, nested): say which tensor and why
            for t in tensors:
                _check_supported(t)
            raise
        layout = self._layouts.get(sig)
        built = layout is None
        if layout is None:
            for t in tensors:
                _check_supported(t)
            layout = _layout(tensors, _build_plan(tensors))
            self.plan_builds += 1
            if len(self._layouts) >= self._cache_size:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[sig] = layout
        if _TensorGuards is None:
            return layout, built
        if layout.rechecks_made >= _RECHECKS_KEPT:
            layout.recheck = None
            return layout, built
        layout.rechecks_made += 1
        try:
            layout.recheck = _Recheck(tensors, sig, layout.direct_all)
        except Exception:  # noqa: BLE001 - a tensor the guards do not take: the full key every save
            layout.recheck, layout.rechecks_made = None, _RECHECKS_KEPT
        return layout, built

    def _plain_layout(self, name: str, obj: Any, distinct_tensors: bool = True
                      ) -> Optional[Tuple[List[torch.Tensor], List[Any], bool, Optional[List[Any]], Optional[tuple]]]:
        """:func:`plain_layout` of file ``name``'s ``obj``, by its :class:`LayoutMemo` while the structure is
        the one of the memo, whatever its atomic values (a step counter, a loss). A memo is made once two saves in
        a row walk to keys of equal structure (:func:`split_key`: the same keys, containers, tensors' places and
        value types), so a state whose structure changes every save is walked each time and never pays for one.
        ``distinct_tensors=False``: see :meth:`LayoutMemo.match`. Returns ``(tensors, key, whether the memo found
        them, the values a load replaces or None, split_key(key) or None)`` (the last two when the memo found them,
        without a pass over the state or the key: the values as :func:`snapckpt.engine.plain_values.entries` finds
        them, for :func:`_plain_head`; the key's structure and values, for :func:`_pickle_file`), or ``None`` when
        ``obj`` is not plain."""
        fm = self._memos.get(name)
        if fm is not None and fm.memo is not None:
            replaced: List[Any] = []
            found = fm.memo.match(obj, distinct_tensors, replaced)
            if found is not None:
                if fm.split is None or fm.split[0] is not fm.memo:
                    fm.split = _memo_split(fm.memo)
                _, structure, at, markers = fm.split
                values = list(zip(markers, map(found[1].__getitem__, at)))
                return found[0], found[1], True, replaced, (structure, values)
        walked = plain_layout(obj)
        self._memos.pop(name, None)
        if walked is None:
            return None
        structure = None
        if fm is not None and fm.key != walked[1]:
            if fm.structure is None:
                fm.structure = split_key(fm.key)[0]
            structure = split_key(walked[1])[0]
            if structure != fm.structure:
                fm = None
        if fm is not None:  # the structure of the last walk: a memo finds the next save's values by their places
            fm.key = walked[1]
            if fm.memoizable:
                fm.memo = LayoutMemo.build(obj, *walked)
                fm.memoizable = fm.memo is not None
                if fm.memo is not None:  # now, in a save that walks anyway: the memo's first match makes none
                    fm.split = _memo_split(fm.memo, structure)
                    fm.in_place = _all_in_place(obj, walked[0])
        else:
            fm = _FileMemo(walked[1], structure=structure)
        if len(self._memos) >= 4 * self._cache_size:
            self._memos.pop(next(iter(self._memos)))
        self._memos[name] = fm
        return walked[0], walked[1], False, None, None

    def live_layout(self, name: str, obj: Any, distinct_tensors: bool = True
                    ) -> Optional[Tuple[List[torch.Tensor], List[Any]]]:
        """:func:`plain_layout` of ``obj`` as file ``name`` (by its memo when the structure is the memo's), without
        changing what the next save of ``name`` reuses; ``None`` when ``obj`` is not plain.
        ``distinct_tensors=False``: see :meth:`LayoutMemo.match` and :func:`plain_layout` (the caller checks for a
        tensor met twice)."""
        found = self.live_match(name, obj, distinct_tensors)
        return None if found is None else found[:2]

    def live_match(self, name: str, obj: Any, distinct_tensors: bool = True
                   ) -> Optional[Tuple[List[torch.Tensor], List[Any], Optional[bool]]]:
        """:meth:`live_layout` and, when the memo found ``obj``, whether :func:`~snapckpt.engine.restore.copy_into`
        copies every tensor of it in place (the memo's :attr:`_FileMemo.in_place`: its structure's); ``None`` in
        that place when a walk found it."""
        fm = self._memos.get(name)
        if fm is not None and fm.memo is not None:
            found = fm.memo.match(obj, distinct_tensors)
            if found is not None:
                return found[0], found[1], fm.in_place
        walked = plain_layout(obj, distinct_tensors)
        return None if walked is None else (walked[0], walked[1], None)

    def prepare(self, files: Mapping[str, Any], step: int, *, check_weights_only: bool = False) -> Prepared:
        """See :meth:`_prepare` (the cyclic garbage collector is paused meanwhile: a state of many tensors makes
        thousands of small objects here, which would otherwise start full collections on the training thread)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._prepare(files, step, check_weights_only=check_weights_only)
        finally:
            if enabled:
                gc.enable()

    def _prepare(self, files: Mapping[str, Any], step: int, *, check_weights_only: bool = False) -> Prepared:
        """Plan a snapshot of ``files`` (``{relative path: value}``) at ``step``.

        A value is a file spec of :mod:`snapckpt.formats.specs` (a plain object is a ``TorchSave``). Every
        tensor of every file joins one plan, so a storage shared between files is copied once. A later save
        of the same layout reuses the plan; when every file is a plain ``TorchSave``
        (:func:`~snapckpt.formats.plain_layout.plain_layout`) with the same non-tensor values, it reuses the
        pickled skeletons and the index too, so its Python work per tensor is a few C calls; when only its
        non-tensor values changed (a step counter, a loss), its skeleton is spliced from a template
        (:func:`_pickle_file`) instead of pickled again.

        With ``check_weights_only``, the first time a plan is built (a new layout of tensors, not every
        save) each pickled skeleton is run through PyTorch's weights-only unpickler (no tensor bytes); if
        ``load()`` with ``weights_only=True`` would refuse it, a warning names the offending global and
        the fix (once per distinct reason for the life of this Stager).

        Raises:
            SnapshotError: an unsupported tensor or dtype-aliased storage, or a value that cannot be pickled
                (a lambda, a lock, an open file: the message names its key path).
        """
        specs = []
        per_file_tensors: List[List[torch.Tensor]] = []
        keys: List[Any] = []  # per file: its plain_layout key, or None (its skeleton is pickled every save)
        splits: List[Optional[tuple]] = []  # per file: split_key of its key when its memo found it, or None
        plain_files: set = set()
        # One file (its tensors are the plan's): a memo's match leaves the check for a tensor met twice to the plan's
        # quick check, which makes it anyway (below).
        one_file = len(files) == 1
        unchecked = False  # the one file's tensors came from a memo's match that left the repeat check to us
        replaced = None  # the one file's values a load replaces, when its memo found them (for _plain_head)
        for name, value in files.items():
            spec, persist = unwrap(value)
            if isinstance(spec, RawBytes):
                spec = Concat([bytes(spec.data)], spec.mode)
            specs.append((spec, persist))
            if isinstance(spec, TorchSave):
                walked = self._plain_layout(name, spec.obj, distinct_tensors=not one_file)
                if walked is not None:  # only containers, tensors and atomic values: weights_only loads it
                    per_file_tensors.append(walked[0])
                    keys.append(walked[1])
                    splits.append(walked[4])
                    unchecked = one_file and walked[2]
                    replaced = walked[3] if one_file else None
                    plain_files.add(name)
                    continue
                keys.append(None)
                splits.append(None)
                try:
                    per_file_tensors.append(collect_tensors(spec.obj))
                except SnapshotError:
                    raise
                except Exception as e:  # noqa: BLE001 - pickle raises PicklingError, TypeError, AttributeError...
                    raise _unpicklable_error(name, spec.obj, e) from e
            else:
                keys.append(None)
                splits.append(None)
                ts = [p for p in spec.parts if isinstance(p, torch.Tensor)]
                for t in ts:
                    _check_concat_tensor(t)
                per_file_tensors.append(ts)
        if len(per_file_tensors) == 1:
            all_tensors = per_file_tensors[0]  # each once already
            seen: Optional[Dict[int, int]] = None
        else:
            all_tensors, seen = [], {}
            for ts in per_file_tensors:
                for t in ts:
                    if id(t) not in seen:
                        seen[id(t)] = len(all_tensors)
                        all_tensors.append(t)
        found = self._plan_for(all_tensors, check_repeats=unchecked)
        if found is None:  # a tensor met twice: the memo's key is not this state's (a walk marks the repeat)
            self._memos.pop(next(iter(files)), None)
            return self._prepare(files, step, check_weights_only=check_weights_only)
        layout, new_plan = found
        plan = layout.plan
        copies = []
        for s, i in layout.spans:
            t = all_tensors[i]
            if not new_plan:
                _check_supported(t)
            span = plan.spans[s]
            copies.append((torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                t.untyped_storage(), span.start_nbytes, (span.nbytes,), (1,)), span.arena_offset))
        direct = all_tensors if layout.direct_all else [all_tensors[i] for i in layout.direct]
        tail_key = None
        if all(k is not None for k in keys):
            tail_key = [list(files.keys()), [(p, spec.mode) for spec, p in specs], keys]
            if len(per_file_tensors) > 1:  # which tensor of the plan each file's tensor is
                tail_key.append([[seen[id(t)] for t in ts] for ts in per_file_tensors])  # type: ignore[index]
        if tail_key is None or tail_key != layout.tail_key:
            tail, files_json, tail_end = self._skeletons(files, specs, per_file_tensors, plan, seen, plain_files,
                                                         check_weights_only and new_plan, keys, layout.pickles,
                                                         splits, layout.file_json)
            layout.tail_key, layout.tail, layout.files_json, layout.tail_end = tail_key, tail, files_json, tail_end
            layout.restore_ok = None
            layout.index_head, values = _plain_head(files, specs, keys, layout, direct, replaced)
            for part in values:  # after the pickle, before the index (which says where)
                layout.tail.append((layout.tail_end, part))
                layout.tail_end += len(part)
        tail, offset = list(layout.tail), layout.tail_end
        index = index_bytes(step, layout)  # json.dumps' bytes, the step spliced in
        tail.append((offset, index))
        persistable = not specs or any(persist for _, persist in specs)
        # the quick check's data pointers are this save's tensors' (it read them, or was made from them, just now)
        ptrs = layout.recheck.ptrs if layout.recheck is not None else None
        return Prepared(step, offset + len(index), copies, tail, offset, len(index), layout.tensor_nbytes,
                        persistable, direct, layout, ptrs=ptrs)

    def _skeletons(self, files: Mapping[str, Any], specs: list, per_file_tensors: List[List[torch.Tensor]],
                   plan: Plan, seen: Optional[Dict[int, int]], plain_files: set, check_weights_only: bool,
                   keys: List[Any], pickles: Dict[str, tuple], splits: Optional[List[Optional[tuple]]] = None,
                   file_json: Optional[Dict[Optional[str], tuple]] = None
                   ) -> Tuple[List[Tuple[int, bytes]], bytes, int]:
        """Pickle each file's skeleton and lay out the tail: ``(pickles and raw parts as (slot offset, bytes),
        the index's "files" JSON, the first byte after them)``. ``seen``: each tensor's plan index by ``id``, or
        ``None`` for one file (whose tensors are the plan's, in order). A plain file's pickle is reused from
        ``pickles`` (``path -> (plain_layout key, its tensors' plan indices, pickle, span keys, value template, key
        structure, the index's JSON of its records)``, updated) while its key and tensors are those of the last
        pickle (a save that also writes changing raw bytes, such as the Hugging Face callback's, pickles only what
        changed), and spliced from the template when only its non-tensor values changed (:func:`_pickle_file`);
        its records' JSON is kept while its span keys stay. ``splits``: per file, :func:`split_key` of its key when
        known without a pass over it, else ``None`` (or no list). ``file_json``: the last index JSON of each file
        (``path -> (its JSON without records, the records' JSON, the file's JSON)``) and of them all (``None ->
        (the files' JSON, the "files" bytes)``), reused while equal (updated; ``None``: none kept)."""
        if file_json is None:
            file_json = {}
        offset = plan.data_end
        tail: List[Tuple[int, bytes]] = []
        index_files: List[str] = []  # each file's JSON object
        by_key: Dict[str, _Span] = {}
        if seen is None and not all(isinstance(spec, TorchSave) for spec, _ in specs):
            seen = {id(t): i for i, t in enumerate(per_file_tensors[0])}
        if splits is None:
            splits = [None] * len(keys)
        for path, (spec, persist), ts, key, split in zip(files.keys(), specs, per_file_tensors, keys, splits):
            if isinstance(spec, TorchSave):
                # one file: its tensors are the plan's, in order (a range: compared with the last one's in O(1))
                idx = range(len(ts)) if seen is None else list(map(seen.__getitem__, map(id, ts)))
                hit = pickles.get(path) if key is not None else None
                if hit is not None and hit[0] == key and hit[1] == idx:
                    pkl, skeys, records = hit[2], hit[3], hit[6]
                else:
                    pkl, skeys, template, structure = _pickle_file(
                        spec.obj, key, idx, hit, lambda: {id(t): plan.refs[i] for t, i in zip(ts, idx)}, split)
                    records = hit[6] if hit is not None and hit[1] == idx and hit[3] == skeys else None
                if records is None:
                    if not by_key:
                        by_key = {s.key: s for s in plan.spans}
                    records = json.dumps([[k, by_key[k].arena_offset, by_key[k].nbytes] for k in skeys],
                                         separators=(",", ":"))
                if key is not None and (hit is None or hit[2] is not pkl):
                    pickles[path] = (key, idx, pkl, skeys, template, structure, records)
                if check_weights_only and path not in plain_files:
                    _warn_if_unsafe(path, pkl, self._unsafe_warned)
                tail.append((offset, pkl))
                entry = {"path": path, "kind": "torch", "persist": persist, "pkl": [offset, len(pkl)], "records": None,
                         **_mode(spec)}
                offset += len(pkl)
                head = json.dumps(entry, separators=(",", ":"))
                last = file_json.get(path)
                if last is not None and last[1] is records and last[0] == head:
                    index_files.append(last[2])  # the last save's (records of 200,000 spans: megabytes)
                    continue
                # the records' JSON put in whole (json.dumps' own bytes: a string's quote is escaped, so this is
                # the entry's one ``"records":null``)
                index_files.append(head.replace('"records":null', '"records":' + records, 1))
                file_json[path] = (head, records, index_files[-1])
                continue
            chunks = []
            for part in spec.parts:
                if isinstance(part, torch.Tensor):
                    i = seen[id(part)]  # type: ignore[index]
                    span = plan.spans[plan.tensor_span[i]]
                    start = span.arena_offset + part.storage_offset() * part.element_size() - span.start_nbytes
                    chunks.append([start, part.numel() * part.element_size()])
                else:
                    tail.append((offset, part))
                    chunks.append([offset, len(part)])
                    offset += len(part)
            index_files.append(json.dumps({"path": path, "kind": "bytes", "persist": persist, "chunks": chunks,
                                           **_mode(spec)}, separators=(",", ":")))
        last = file_json.get(None)  # the last "files" JSON
        if last is not None and len(last[0]) == len(index_files) and all(map(is_, last[0], index_files)):
            return tail, last[1], offset
        files_json = ("[" + ",".join(index_files) + "]").encode()
        file_json[None] = (index_files, files_json)
        return tail, files_json, offset

    @staticmethod
    def begin_stream(prepared: Prepared, buf) -> None:
        """First part of a streamed copy (a DISK save whose persister writes while the spans are copied): clear
        the header (and with it the watermark) and write the pickles and the index, which the persister reads
        before any span. :meth:`copy_into` then publishes the watermark (``prepared.streamed``)."""
        prepared.streamed = True
        buf[0:HEADER_NBYTES] = bytes(HEADER_NBYTES)
        for off, data in prepared.tail:
            buf[off:off + len(data)] = data

    @staticmethod
    def copy_into(prepared: Prepared, slot: torch.Tensor, buf, device_done=None) -> None:
        """Copy a prepared snapshot into a slot.

        Args:
            prepared: from :meth:`prepare`.
            slot: a uint8 tensor viewing the whole mapped slot (``torch.frombuffer`` of ``buf``).
            buf: the writable mapping itself (for the header and the tail bytes).
            device_done: the event of CUDA copies already queued for this snapshot
                (:meth:`snapckpt.engine.device_copy.CudaCopier.start`): CUDA sources are then skipped here, and
                the event is waited for before the header is written. ``None``: every span is copied here,
                synchronously, whatever its device.

        With ``prepared.streamed`` (:meth:`begin_stream` ran), the spans are copied in ascending slot offset and
        the watermark (:mod:`snapckpt.persister.arena`) is published after each batch of about
        :data:`STREAM_BATCH_NBYTES`; CPU sources only (``device_done`` must be ``None``).
        """
        if prepared.streamed:
            Stager._copy_streamed(prepared, slot, buf)
            write_header(buf, prepared.step, prepared.index_offset, prepared.index_nbytes)
            return
        # A reused slot still carries the header of the snapshot it held: it goes first, so that the slot's
        # own bytes never describe a half-overwritten snapshot as complete (the header is written last).
        buf[0:HEADER_NBYTES] = bytes(HEADER_NBYTES)
        layout = prepared.layout
        by_file = prepared.slot_file is not None and prepared.ptrs is not None
        plan = _copy_plan(layout, by_file)
        reused = prepared.views is not None and layout in prepared.views  # not the mapping's first copy
        dst = direct_views(layout, slot, prepared.views) if prepared.direct else []
        with torch.no_grad():  # a Parameter's copy must not enter autograd
            Stager._copy_planned(prepared, plan, slot, dst, device_done, reused)
        for off, data in prepared.tail:
            buf[off:off + len(data)] = data
        if device_done is not None:
            device_done.synchronize()
        write_header(buf, prepared.step, prepared.index_offset, prepared.index_nbytes)

    @staticmethod
    def _copy_planned(prepared: Prepared, plan: _CopyPlan, slot: torch.Tensor, dst: List[torch.Tensor],
                      device_done, reused: bool) -> None:
        """Walk ``plan``'s steps for ``prepared`` (``dst``: the slot's views of its direct tensors; ``device_done``: see
        :meth:`copy_into`). The large tensors go the way :class:`_Ways` picks, timed, and the time is recorded when
        ``reused`` (a first copy into a mapping takes its page faults: not a fair sample)."""
        src, ways = prepared.direct, prepared.layout.ways
        way, secs = None, 0.0
        # the direct tensors' data pointers were read by this save's check (so are not null) and the copy runs on the
        # thread that waits for it: by memmove (mover.move_each), the slot's address and the pointers cached per step
        ptrs = prepared.ptrs if prepared.on_caller else None
        for step in plan.steps:
            kind = step.kind
            if kind == "torch":
                if ptrs is not None:
                    mover.move_each(step.memmoves(slot.data_ptr(), ptrs, prepared.layout))
                else:
                    torch._foreach_copy_(step.pick(dst), step.pick(src))
            elif kind == "spans":
                for t, off in prepared.span_copies[step.pick]:
                    n = t.numel()
                    if n and not (device_done is not None and t.is_cuda):
                        slot[off:off + n].copy_(t)
            elif kind == "write":
                Stager._write(prepared, plan.writes, step, dst)
            elif kind == "fault":
                faults.point("snapshot.mid_copy", step=prepared.step)
            else:  # "large"
                if way is None:
                    way = ways.pick()
                t0 = time.perf_counter()
                if way == "torch":
                    torch._foreach_copy_(step.pick(dst), step.pick(src))
                else:
                    mover.copy_chunks(step.mover_chunks(slot.data_ptr(), step.pick(src)))
                secs += time.perf_counter() - t0
        if way is not None and reused:
            ways.record(way, secs)

    @staticmethod
    def _write(prepared: Prepared, writes: SpanWrites, step: _CopyStep, dst: List[torch.Tensor]) -> None:
        """A ``"write"`` step: the small tensors of ``writes`` by ``pwritev`` of the slot file
        (:mod:`snapckpt.engine.span_write`); what it did not write (no descriptor, a null data pointer, another file
        at the path, a short write) by ``_foreach_copy_`` through the mapping. The step's fault point fires between
        the calls, or between those copies when the calls did not get that far."""
        src, pos = prepared.direct, writes.pos
        hit: List[bool] = []

        def halfway() -> None:
            hit.append(True)
            faults.point("snapshot.mid_copy", step=prepared.step)

        done = 0
        if writes.fill(prepared.ptrs):  # type: ignore[arg-type]
            done = write_spans(prepared.slot_file.descriptor(writes.end), writes, step.at, halfway)  # type: ignore[union-attr]
        if done == len(pos):
            return
        cuts = [done, len(pos)]
        if step.mid is not None and not hit:
            cuts.insert(1, max(done, step.mid))
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            if k:
                halfway()
            if a < b:
                torch._foreach_copy_([dst[pos[j]] for j in range(a, b)], [src[pos[j]] for j in range(a, b)])

    @staticmethod
    def _copy_streamed(prepared: Prepared, slot: torch.Tensor, buf) -> None:
        """The spans of a streamed copy, in :func:`_stream_steps` order, each batch followed by its watermark."""
        layout = prepared.layout
        steps = _stream_steps(layout)
        dst = direct_views(layout, slot, prepared.views) if prepared.direct else []
        src, spans = prepared.direct, prepared.span_copies
        mark = watermark_view(buf)
        try:
            with torch.no_grad():  # a Parameter's copy must not enter autograd
                for n, step in enumerate(steps):
                    if n == len(steps) // 2:
                        faults.point("snapshot.mid_copy", step=prepared.step)
                    kind, i, a = step[0], step[1], step[2]
                    if kind == "direct":
                        torch._foreach_copy_(dst[i:a], src[i:a])
                    elif kind == "piece":
                        dst[i].view(-1)[a:step[3]].copy_(src[i].reshape(-1)[a:step[3]])
                    else:
                        t, off = spans[i]
                        slot[off + a:off + step[3]].copy_(t[a:step[3]])
                    mark[0] = step[-1]  # after the copies returned: the bytes below are final
        finally:
            mark.release()


def _pickle_file(obj: Any, key: Optional[List[Any]], idx: Sequence[int], hit: Optional[tuple],
                 refs: Callable[[], Dict[int, TensorRef]], split: Optional[tuple] = None
                 ) -> Tuple[bytes, List[str], Any, Optional[List[Any]]]:
    """``(pickle, span keys, template, key structure)`` of a file's ``obj`` (``plain_layout`` key ``key`` or
    ``None``, tensors at plan indices ``idx``, ``refs()`` their refs: made only when something is pickled) whose
    last pickle was ``hit`` (a ``pickles`` entry or ``None``). When ``hit`` differs from ``obj`` in non-tensor values
    only (:func:`split_key`), the pickle is spliced from a :class:`~snapckpt.formats.value_splice.ValueTemplate`:
    made by the first such save (one pickle of a copy of the state with markers for its values, instead of the
    pickle of the state) and kept while the structure stays (``False``: none can be made of it). Otherwise ``obj``
    is pickled (template ``None``; the structure is computed only when a later save needs it). ``split``:
    ``split_key(key)`` when known (a memo found ``key``), else ``None``."""
    if key is not None and hit is not None and hit[1] == idx:
        structure, values = split_key(key) if split is None else split
        template = hit[4]
        if hit[5] is None:  # the last pickle was a full one: its structure was not computed
            template = None if split_key(hit[0])[0] != structure else (
                ValueTemplate.build(obj, key, lambda shadow: pickle_skeleton(shadow, refs())) or False)
        elif hit[5] != structure:
            template = None
        if template:
            return template.splice(values), template.keys, template, structure
        if template is False:
            pkl, skeys = pickle_skeleton(obj, refs())
            return pkl, skeys, False, structure
    pkl, skeys = pickle_skeleton(obj, refs())
    return pkl, skeys, None, None


def index_bytes(step: int, layout: _Layout) -> bytes:
    """The slot index of a snapshot of ``step`` with ``layout``'s tail (JSON; ``"plain"`` comes right after the step,
    where :mod:`snapckpt.engine.plain_restore` finds it without parsing the records)."""
    return b'{"v":2,"step":%d,%s"files":%s}' % (step, layout.index_head, layout.files_json)


def _plain_head(files: Mapping[str, Any], specs: list, keys: List[Any], layout: _Layout,
                direct: Sequence[torch.Tensor], replaced: Optional[List[Any]] = None) -> Tuple[bytes, List[bytes]]:
    """``(the index's "plain":"<hex>","values":[<offset>,<nbytes>],"table":[<offset>,<nbytes>], entries, the values'
    bytes and the table's, written in that order)`` when the snapshot is one plain file whose every tensor is its
    own whole CPU span and whose replaced values hold no tensor (:mod:`snapckpt.formats.plain_digest`, :mod:`snapckpt.engine.plain_values`;
    the bytes go at ``layout.tail_end``; no ``"table"`` when :func:`shape_table` gives none); ``(b"", [])``
    otherwise. ``replaced``: those values when the file's memo found them (no walk), else ``None``."""
    if len(keys) != 1 or keys[0] is None or not layout.direct_all:
        return b"", []
    values = pack(specs[0][0].obj) if replaced is None else pack_values(replaced)
    if values is None:
        return b"", []
    if layout.plain_part is None:
        facts = Facts(direct)
        layout.plain_part = tensor_part(facts, [d[0] for d in layout.direct_dst])
        layout.plain_table = shape_table(direct, facts)
    name = next(iter(files))
    entry = layout.pickles.get(name)  # its key structure, when this save's skeleton was spliced (_pickle_file)
    structure = entry[5] if entry is not None and entry[0] is keys[0] else None
    if structure is not None and layout.plain_hex is not None and layout.plain_hex[:2] == (name, structure):
        hexd = layout.plain_hex[2]  # the digest covers the structure and the values' types, not the values
    else:
        levels = plain_levels.walk(specs[0][0].obj)
        if levels is None:  # not a dict at the top, or nested deeper than 100: no restart takes it
            return b"", []
        hexd = digest(name, levels.structure, layout.plain_part).encode()
        if structure is not None:
            layout.plain_hex = (name, structure, hexd)
    head = b'"plain":"%s","values":[%d,%d],' % (hexd, layout.tail_end, len(values))
    table = layout.plain_table
    if table:
        head += b'"table":[%d,%d],' % (layout.tail_end + len(values), len(table))
    return head, [values, table] if table else [values]  # the table is the layout's own: not copied


def _check_concat_tensor(t: torch.Tensor) -> None:
    _check_supported(t)
    if not t.is_contiguous():
        raise SnapshotError(f"a raw tensor record (shape {tuple(t.shape)}) must be contiguous")


def _mode(spec: Any) -> Dict[str, int]:
    """The slot index's ``"mode"`` entry of a file spec with permission bits (none for the default mode)."""
    return {} if spec.mode is None else {"mode": spec.mode}
