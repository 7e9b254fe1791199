"""The memory-tier restore of a slot into a live state of its layout, in a process that did not write it (a restart).

A restarted rank builds its model, then ``load(state_dict)``; the general path unpickles the slot's skeleton (a
Python call per tensor, seconds for 200,000 tensors) and walks it beside the live state. :mod:`slot_restore`
avoids that only for slots this process wrote. Here the slot is recognised by content: its index carries the
digest of its plain layout (:mod:`snapckpt.formats.plain_digest`, written by the Stager when the snapshot is one
plain file of whole contiguous CPU tensors): structure, the types of the non-tensor values (not the values: a
restarted loop's step counter differs from the saved one), dtypes, shapes and offsets. :func:`find` computes the
same digest from the live state (its structure read a level at a time, :mod:`snapckpt.formats.plain_levels`; each
tensor's dtype and shape in the order :func:`~snapckpt.engine.plain_values.entries` meets them, and the offsets the
Stager's rule gives them) and, when they are equal, sets the saved non-tensor values into the live state's entries
as the general path does (the slot's own small pickle of them, :mod:`snapckpt.engine.plain_values`) and copies each
span straight into its live tensor: tensors of 1 MiB or more with one ``torch._foreach_copy_`` from views of the
slot, the others by ``preadv`` of the slot file, 512 spans per call
(:mod:`snapckpt.engine.span_read`; a state of many small tensors would otherwise spend most of the restore on a
call per tensor and on mapping the slot's pages), or, where that cannot read, a ``memmove`` each from the mapping;
their autograd version counters bumped as an in-place copy bumps them. Anything else (no digest or no values: an older slot, another
layout, a live tensor that is not a contiguous CPU tensor of the saved dtype, a tensor that the general path would
replace rather than copy into, a small live tensor sharing bytes with a large one) gets ``None``, and the caller
reads the slot the general way, which also names any incompatibility.

Reading each field of 200,000 live tensors (dtype, shape, device, contiguity, the negative bit) costs more than the
copy; a slot whose index names a shape table (:func:`~snapckpt.formats.plain_digest.shape_table`: each distinct dtype
and shape once, each tensor's index among them) is checked without that (:func:`_find_by_table`): the tensors' share
of the digest is derived from the table, and ``TensorGuards`` checks (C++, 960 tensors each) made from a reference
tensor per shape confirm that the live tensors are those. Where the optional native loops are built
(:mod:`snapckpt._native`), one C++ pass checks the live tensors against records of the same references and reads
their data pointers instead (:func:`_native_ptrs`: each tensor's metadata read once, not once per pass); its miss is
no refusal, the guards then decide. Any miss there goes to the field-by-field check, which decides as
before. Neither check changes a version counter: :meth:`PlainCopies.run` bumps them, once, as it copies (a restore
found on one rank is not run when another rank refuses the step). In a restarted process the slot's mapping is new: ``preadv`` reads the file's pages without mapping
them; when the ``memmove`` path runs instead and every tensor is small, the slot is first mapped by one
``MADV_POPULATE_READ`` (a page fault per 4 KiB page otherwise). With large
tensors it is not: torch copies them on several threads whose page faults map their spans in parallel, and one
thread mapping the whole slot, ahead or after, made the restart of 0.5 GiB in 64 tensors slower (recovery.py, paired:
copy 0.042-0.051 s without it, 0.064-0.077 s with it).
"""
from __future__ import annotations

import ctypes
import gc
import math
import re
from array import array
from collections import deque
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import add, attrgetter, is_, mul, setitem
from typing import Any, List, Optional, Tuple

import torch

from snapckpt import _native
from snapckpt.engine import plain_values, span_read
from snapckpt.engine.restore import refuse_inference
from snapckpt.engine.slot_maps import MappedSlot
from snapckpt.errors import SnapshotError
from snapckpt.engine.stager import ALIGN
from snapckpt.formats import plain_levels
from snapckpt.formats.plain_layout import has_repeats
from snapckpt.formats.plain_digest import Facts, ShapeTable, digest, read_table, tensor_part
from snapckpt.persister.arena import HEADER_NBYTES, read_header

