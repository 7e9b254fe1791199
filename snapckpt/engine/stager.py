"""The Stager: copies a rank's state into an arena slot (the only part on the training critical path).

Sequence for one snapshot (all on the training process, no collective, no allocation of tensor memory):

1. :meth:`Stager.prepare` walks the state once to find its tensors (:func:`collect_tensors`), groups them
   by the storage they live in, and looks up a :class:`Plan` for that exact layout. A plan is cached keyed
   on every tensor's storage pointer, storage size, offset, shape, stride, dtype and device (contract
   3), so a changed layout (a replaced optimizer tensor, a new parameter group, a new shape)
   always gets a new plan. The skeleton (``data.pkl``) of each file is pickled here, with user objects
   pickled by the training process itself, so the persister never unpickles anything.
2. :meth:`Stager.copy_into` copies each storage span into the slot, then writes the pickles, the index
   and the header. CUDA spans may be queued beforehand on a side stream into page-locked memory
   (:mod:`snapckpt.engine.device_copy`); the copy thread of ``overlap=True`` runs this step off the training
   thread, and :meth:`Checkpointer.fence` waits for both.

:func:`snapckpt.persister.slot_index.read_slot` is the reverse (memory-tier load).
"""
from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

import torch

from snapckpt.persister.arena import HEADER_NBYTES, write_header
from snapckpt._internal import faultpoints as faults
from snapckpt.errors import SnapshotError
from snapckpt.formats.specs import Concat, RawBytes, TorchSave, unwrap
from snapckpt.formats.torch_zip import (TensorRef, _check_supported, collect_tensors, find_unpicklable, pickle_skeleton,
                                plain_tensors, weights_only_refusal)

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


def _signature(tensors: List[torch.Tensor]) -> tuple:
    """The cache key of a plan: everything :func:`_build_plan` reads, and nothing else.

    Per tensor: device, storage size (bytes), storage offset, shape, stride, dtype, and which storage it
    views, as the index of that storage in first-use order (with its data pointer standing in only for
    the grouping). Two states whose tensors are fresh allocations of the same layout (a new
    ``torch.get_rng_state()`` every save, optimizer state replaced by clones) get the same key and share
    a plan; a change of aliasing (tied tensors untied), shape, stride, dtype, device or size changes the
    key (contract 3 (docs/design/contracts.md)). The plan holds no tensor handles: :meth:`Stager.prepare` takes the copy
    sources from the live tensors at every save, so reusing a plan across allocations is safe.
    """
    sig = []
    storage_ids: Dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        gkey = (str(t.device), ptr) if ptr != 0 else ("empty", i)
        g = storage_ids.setdefault(gkey, len(storage_ids))
        sig.append((str(t.device), g, ptr == 0, st.nbytes(), t.storage_offset(), tuple(t.shape), t.stride(),
                    t.dtype))
    return tuple(sig)


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


@dataclass
class Prepared:
    """A snapshot ready to be copied: what to copy where, plus the bytes that follow the data.

    Attributes:
        step: the step being snapshotted.
        total_nbytes: bytes the slot must hold (header, spans, pickles, index).
        copies: ``(source uint8 tensor view, slot byte offset)`` per span.
        tail: ``(slot byte offset, bytes)`` for each pickle and the index.
        index_offset, index_nbytes: where the index (JSON) sits.
        tensor_nbytes: bytes of tensor data (the sum of span sizes).
        persistable: whether any file is for disk; a snapshot of ``MemoryOnly`` files only is never written
            by the persister's flush after a crash (it is not a checkpoint in any layout).
    """

    step: int
    total_nbytes: int
    copies: List[Tuple[torch.Tensor, int]]
    tail: List[Tuple[int, bytes]]
    index_offset: int
    index_nbytes: int
    tensor_nbytes: int
    persistable: bool = True  # some file of the snapshot is written to disk (not all MemoryOnly)


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


