"""How a save copies a layout's spans and direct tensors into its slot: the copy plan, made once per layout.

A :class:`CopyPlan` is a list of :class:`CopyStep` (span copies, one ``torch._foreach_copy_``, ``pwritev`` of the
small tensors, the large ones by torch or :mod:`snapckpt.engine.mover`), cut from the layout's :class:`Sizes`;
:class:`Ways` picks, copy by copy, the faster way for the large tensors. :meth:`Stager._copy_planned
<snapckpt.engine.stager.Stager>` walks the steps with the save's data pointers.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter, mul
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from snapckpt.engine import mover
from snapckpt.engine.span_write import SMALL_NBYTES, SpanWrites

__all__ = ["Ways", "Sizes", "layout_sizes", "CopyStep", "CopyPlan", "copy_plan"]

_ITEMSIZE = attrgetter("itemsize")
_DATA_PTR = torch.Tensor.data_ptr


class _Layout(Protocol):
    """What a copy plan reads of a cached layout (:class:`snapckpt.engine.stager._Layout`), and what it caches there."""

    direct: Tuple[int, ...]  # collection-order index of each direct tensor (a tensor that is a whole span)
    direct_dst: Tuple[Tuple[int, torch.dtype, Tuple[int, ...], Tuple[int, ...]], ...]  # slot offset, dtype, size, stride
    spans: Tuple[Tuple[int, int], ...]  # the span copies
    sizes: Optional["Sizes"]
    copy_plans: List[Optional["CopyPlan"]]
    span_writes: Any  # SpanWrites, False (none) or None (not made yet)


class Ways:
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
class Sizes:
    """A layout's direct tensors by size, the one partition its copy plans are cut from (:func:`layout_sizes`).

    Attributes:
        small: positions (in the direct list, ascending) of the tensors under
            :data:`~snapckpt.engine.span_write.SMALL_NBYTES` bytes: those a save by file may write by ``pwritev``.
        large: positions of the others of at least :data:`~snapckpt.engine.mover.MIN_TENSOR_NBYTES` bytes: copied by
            torch or by :mod:`snapckpt.engine.mover`, whichever was faster lately (:class:`Ways`).
        nbytes: each direct tensor's size in bytes.
    """

    small: Tuple[int, ...]
    large: Tuple[int, ...]
    nbytes: Tuple[int, ...] = ()
    # {(threads, of a subset): (that subset, its mover.Split)}: split()'s, made once per layout
    _splits: Dict[Tuple[int, bool], Tuple[Optional[Sequence[int]], mover.Split]] = field(
        default_factory=dict, compare=False, repr=False)

    def split(self, threads: int, rest: Optional[Sequence[int]] = None) -> mover.Split:
        """How :func:`mover.foreach_copy` divides the direct tensors (or those at the positions ``rest``, ascending:
        what a restore's read back by file left) among ``threads`` threads (:func:`mover.split_of`): made once per
        thread count and ``rest`` object (a restore's is the layout's ``SpanWrites.rest`` each time), not at every
        restore."""
        key = (threads, rest is not None)
        made = self._splits.get(key)
        if made is None or made[0] is not rest:
            nbytes = self.nbytes if rest is None else list(map(self.nbytes.__getitem__, rest))
            made = self._splits[key] = (rest, mover.split_of(nbytes, threads))
        return made[1]


def layout_sizes(layout: _Layout) -> Sizes:
    """``layout``'s :class:`Sizes` (made once per layout)."""
    if layout.sizes is None:
        dst = layout.direct_dst
        nbytes = list(map(mul, map(_ITEMSIZE, map(itemgetter(1), dst)), map(math.prod, map(itemgetter(2), dst))))
        small = tuple(j for j, n in enumerate(nbytes) if n < SMALL_NBYTES)  # a direct tensor is never empty
        large = tuple(j for j, n in enumerate(nbytes) if n >= max(mover.MIN_TENSOR_NBYTES, SMALL_NBYTES))
        layout.sizes = Sizes(small, large, tuple(nbytes))
    return layout.sizes


@dataclass(eq=False)
class CopyStep:
    """One step of a :class:`CopyPlan`.

    Attributes:
        kind: ``"spans"`` (the span copies ``pick`` selects, a slice: bytes of a storage, CUDA ones among them),
            ``"torch"`` (one ``_foreach_copy_`` of the direct tensors that ``pick`` takes from a list of them),
            ``"write"`` (the plan's :class:`SpanWrites` by ``pwritev``), ``"large"`` (the direct tensors ``pick`` takes
            by torch or in chunks by :mod:`snapckpt.engine.mover`, :class:`Ways`) or ``"fault"`` (the mid-copy fault
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
            dst, direct, nbytes = layout.direct_dst, layout.direct, layout_sizes(layout).nbytes
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
class CopyPlan:
    """How a non-streamed save of a layout copies its spans into the slot: :attr:`steps` in order (made once per
    layout, :func:`copy_plan`; a save only fills in its addresses), walked by :meth:`Stager._copy_planned`.

    The span copies come first, then the direct tensors copied by torch (mid-sized ones, small ones outside long runs
    or without a slot file), then the small ones by ``pwritev`` (:attr:`writes`), then the large ones. Exactly one
    step holds the mid-copy fault point: the one at which half of the tensors (span copies and direct tensors, in
    that order) are copied, split around it (a ``"fault"`` step), or a ``"write"`` step, which fires it between its
    calls. A layout with no tensor has no step.
    """

    steps: List[CopyStep]
    writes: Optional[SpanWrites]


def _picker(items: Sequence[int], n: int) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """A function that takes the items at positions ``items`` (ascending, not empty) of a sequence of ``n``."""
    first, count = items[0], len(items)
    if items[-1] - first + 1 == count:  # a run: a slice (the whole list as it is)
        return _same if count == n else itemgetter(slice(first, first + count))
    return itemgetter(*items) if count > 1 else (lambda seq: [seq[first]])


def _same(seq: Sequence[Any]) -> Sequence[Any]:
    return seq


def copy_plan(layout: _Layout, by_file: bool) -> CopyPlan:
    """``layout``'s :class:`CopyPlan` for a save through the mapping only or one that may write by file
    (``by_file``: the save knows the slot file and its data pointers), made at its first such save."""
    plan = layout.copy_plans[by_file]
    if plan is None:
        plan = layout.copy_plans[by_file] = _build_copy_plan(layout, by_file)
    return plan


def _build_copy_plan(layout: _Layout, by_file: bool) -> CopyPlan:
    """A new :class:`CopyPlan` of ``layout`` (see :func:`copy_plan`); the first by file makes the layout's
    :attr:`~_Layout.span_writes` from its :class:`Sizes`."""
    sizes, n = layout_sizes(layout), len(layout.direct_dst)
    if by_file and layout.span_writes is None:
        layout.span_writes = SpanWrites.make(layout.direct, layout.direct_dst, sizes.small) or False
    writes = (layout.span_writes or None) if by_file else None
    others = set(sizes.large).union(writes.pos if writes else ())
    by_torch = [j for j in range(n) if j not in others] if others else range(n)
    parts = [("spans", range(len(layout.spans))), ("torch", by_torch), ("write", writes.pos if writes else ()),
             ("large", sizes.large)]
    half = (len(layout.spans) + n) // 2  # the fault point's tensor, counted in the order of the steps
    steps: List[CopyStep] = []
    for kind, items in parts:
        here = 0 <= half < len(items)
        if kind == "write" and items:
            step = CopyStep("write")
            if here:  # between two calls: the first of the call that holds that span
                step.at = bisect.bisect_right([b[0] for b in writes.batches], half) - 1
                step.mid = writes.batches[step.at][0]
            steps.append(step)
        else:
            cut = half if here else len(items)
            steps += [_copy_step(kind, part, layout, n) for part in (items[:cut], items[cut:]) if part]
            if here:
                steps.insert(len(steps) - 1, CopyStep("fault"))
        half -= len(items)
    return CopyPlan(steps, writes)


def _copy_step(kind: str, items: Sequence[int], layout: _Layout, n: int) -> CopyStep:
    """The :class:`CopyStep` of ``kind`` over ``items`` (span copy indices, or positions in the direct list of
    ``n``)."""
    if kind == "spans":
        return CopyStep(kind, slice(items[0], items[-1] + 1))
    offsets = tuple(layout.direct_dst[j][0] for j in items) if kind == "large" else ()
    return CopyStep(kind, _picker(items, n), offsets, items=items if kind == "torch" else ())
