"""The ``torch.save`` file format, produced from a snapshot without re-serializing tensor data.

A ``torch.save`` file is an uncompressed zip archive holding ``data.pkl`` (a protocol-2 pickle of the
object in which every storage is a persistent id ``("storage", <Dtype>Storage, key, location, numel)``),
the records ``.format_version``, ``.storage_alignment``, ``byteorder``, one raw record ``data/<key>`` per
storage, and ``version``/``.data/serialization_id`` written at the end (source:
``torch/serialization.py::_save`` of PyTorch 2.13). This module splits that in two:

- on the training process, :func:`pickle_skeleton` turns a state into the ``data.pkl`` bytes, with each
  storage replaced by a *span* of it (only the bytes that tensors actually use, so a view into a large
  buffer does not drag the buffer along; tensors that overlap in one storage keep sharing one
  record);
- in the persister, :func:`write_torch_file` (:mod:`snapckpt.formats.torch_archive`, re-exported here)
  writes the archive from those bytes and raw records that live in shared memory: a pure-Python writer whose
  output is byte for byte that of :class:`torch._C.PyTorchFileWriter`, the writer ``torch.save`` uses, so
  that the persister runs without importing torch.

``torch.load(path)`` reads the result; with ``weights_only=True`` when the state holds only tensors and
plain containers. :func:`unpickle_skeleton` is the reverse for the memory tier.

Checksums: the archive is written as ``torch.save`` writes it under
``torch.serialization.set_crc32_options(False)``: the zip's per-record CRC-32 fields are 0, which
``torch.load`` accepts (documented there) but a generic ``unzip -t`` reports. Integrity is the
manifest's job instead: one CRC-32 of the whole file, computed while writing. Computing both costs a
second pass over every byte on the persister (measured in isolation: writing a 1 GiB part took
0.88-1.18 s with one pass, 1.64-3.81 s with two, same machine, noisy disk), and on a 2-core host that
CPU is taken from training.
"""
from __future__ import annotations

import collections
import io
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from snapckpt._internal.compat import check_torch
from snapckpt.formats.torch_archive import ALIGNMENT as STORAGE_ALIGNMENT, write_torch_file
from snapckpt.errors import SnapshotError, UnsafeCheckpointError

check_torch()  # the private PyTorch names used below exist (else UnsupportedTorchError naming the range)

__all__ = [
    "collect_tensors",
    "pickle_skeleton",
    "find_unpicklable",
    "weights_only_refusal",
    "unpickle_skeleton",
    "write_torch_file",
    "TensorRef",
    "STORAGE_ALIGNMENT",
]

PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL

_SUPPORTED_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's data sits inside a span: ``key`` of the span, element offset, size, stride."""

    key: str
    storage_offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    location: str
    span_numel: int


def _check_supported(t: torch.Tensor) -> None:
    if type(t) not in _SUPPORTED_TYPES:
        raise SnapshotError(
            f"cannot snapshot a tensor of type {type(t).__name__} (shape {tuple(t.shape)}): snapckpt "
            "handles torch.Tensor and nn.Parameter; convert it (e.g. DTensor.to_local()) in the state dict"
        )
    if t.is_nested:
        raise SnapshotError("cannot snapshot a nested tensor; save its components "
                            "(e.g. t.unbind()) or a padded tensor (t.to_padded_tensor(0))")
    if t.layout != torch.strided:
        raise SnapshotError(f"cannot snapshot a tensor with layout {t.layout} (shape {tuple(t.shape)}); save "
                            "t.to_dense() or its index/value tensors")
    if t.is_quantized:
        raise SnapshotError(f"cannot snapshot a quantized tensor (shape {tuple(t.shape)}); save "
                            "t.dequantize() or its int_repr() with scale and zero point")
    if t.is_conj() or t.is_neg():
        raise SnapshotError("cannot snapshot a tensor with a lazy conj/neg bit; call .resolve_conj() first")
    if t.device.type == "meta":
        raise SnapshotError(f"cannot snapshot a meta tensor of shape {tuple(t.shape)}: it has no data")


class _Collector(pickle.Pickler):
    """Pass 1: walks the object exactly as pickling would and records every tensor met."""

    def __init__(self) -> None:
        super().__init__(_NullSink(), protocol=PICKLE_PROTOCOL)
        self.tensors: List[torch.Tensor] = []
        self._seen: set = set()

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            _check_supported(obj)
            if id(obj) not in self._seen:
                self._seen.add(id(obj))
                self.tensors.append(obj)
            return (int, ())
        return NotImplemented