class Stager:
    """Turns ``{relative file path: object}`` into slot bytes. One per training process and rank.

    The plan cache holds the plans of the last few layouts (a state that alternates between two layouts,
    such as memory and disk snapshots of different contents, keeps both).
    """

    def __init__(self, cache_size: int = 4) -> None:
        self._plans: Dict[tuple, Plan] = {}
        self._cache_size = cache_size
        self.plan_builds = 0  # how many plans were built (observable by tests of contract 3)
        self._unsafe_warned: set = set()  # weights_only refusals already warned about

    def _plan_for(self, tensors: List[torch.Tensor]) -> Tuple[Plan, bool]:
        """The plan of this layout and whether it was built now (not found in the cache)."""
        sig = _signature(tensors)
        plan = self._plans.get(sig)
        if plan is None:
            plan = _build_plan(tensors)
            self.plan_builds += 1
            if len(self._plans) >= self._cache_size:
                self._plans.pop(next(iter(self._plans)))
            self._plans[sig] = plan
            return plan, True
        return plan, False

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
        tensor of every file joins one plan, so a storage shared between files is copied once.

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
        plain_files: set = set()
        for name, value in files.items():
            spec, persist = unwrap(value)
            if isinstance(spec, RawBytes):
                spec = Concat([bytes(spec.data)], spec.mode)
            specs.append((spec, persist))
            if isinstance(spec, TorchSave):
                plain = plain_tensors(spec.obj)
                if plain is not None:  # only containers, tensors and atomic values: weights_only loads it
                    per_file_tensors.append(plain)
                    plain_files.add(name)
                    continue
                try:
                    per_file_tensors.append(collect_tensors(spec.obj))
                except SnapshotError:
                    raise
                except Exception as e:  # noqa: BLE001 - pickle raises PicklingError, TypeError, AttributeError...
                    raise _unpicklable_error(name, spec.obj, e) from e
            else:
                ts = [p for p in spec.parts if isinstance(p, torch.Tensor)]
                for t in ts:
                    _check_concat_tensor(t)
                per_file_tensors.append(ts)
        all_tensors: List[torch.Tensor] = []
        seen: Dict[int, int] = {}
        for ts in per_file_tensors:
            for t in ts:
                if id(t) not in seen:
                    seen[id(t)] = len(all_tensors)
                    all_tensors.append(t)
        plan, new_plan = self._plan_for(all_tensors)
        copies = []
        for span in plan.spans:
            copies.append([None, span.arena_offset])
        for i, t in enumerate(all_tensors):
            c = copies[plan.tensor_span[i]]
            if c[0] is None:
                span = plan.spans[plan.tensor_span[i]]
                c[0] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                    t.untyped_storage(), span.start_nbytes, (span.nbytes,), (1,))
        offset = plan.data_end
        tail: List[Tuple[int, bytes]] = []
        index_files = []
        by_key = {s.key: s for s in plan.spans}
        for path, (spec, persist), ts in zip(files.keys(), specs, per_file_tensors):
            if isinstance(spec, TorchSave):
                refs = {id(t): plan.refs[seen[id(t)]] for t in ts}
                pkl, keys = pickle_skeleton(spec.obj, refs)
                if new_plan and check_weights_only and path not in plain_files:
                    _warn_if_unsafe(path, pkl, self._unsafe_warned)
                tail.append((offset, pkl))
                records = [[k, by_key[k].arena_offset, by_key[k].nbytes] for k in keys]
                index_files.append({"path": path, "kind": "torch", "persist": persist,
                                    "pkl": [offset, len(pkl)], "records": records, **_mode(spec)})
                offset += len(pkl)
                continue
            chunks = []
            for part in spec.parts:
                if isinstance(part, torch.Tensor):
                    i = seen[id(part)]
                    span = plan.spans[plan.tensor_span[i]]
                    start = span.arena_offset + part.storage_offset() * part.element_size() - span.start_nbytes
                    chunks.append([start, part.numel() * part.element_size()])
                else:
                    tail.append((offset, part))
                    chunks.append([offset, len(part)])
                    offset += len(part)
            index_files.append({"path": path, "kind": "bytes", "persist": persist, "chunks": chunks, **_mode(spec)})
        index = json.dumps({"v": 2, "step": step, "files": index_files}, separators=(",", ":")).encode()
        tail.append((offset, index))
        total = offset + len(index)
        tensor_nbytes = sum(s.nbytes for s in plan.spans)
        persistable = not specs or any(persist for _, persist in specs)
        return Prepared(step, total, [(c[0], c[1]) for c in copies], tail, offset, len(index), tensor_nbytes,
                        persistable)

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
        """
        # A reused slot still carries the header of the snapshot it held: it goes first, so that the slot's
        # own bytes never describe a half-overwritten snapshot as complete (the header is written last).
        buf[0:HEADER_NBYTES] = bytes(HEADER_NBYTES)
        half = len(prepared.copies) // 2
        for i, (src, off) in enumerate(prepared.copies):
            if i == half:
                faults.point("snapshot.mid_copy", step=prepared.step)
            n = src.numel()
            if n and not (device_done is not None and src.is_cuda):
                slot[off:off + n].copy_(src)
        for off, data in prepared.tail:
            buf[off:off + len(data)] = data
        if device_done is not None:
            device_done.synchronize()
        write_header(buf, prepared.step, prepared.index_offset, prepared.index_nbytes)


def _check_concat_tensor(t: torch.Tensor) -> None:
    _check_supported(t)
    if not t.is_contiguous():
        raise SnapshotError(f"a raw tensor record (shape {tuple(t.shape)}) must be contiguous")


def _mode(spec: Any) -> Dict[str, int]:
    """The slot index's ``"mode"`` entry of a file spec with permission bits (none for the default mode)."""
    return {} if spec.mode is None else {"mode": spec.mode}
