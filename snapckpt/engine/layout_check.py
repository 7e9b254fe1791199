"""Whether a state's tensors still have a cached plan's layout: the plan cache's key and its quick check.

:func:`signature` is the key of a :class:`~snapckpt.engine.stager.Stager` plan (contract 3, docs/design/contracts.md):
every tensor's storage grouping, offset, shape, stride, dtype, device, type and ``requires_grad``. :class:`Recheck`
tells that tensors have a known signature without reading it (PyTorch's C++ ``TensorGuards`` and two C-level passes
per chunk), the common case of a training state saved again. Both run on the training thread at every save.
"""
from __future__ import annotations

from itertools import compress, islice
from operator import attrgetter, eq, mul, not_, sub
from typing import Dict, List, Optional

import torch

from snapckpt import _native
from snapckpt.errors import SnapshotError
from snapckpt.formats.plain_layout import has_repeats
from snapckpt.formats.torch_zip import _check_supported

__all__ = ["signature", "check_storages", "Recheck", "CHUNK", "RECHECKS_KEPT", "GUARDS_AVAILABLE"]

_DTYPE, _SHAPE, _DEVICE, _GRAD = (attrgetter(a) for a in ("dtype", "shape", "device", "requires_grad"))
_ITEMSIZE = attrgetter("itemsize")
_DATA_PTR, _OFFSET = torch.Tensor.data_ptr, torch.Tensor.storage_offset


def signature(tensors: List[torch.Tensor]) -> tuple:
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
        SnapshotError: a tensor whose storage was freed (:func:`check_storages`).
    """
    t_ = torch.Tensor
    offs = tuple(map(t_.storage_offset, tensors))
    dtypes = tuple(map(_DTYPE, tensors))
    devices = tuple(map(_DEVICE, tensors))
    ptrs, itemsizes = list(map(_DATA_PTR, tensors)), tuple(map(_ITEMSIZE, dtypes))
    check_storages(tensors, ptrs, offs, itemsizes)
    groups = _groups(ptrs, offs, itemsizes, devices, len(set(devices)) <= 1)
    # a lazy conjugate (complex dtypes only) or negation, refused when a plan is built: the direct tensors' copies
    # (pwritev, memmove) take raw bytes, so a plan found for such a state would save the values unconjugated
    lazy = (any(d.is_complex for d in set(dtypes)) and any(map(t_.is_conj, tensors))) or any(map(t_.is_neg, tensors))
    return (len(tensors), groups, offs, dtypes, devices, tuple(map(_SHAPE, tensors)), tuple(map(t_.stride, tensors)),
            tuple(map(type, tensors)), tuple(map(_GRAD, tensors)), lazy)


def check_storages(tensors: List[torch.Tensor], ptrs: List[int], offs: tuple, itemsizes: tuple) -> None:
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
    """:func:`signature`'s storage grouping of tensors with data pointers ``ptrs`` (a function of ``ptrs``,
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

#: Whether this torch has ``TensorGuards`` (every supported version): without it every save reads the full signature.
GUARDS_AVAILABLE = _TensorGuards is not None