class _NullSink:
    def write(self, b) -> int:
        return len(b)


def collect_tensors(obj: Any) -> List[torch.Tensor]:
    """Return every tensor reachable by pickling ``obj``, in pickling order, each once.

    Raises:
        SnapshotError: a tensor type snapckpt cannot snapshot (sparse, quantized, subclass, meta).
        pickle.PicklingError / TypeError: ``obj`` holds something that cannot be pickled at all.
    """
    c = _Collector()
    c.dump(obj)
    return c.tensors


def _pickles(obj: Any) -> Optional[BaseException]:
    """The error pickling ``obj`` raises (tensors stand in as ints: never copied), or ``None``."""
    try:
        _Collector().dump(obj)
    except SnapshotError:
        return None  # an unsupported tensor, reported by the caller's own pass
    except Exception as e:  # noqa: BLE001 - any pickling failure is the answer
        return e
    return None


def find_unpicklable(obj: Any, path: str = "state") -> Optional[Tuple[str, Any, BaseException]]:
    """The first value of ``obj`` that cannot be pickled: ``(key path, value, error)``, or ``None``.

    The key path reads like the Python that reaches the value (``state['opt']['fn']``,
    ``state['cfg'].callback``). Walks dicts, lists, tuples, sets and objects' ``__dict__``, descending
    only into children that fail themselves; meant for error messages (run it only after pickling failed).
    """
    err = _pickles(obj)
    if err is None:
        return None
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, (set, frozenset)):
        children = [(f"{path}{{{v!r}}}", v) for v in obj]
    elif hasattr(obj, "__dict__") and isinstance(vars(obj), dict) and not isinstance(obj, type):
        children = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    else:
        children = []
    for child_path, child in children:
        found = find_unpicklable(child, child_path)
        if found is not None:
            return found
    return path, obj, err


_STORAGE_TYPE_CACHE: Dict[torch.dtype, Any] = {}


def _storage_type(dtype: torch.dtype):
    """The storage class ``torch.save`` names for ``dtype``: a legacy ``<Dtype>Storage``, or ``UntypedStorage``
    for the dtypes that have none (float8, uint16/32/64, complex32...: saved in bytes, rebuilt by
    ``_rebuild_tensor_v3`` with the dtype as an argument)."""
    st = _STORAGE_TYPE_CACHE.get(dtype)
    if st is None:
        try:
            name = torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)._pickle_storage_type()
            st = getattr(torch, name)
        except KeyError:
            st = torch.UntypedStorage
        _STORAGE_TYPE_CACHE[dtype] = st
    return st


class _StorageId:
    """Stands for one span in the pickle; pickled as torch's persistent storage id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class _TensorData:
    """Stands for a tensor's data inside an ``nn.Parameter`` reduction."""

    __slots__ = ("ref", "requires_grad", "storage")

    def __init__(self, ref: TensorRef, requires_grad: bool, storage: _StorageId) -> None:
        self.ref, self.requires_grad, self.storage = ref, requires_grad, storage