__all__ = ["PlainCopies", "find", "direct_offsets"]

#: Tensors of at least this many bytes are copied by torch (its copy of a large tensor runs on several threads).
LARGE_NBYTES = 1 << 20

# the start of the index the Stager writes (snapckpt.engine.stager.index_bytes): its step, the digest, where the
# values are (slot byte offset, size) and, when there is one, the shape table; an index without "values" (an older
# one) does not match
_HEAD = re.compile(rb'\{"v":2,"step":(\d+),"plain":"([0-9a-f]{64})","values":\[(\d+),(\d+)\],'
                   rb'(?:"table":\[(\d+),(\d+)\],)?')
_HEAD_MAX = 256  # bytes of the index read for it
_IS_CPU = attrgetter("is_cpu")
_IS_NESTED = attrgetter("is_nested")
_IS_INFERENCE = torch.Tensor.is_inference

try:  # libc's memmove called with the GIL held: a copy of a few KiB is shorter than a release and re-take of the GIL,
    # and 200,000 releases would let any other Python thread of the process in between (ctypes.memmove releases it)
    _MEMMOVE = ctypes.PyDLL(None).memmove
    _MEMMOVE.argtypes, _MEMMOVE.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
except (OSError, AttributeError):  # pragma: no cover - no libc symbols in the process
    _MEMMOVE = ctypes.memmove

try:  # PyTorch's C++ check of many tensors (as the Stager's plan cache), and a view over no memory to build it from
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards, _reinterpret_tensor
except ImportError:  # pragma: no cover - then every restore checks tensor by tensor
    _TensorGuards = _reinterpret_tensor = None


@dataclass
class PlainCopies:
    """A restore found by :func:`find`: ``dicts[i][keys[i]] = values[i]`` (the saved non-tensor values, fresh
    objects), the large tensors as ``torch._foreach_copy_(large_dsts, large_srcs)``, the others (``small``, whose
    versions are bumped) as bytes ``[offsets[i], offsets[i] + nbytes[i])`` of the slot to ``dst_ptrs[i]``: by
    ``preadv`` of the slot file (:mod:`snapckpt.engine.span_read`), or what that did not copy by a ``memmove`` each
    from the mapping. ``slot`` keeps the mapping the sources point into alive until the copy ran."""

    large_dsts: List[torch.Tensor]
    large_srcs: List[torch.Tensor]
    small: List[torch.Tensor]
    dst_ptrs: "List[int] | array"  # an array("q") when the native check wrote them
    offsets: torch.Tensor  # int64: the small spans' slot byte offsets
    nbytes: torch.Tensor  # int64: their sizes
    slot: MappedSlot
    dicts: List[dict]
    keys: List[Any]
    values: List[Any]
    end: int = 0  # the end of the last span (slot bytes): mapped before the small copies; 0: the saves' mapping
    read_by_file: int = 0  # how many small spans preadv copied (the rest: memmove), for tests and profiles
    inference: bool = False  # some live tensors were made under torch.inference_mode()

    def run(self) -> None:
        """Copy (the live tensors have the saved dtypes: a copy of bytes).

        Raises:
            RuntimeError: a live tensor made under ``torch.inference_mode()``, restored outside it
                (:func:`~snapckpt.engine.restore.refuse_inference`), before anything is written.
        """
        if self.inference and not torch.is_inference_mode_enabled():
            refuse_inference()
        if self.slot.tensor is None:
            raise SnapshotError(f"the mapping of {self.slot.path} was closed before the restore copied from it")
        deque(map(setitem, self.dicts, self.keys, self.values), maxlen=0)
        if self.large_dsts:
            with torch.no_grad():  # a Parameter's copy must not enter autograd
                torch._foreach_copy_(self.large_dsts, self.large_srcs)
        if self.small:
            # bumped first, as an in-place copy would bump them: while the tensors' metadata is still in the CPU's
            # caches from find (after copying the bytes it is not: 20,000 scattered tensors cost 5 ms more)
            _native.increment_version(self.small)
            done = self.read_by_file = span_read.read_spans(self.slot.path, getattr(self.slot, "ident", None),
                                                            self.dst_ptrs, self.offsets, self.nbytes)
            if done < len(self.small):  # no preadv, or it stopped: from the mapping
                if self.end and not self.large_dsts:  # a restart's fresh mapping: one call, not a fault per page
                    self.slot.map_for_reading(self.end)
                base = self.slot.tensor.data_ptr()
                deque(map(_MEMMOVE, self.dst_ptrs[done:], self.offsets[done:].add(base).tolist(),
                          self.nbytes[done:].tolist()), maxlen=0)