class Recheck:
    """A quick way to tell that tensors have their layout's :func:`signature`, without reading it (a plan-cache hit).

    The tensors are read in chunks of :data:`CHUNK`, each chunk by three C-level passes while its tensors are in the
    CPU's caches (one pass per field over 200,000 tensors misses them three times): the storage offsets (and with them
    the count), PyTorch's ``TensorGuards`` (a C++ loop: each tensor's Python type, dtype, device, shape, stride,
    ``requires_grad`` and dispatch keys, the lazy conjugate and negative bits among them, against the tensors the
    entry was made from), and the data pointers. The storage grouping is then compared: when the data pointers are
    those of the last tensors that passed (``ptrs``: the same training state saved again, the common case), it is
    theirs, since the grouping is a function of the pointers, offsets, element sizes and devices, all equal then; else
    it is recomputed from the pointers (with the known element sizes). Every field of the signature is compared, so a
    hit means the same signature; any failure (or a guard that cannot be made) falls back to the full
    :func:`signature`.

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
                 "distinct", "nulls", "inference", "native", "table", "table_inference")

    def __init__(self, tensors: List[torch.Tensor], sig: tuple, restorable: bool = False) -> None:
        self.n, self.offsets = len(tensors), sig[2]
        self.chunks = [(_TensorGuards(*tensors[i:i + CHUNK], dynamic_dims_sizes=None, dynamic_dims_strides=None),
                        self.offsets[i:i + CHUNK]) for i in range(0, self.n, CHUNK)]
        self.whole = self.chunks[0][0] if len(self.chunks) == 1 else (
            _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None) if restorable else None)
        self.itemsizes = tuple(map(_ITEMSIZE, sig[3]))
        self.devices, self.groups = sig[4], sig[1]
        self.one_device = len(set(self.devices)) <= 1
        # whether the tensors that pass same_tensors outside torch.inference_mode() include some made under it: found
        # by the first restore that needs it (slot_restore). Checked outside it, the guards' dispatch keys tell the
        # two kinds apart (whichever mode made them), so every tensor list that passes there is of that one answer
        self.inference: Optional[bool] = None
        # the optional native loop (snapckpt._native) and its records of these tensors' type, dispatch keys, dtype,
        # requires_grad, device, storage offset, shape and strides: every field the guards and offsets compare
        self.native = _native.load()
        self.table = self.native.table(tensors, torch.Tensor) if self.native is not None else None
        # whether the tensors that pass native_same (inference or not as these) include inference tensors
        self.table_inference = self.table is not None and any(map(torch.Tensor.is_inference, tensors))
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
        for i, (guards, offs) in zip(range(0, self.n, CHUNK), self.chunks):
            part = tensors[i:i + CHUNK]
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
            SnapshotError: data pointers changed and a tensor's storage was freed (:func:`check_storages`).
        """
        if self.native_same(tensors):
            return True
        ptrs = self._scan(tensors, True)
        if ptrs is None:
            return False
        if ptrs != self.ptrs:
            check_storages(tensors, ptrs, self.offsets, self.itemsizes)
            if _groups(ptrs, self.offsets, self.itemsizes, self.devices, self.one_device) != self.groups:
                return False
            self._remember(ptrs)
        return self._once_each(tensors, ptrs)

    def native_same(self, tensors: List[torch.Tensor]) -> bool:
        """Whether the native loop (:mod:`snapckpt._native`, when built) finds ``tensors`` of the entry's records
        (every field :meth:`matches` compares but the grouping, and stricter: dispatch keys all equal, inference or
        not as they were) with the remembered data pointers, in one pass, no tensor object twice; ``False`` also
        when there is no native loop (the caller takes the Python path, which decides). Changes nothing."""
        if self.table is None:
            return False
        return self.native.check(tensors, self.table, self.ptrs) == 0 and self._no_repeats(tensors)

    def _no_repeats(self, tensors: List[torch.Tensor]) -> bool:
        """:meth:`_once_each` of tensors that the native loop passed (no guards saw the pairs of a chunk)."""
        if not self.distinct:
            return not has_repeats(tensors)
        return self.nulls < 2 or not has_repeats(list(compress(tensors, map(not_, self.ptrs))))

    def same_tensors(self, tensors: List[torch.Tensor]) -> bool:
        """Whether ``tensors`` pass the guards (type, dtype, device, shape, stride, ``requires_grad``; offsets and
        grouping not compared) and no tensor object occurs twice (a restore's check, :mod:`slot_restore`)."""
        if len(tensors) != self.n:
            return False
        if self.whole is not None:
            return self.whole.check(*tensors)
        return (all(guards.check(*tensors[i:i + CHUNK])
                    for i, (guards, _) in zip(range(0, self.n, CHUNK), self.chunks))
                and not has_repeats(tensors))


#: Tensors per chunk of the quick check (:class:`Recheck`): their tensor structs stay in the CPU's caches for its
#: three passes.
CHUNK = 1024


RECHECKS_KEPT = 2  # quick checks made for one layout before it goes without (see Stager._plan_for)