class _SkeletonPickler(pickle.Pickler):
    """Pass 2: pickles the object with each tensor rebuilt from its span, as torch.save would."""

    def __init__(self, buf: io.BytesIO, refs: Mapping[int, TensorRef]) -> None:
        super().__init__(buf, protocol=PICKLE_PROTOCOL)
        self._refs = refs
        self._storage_ids: Dict[str, _StorageId] = {}
        self.keys: List[str] = []

    def _storage(self, ref: TensorRef) -> _StorageId:
        sid = self._storage_ids.get(ref.key)
        if sid is None:
            self.keys.append(ref.key)
            st = _storage_type(ref.dtype)
            numel = ref.span_numel * ref.dtype.itemsize if st is torch.UntypedStorage else ref.span_numel
            sid = self._storage_ids[ref.key] = _StorageId(("storage", st, ref.key, ref.location, numel))
        return sid

    def _tensor_reduce(self, ref: TensorRef, requires_grad: bool):
        args = (self._storage(ref), ref.storage_offset, ref.size, ref.stride, requires_grad, collections.OrderedDict())
        if _storage_type(ref.dtype) is torch.UntypedStorage:  # as torch.save: the dtype travels in the call
            return torch._utils._rebuild_tensor_v3, args + (ref.dtype,)
        return torch._utils._rebuild_tensor_v2, args

    def reducer_override(self, obj: Any):
        if isinstance(obj, _TensorData):
            return self._tensor_reduce(obj.ref, obj.requires_grad)
        if isinstance(obj, torch.Tensor):
            ref = self._refs.get(id(obj))
            if ref is None:  # pragma: no cover - collect_tensors saw every tensor
                raise SnapshotError("internal: a tensor appeared that the collector did not see")
            if type(obj) is torch.nn.Parameter:
                data = _TensorData(ref, False, self._storage(ref))
                return (torch._utils._rebuild_parameter,
                        (data, obj.requires_grad, collections.OrderedDict()))
            return self._tensor_reduce(ref, obj.requires_grad)
        return NotImplemented

    def persistent_id(self, obj: Any):
        if isinstance(obj, _StorageId):
            return obj.pid
        return None


def pickle_skeleton(obj: Any, refs: Mapping[int, TensorRef]) -> Tuple[bytes, List[str]]:
    """Pickle ``obj`` as ``torch.save``'s ``data.pkl``, each tensor pointing into its span.

    Args:
        obj: the state to pickle (any picklable object holding tensors).
        refs: ``id(tensor) -> TensorRef`` for every tensor :func:`collect_tensors` returned.

    Returns:
        ``(data_pkl_bytes, keys)``: the pickle, and the span keys it references in first-use order.
    """
    buf = io.BytesIO()
    p = _SkeletonPickler(buf, refs)
    p.dump(obj)
    return buf.getvalue(), p.keys


def unpickle_skeleton(data_pkl: bytes, storages: Mapping[str, torch.UntypedStorage], *,
                      weights_only: bool) -> Any:
    """Rebuild the object from ``data.pkl`` bytes and already-loaded span storages (CPU).

    Args:
        data_pkl: bytes produced by :func:`pickle_skeleton` (or a torch.save file's ``data.pkl``).
        storages: ``key -> UntypedStorage`` holding each span's bytes.
        weights_only: use PyTorch's restricted unpickler (tensors and plain containers only).

    Raises:
        UnsafeCheckpointError: ``weights_only`` and the pickle holds other objects.
    """
    if weights_only:
        from torch import _weights_only_unpickler

        up = _weights_only_unpickler.Unpickler(io.BytesIO(data_pkl), encoding="utf-8")
    else:
        up = pickle.Unpickler(io.BytesIO(data_pkl))
    cache: Dict[str, Any] = {}

    def persistent_load(saved_id):
        _, storage_type, key, _location, _numel = saved_id
        typed = cache.get(key)
        if typed is None:
            with warnings.catch_warnings():  # the legacy <Dtype>Storage classes of the format warn on .dtype
                warnings.simplefilter("ignore", UserWarning)
                dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            typed = torch.storage.TypedStorage(wrap_storage=storages[key], dtype=dtype, _internal=True)
            cache[key] = typed
        return typed

    up.persistent_load = persistent_load
    try:
        return up.load()
    except pickle.UnpicklingError as e:
        if weights_only:
            raise UnsafeCheckpointError(
                f"the snapshot holds objects that weights_only=True refuses to unpickle ({e}); if you trust "
                "this checkpoint directory, pass weights_only=False to the Checkpointer"
            ) from e
        raise


def weights_only_refusal(data_pkl: bytes) -> Optional[str]:
    """Why ``torch.load(weights_only=True)`` would refuse this ``data.pkl``, or ``None`` if it would load.

    Runs PyTorch's own weights-only unpickler on the skeleton alone: each storage is a ``meta`` storage
    (no memory, no tensor bytes read), so the cost is that of unpickling the small skeleton.
    """
    from torch import _weights_only_unpickler

    up = _weights_only_unpickler.Unpickler(io.BytesIO(data_pkl), encoding="utf-8")

    def persistent_load(saved_id):
        _, storage_type, _key, _location, numel = saved_id
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype,
                                          _internal=True)

    up.persistent_load = persistent_load
    try:
        up.load()
    except pickle.UnpicklingError as e:
        return str(e)
    return None