class _Walked:
    """A live state as :func:`find` reads it: its structure (:attr:`~snapckpt.formats.plain_levels.Levels.structure`),
    its tensors and its replaced entries ``dicts[i][keys[i]]`` (:func:`~snapckpt.engine.plain_values.entries`)."""

    __slots__ = ("structure", "tensors", "dicts", "keys")

    def __init__(self, structure: bytes) -> None:
        self.structure = structure
        self.tensors: List[torch.Tensor] = []
        self.dicts: List[dict] = []
        self.keys: List[Any] = []


def find(mapped: MappedSlot, name: str, step: int, dst: Any) -> Optional[PlainCopies]:
    """The copies that restore ``dst`` (the live state of file ``name``) from ``mapped`` holding ``step``, or
    ``None`` when the slot's plain digest is absent or not that of ``dst`` (see the module)."""
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
    table_at = (int(head[5]), int(head[6])) if head[5] is not None else None
    if values_at[0] + values_at[1] > index_offset or (table_at is not None and sum(table_at) > index_offset):
        return None  # not where the Stager puts them (before the index): a damaged index
    enabled = gc.isenabled()
    gc.disable()  # a state of many tensors: no full collections while its layout is read
    try:
        levels = plain_levels.walk(dst)
        if levels is None:
            return None  # not plain
        walked = _Walked(levels.structure)
        # the tensors and the replaced entries in copy_into's order: every tensor must be among them (copy_into
        # replaces one in a list); a tensor met twice (tied, or in a mapping held twice) the checks below refuse
        if (not plain_values.entries(dst, walked.tensors, walked.dicts, walked.keys)
                or len(walked.tensors) != levels.n_tensors):
            return None
        found = None
        if table_at is not None:
            found = _find_by_table(walked, mapped, name, head[2].decode(), index_offset, values_at, table_at)
        # a miss of the table's check is not a refusal: the tensor-by-tensor check decides (slower, same outcome)
        if found is None and not _nested(walked.tensors):
            found = _find(walked, mapped, name, head[2].decode(), index_offset, values_at)
        if isinstance(found, PlainCopies) and hasattr(mapped, "map_for_reading"):
            found.end = index_offset
        return found
    finally:
        if enabled:
            gc.enable()


def _nested(tensors: List[torch.Tensor]) -> bool:
    """Whether a tensor is nested: a torch.Tensor without strides, whose ``TensorGuards`` check aborts the process (a
    C++ exception it cannot pass on, torch 2.13) and whose ``Facts`` raise; the general path names it."""
    return any(map(_IS_NESTED, tensors))


def _find(walked: "_Walked", mapped: MappedSlot, name: str, saved: str, data_limit: int,
          values_at: Tuple[int, int]) -> Optional[PlainCopies]:
    """:func:`find` tensor by tensor: each field of the live tensors read with one ``map`` (a slot without a shape
    table, or live tensors that its check does not pass)."""
    tensors = walked.tensors
    if has_repeats(tensors):
        return None  # a tensor held twice: copy_into copies into it twice
    facts = Facts(tensors)
    ptrs = _data_ptrs(tensors, any(map(attrgetter("is_complex"), facts.kinds)))
    if ptrs is None:
        return None
    offsets, nbytes = direct_offsets(facts)
    if digest(name, walked.structure, tensor_part(facts, offsets.tolist())) != saved:  # no numpy: not a dependency
        return None
    copies = _copies(mapped, walked, ptrs, offsets, nbytes, data_limit, values_at)
    # (the table's guards compare dispatch keys, which tell inference tensors apart from their references: made
    # and checked in the same mode, they pass only tensors that may be written in it)
    if copies is not None and not torch.is_inference_mode_enabled():
        copies.inference = any(map(_IS_INFERENCE, tensors))
    return copies


def _find_by_table(walked: "_Walked", mapped: MappedSlot, name: str, saved: str, data_limit: int,
                   values_at: Tuple[int, int], table_at: Tuple[int, int]) -> Optional[PlainCopies]:
    """:func:`find` by the slot's shape table (:func:`~snapckpt.formats.plain_digest.shape_table`): the tensors' share
    of the digest is derived from the table, not read from the live tensors, and PyTorch's ``TensorGuards`` (one C++
    loop) checks that every live tensor has the table's dtype and shape, contiguous strides, the CPU, no negative or
    conjugate bit, ``Tensor`` without ``requires_grad`` or ``Parameter`` with it (of a float or complex dtype; of
    another, without), and that no tensor object occurs twice. Passing both, the
    live tensors' :class:`Facts` are the table's, so the digest is the one :func:`_find` computes and the copies are
    the same; ``None`` on any miss (:func:`_find` then decides, from the live tensors). The native loop
    (:mod:`snapckpt._native`, when built) checks the same against records of the same references first, with their
    data pointers in the same pass (:func:`_native_ptrs`); on a miss the guards decide."""
    if _TensorGuards is None:
        return None
    table = read_table(bytes(mapped.buf[table_at[0]:table_at[0] + table_at[1]]))
    tensors = walked.tensors
    if table is None or len(tensors) != len(table.ids):
        return None
    part, offsets, nbytes, all_small = _table_part(table)
    if digest(name, walked.structure, part) != saved:
        return None
    ptrs: "List[int] | array | None" = _native_ptrs(table, tensors)
    if ptrs is None:
        if _nested(tensors) or not _guards_pass(table, tensors):
            return None
        try:
            ptrs = list(map(torch.Tensor.data_ptr, tensors))
        except RuntimeError:  # pragma: no cover - a dense CPU tensor has a storage
            return None
    return _copies(mapped, walked, ptrs, _as_tensor(offsets), _as_tensor(nbytes), data_limit, values_at, all_small)


def _native_ptrs(table: ShapeTable, tensors: List[torch.Tensor]) -> Optional[array]:
    """The data pointers of ``tensors`` (an ``array("q")``) when the native loop (:mod:`snapckpt._native`) finds each
    one of a reference of :func:`_guards_pass` for its table entry (Python type, dispatch keys, dtype,
    ``requires_grad``, device, storage offset 0, shape, contiguous strides, not an inference tensor: stricter than
    the guards) with a data pointer of its own (not null, no other tensor's: no tensor object twice); ``None``
    otherwise (no native loop, or a miss: the guards decide). One pass over the tensors that reads each one's
    metadata once, where the guards, the data pointers and the sort for repeats read it three times."""
    mod = _native.load()
    if mod is None or table.ids.itemsize != 4 or _reinterpret_tensor is None:
        return None
    ptrs = _int64s(len(tensors))
    # references of each shape as a Tensor first; only when a tensor is of no type there (a Parameter: rare in a
    # state dict), of both types (making a reference costs ~10 us: a table of 4,096 shapes, tens of ms)
    for kinds in ((False,), (False, True)):
        try:
            refs = [_reference(table.kinds[code], shape, p) for code, shape in table.shapes for p in kinds]
        except Exception:  # noqa: BLE001 - as _guards_pass: a torch that makes no such view, the guards decide
            return None
        records = mod.table(refs, torch.Tensor)
        got = -1 if records is None else mod.check_ids(tensors, records, table.ids, len(kinds), ptrs)
        if got != -2:
            return ptrs if got == 0 else None
    return None


def _table_part(table: ShapeTable) -> Tuple[bytes, array, array, bool]:
    """``(tensor_part, slot byte offsets, byte sizes, all small)`` of tensors of ``table``'s dtypes and shapes, laid
    out by the Stager's rule (:func:`direct_offsets`): what :func:`tensor_part` and :func:`direct_offsets` give for
    live tensors whose :class:`Facts` are the table's; ``all small``: every tensor is under :data:`LARGE_NBYTES`.
    By gathers and prefix sums over the table's indices (no
    Python step per tensor, and no element-wise torch op over them: those run on several threads, whose wake-ups cost
    more than the work)."""
    n = len(table.ids)
    per = []
    for code, shape in table.shapes:
        numel = math.prod(shape)
        nb = numel * table.kinds[code].itemsize
        per.append([code, len(shape), numel, nb, (nb + ALIGN - 1) // ALIGN * ALIGN])
    cols = torch.tensor(per or [[0] * 5], dtype=torch.int64).t().contiguous()
    ids = torch.frombuffer(table.ids, dtype=torch.int32) if n else torch.zeros(0, dtype=torch.int32)
    codes, dims, numels, nbytes = (_gather(cols[j], ids, n) for j in range(4))
    steps = _int64s(n + 1)  # the header, then each aligned span: their prefix sums are the spans' offsets
    st = _as_tensor(steps)
    torch.index_select(cols[4], 0, ids, out=st[1:])
    ends = _int64s(n + 1)
    st[0] = HEADER_NBYTES
    torch.cumsum(st, 0, out=_as_tensor(ends))
    offsets = ends[:n]
    multi = [s if len(s) > 1 else () for _c, s in table.shapes]
    sizes = array("q", chain.from_iterable(map(multi.__getitem__, table.ids)) if any(multi) else ())
    part = b"\0".join((repr(table.kinds).encode(), codes.tobytes(), dims.tobytes(), numels.tobytes(), sizes.tobytes(),
                        offsets.tobytes()))
    return part, offsets, nbytes, all(p[3] < LARGE_NBYTES for p in per)


def _gather(col: torch.Tensor, ids: torch.Tensor, n: int) -> array:
    """``col[ids]`` as an ``array("q")`` of ``n`` items."""
    out = _int64s(n)
    torch.index_select(col, 0, ids, out=_as_tensor(out))
    return out


def _int64s(n: int) -> array:
    return array("q", bytes(8 * n))


def _as_tensor(a: array) -> torch.Tensor:
    """An int64 tensor over the ``array("q")`` ``a`` (writes go into it)."""
    return torch.frombuffer(a, dtype=torch.int64) if len(a) else torch.zeros(0, dtype=torch.int64)


#: Tensors per ``TensorGuards`` check of :func:`_guards_pass`: a multiple of small periods (12 tensors of a transformer
#: block, 24 with two optimizer states each), so that the chunks of a repeating layout repeat and share their guards.
_GUARD_CHUNK = 960


def _guards_pass(table: ShapeTable, tensors: List[torch.Tensor]) -> bool:
    """Whether every tensor has the table's dtype and shape, contiguous, on the CPU, without a negative or conjugate
    bit, a ``Tensor`` without ``requires_grad`` or a ``Parameter`` with it (when its dtype can), each object once:
    PyTorch's ``TensorGuards`` made from a reference of each (over no memory: its metadata only) checks all of it,
    chunk by chunk (:data:`_GUARD_CHUNK` tensors; one ``TensorGuards`` per distinct sequence of references, made once:
    a state of few shapes in a repeating order needs a few, where one of every tensor costs more to make than its
    check), and one sort of the objects' ids refuses an object met in two chunks."""
    types = list(map(type, tensors))
    params = types.count(torch.nn.Parameter)
    if params + types.count(torch.Tensor) != len(types):
        return False
    kinds = (False, True) if params else (False,)  # with Parameters: a reference per (shape, type), 2i + is one
    which = (array("i", map(add, map(mul, table.ids, repeat(2)), map(is_, types, repeat(torch.nn.Parameter))))
             if params else table.ids)
    made: dict = {}
    try:
        refs = [_reference(table.kinds[code], shape, p) for code, shape in table.shapes for p in kinds]
        for a in range(0, len(tensors), _GUARD_CHUNK):
            part = which[a:a + _GUARD_CHUNK]
            pattern = part.tobytes()
            guards = made.get(pattern)
            if guards is None:
                guards = made[pattern] = _TensorGuards(*map(refs.__getitem__, part), dynamic_dims_sizes=None,
                                                       dynamic_dims_strides=None)
            if not guards.check(*tensors[a:a + _GUARD_CHUNK]):
                return False
    except Exception:  # noqa: BLE001 - a torch whose guards take other arguments: the tensor-by-tensor check
        return False
    return len(tensors) <= _GUARD_CHUNK or not has_repeats(tensors)  # a check refuses repeats within its chunk


def _reference(dtype: torch.dtype, shape: Tuple[int, ...], parameter: bool) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` with contiguous strides over no memory (never read: the guards take
    its metadata), a ``Parameter`` when ``parameter`` (with ``requires_grad`` when its dtype can have it)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    t = _reinterpret_tensor(torch.empty(0, dtype=dtype), shape, strides, 0)
    return torch.nn.Parameter(t, requires_grad=dtype.is_floating_point or dtype.is_complex) if parameter else t


def _copies(mapped: MappedSlot, walked: "_Walked", ptrs: List[int], offsets: torch.Tensor,
            nbytes: torch.Tensor, data_limit: int, values_at: Tuple[int, int], all_small: bool = False
            ) -> Optional[PlainCopies]:
    """The copies of a slot whose digest is that of the live state ``walked`` (``ptrs``: its tensors' data
    pointers, each able to take its bytes by a copy of bytes; ``offsets`` / ``nbytes``: their spans; ``all_small``:
    every one is under :data:`LARGE_NBYTES`, known already), or ``None`` (see :func:`find`)."""
    tensors, dicts, keys = walked.tensors, walked.dicts, walked.keys
    if not all(ptrs):
        return None  # a tensor over no memory (a ZeroTensor, a functional wrapper: data_ptr 0): a copy would crash
    if tensors and int(offsets[-1] + nbytes[-1]) > min(data_limit, mapped.nbytes):
        return None  # spans past the pickles: not a slot of this layout (a digest never lets this through)
    values = plain_values.unpack(mapped.buf[values_at[0]:values_at[0] + values_at[1]])
    if values is None or len(values) != len(dicts):
        return None  # a damaged slot (a digest never lets another count through)
    sets = (dicts, keys, values, int(offsets[-1] + nbytes[-1]) if tensors else 0)
    if all_small:  # the common case of many tensors
        return PlainCopies([], [], tensors, ptrs, offsets, nbytes, mapped, *sets)
    large = nbytes >= LARGE_NBYTES
    if not bool(large.any()):
        return PlainCopies([], [], tensors, ptrs, offsets, nbytes, mapped, *sets)
    small = large.logical_not()
    if _shared(torch.frombuffer(array("q", ptrs), dtype=torch.int64), nbytes, large, small):
        return None
    big = large.tolist()
    large_srcs = [mapped.tensor[o:o + n].view(t.dtype).view(t.shape) for t, o, n in
                  zip(compress(tensors, big), offsets[large].tolist(), nbytes[large].tolist())]
    few = small.tolist()
    return PlainCopies(list(compress(tensors, big)), large_srcs, list(compress(tensors, few)),
                       list(compress(ptrs, few)), offsets[small], nbytes[small], mapped, *sets)


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
