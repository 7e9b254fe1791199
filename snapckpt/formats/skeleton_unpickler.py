"""A fast unpickler for the skeletons of plain states, restricted to fewer globals than ``weights_only=True``.

PyTorch's weights-only unpickler (``torch._weights_only_unpickler``) runs in Python, one opcode at a time:
about 0.3 ms per tensor of a memory snapshot on a 2-core host (200,000 tensors: a minute). The skeleton of a
plain state (:mod:`snapckpt.formats.plain_layout`) names only three globals: ``torch._utils._rebuild_tensor_v2``,
``torch._utils._rebuild_parameter`` and ``collections.OrderedDict``, plus the ``torch.<Dtype>Storage`` classes
inside persistent ids. :func:`load_plain` runs C ``pickle`` with ``find_class`` answering those names only
(a storage class as its name, a string nothing can call) and refusing every other global, so it loads a subset
of what the weights-only unpickler loads. Whatever it refuses or fails on, the caller loads with PyTorch's own
unpickler, whose answer (the object, or the refusal) stands.
"""
from __future__ import annotations

import collections
import io
import pickle
from typing import Any, Callable, Mapping

import torch

__all__ = ["load_plain", "Refused"]


class Refused(Exception):
    """The skeleton is not one :func:`load_plain` loads (the caller uses PyTorch's unpickler instead)."""


def _storage_dtypes() -> Mapping[str, torch.dtype]:
    out = {}
    for name in dir(torch):
        if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
            cls = getattr(torch, name)
            dtype = getattr(cls, "_dtype", None)
            if isinstance(dtype, torch.dtype):
                out[name] = dtype
    return out


_DTYPES = _storage_dtypes()  # "FloatStorage" -> torch.float32, ...


class _Storage:
    """A span's bytes and the dtype the skeleton reads them as (what ``persistent_load`` returns)."""

    __slots__ = ("untyped", "dtype")

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.untyped, self.dtype = untyped, dtype


def _rebuild_tensor(storage: Any, storage_offset: int, size: tuple, stride: tuple, requires_grad: bool,
                    backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` for CPU spans, without its fake-mode lookup (no fake tensors here)."""
    if type(storage) is not _Storage:
        raise Refused("a tensor whose storage is not a persistent id")
    t = torch.empty((0,), dtype=storage.dtype).set_(storage.untyped, storage_offset, size, stride)
    if requires_grad:
        t.requires_grad = True
    if metadata:
        torch._utils.set_tensor_metadata(t, metadata)
    if backward_hooks:
        t._backward_hooks = backward_hooks
    return t


def _sealed(fn: Callable, name: str) -> type:
    """``fn`` as a class whose call calls ``fn``: pickle's BUILD on a function would set its attributes for the
    whole process (``__qualname__``, ``__defaults__``...; PyTorch's weights-only unpickler refuses it), BUILD
    on this class calls its ``__setstate__``, which refuses naming the global (``name``)."""
    def refuse(cls, state: Any) -> None:
        raise Refused(f"BUILD (__setstate__) on the global {name}")
    return type(fn.__name__, (), {"__slots__": (), "__new__": staticmethod(lambda cls, *args: fn(*args)),
                                  "__setstate__": classmethod(refuse)})


_GLOBALS: Mapping[tuple, Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _sealed(_rebuild_tensor, "torch._utils._rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"): _sealed(torch._utils._rebuild_parameter,
                                                     "torch._utils._rebuild_parameter"),
    ("collections", "OrderedDict"): collections.OrderedDict,  # a builtin type: BUILD on it fails (TypeError)
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _DTYPES:
            return name  # only a persistent id's storage type: a string, which nothing can call
        raise Refused(f"global {module}.{name}")


def load_plain(data_pkl: bytes, storage: Callable[[str], torch.UntypedStorage]) -> Any:
    """Unpickle a skeleton whose globals are those of a plain state; CPU tensors viewing the spans.

    Args:
        data_pkl: ``data.pkl`` bytes (:func:`snapckpt.formats.torch_zip.pickle_skeleton`).
        storage: the bytes of a span by its key (called once per key).

    Raises:
        Refused: another global, or a malformed persistent id.
        Exception: any error of a damaged pickle (the caller retries with PyTorch's unpickler).
    """
    up = _Unpickler(io.BytesIO(data_pkl))
    cache: dict = {}

    def persistent_load(saved_id: Any) -> _Storage:
        if type(saved_id) is not tuple or len(saved_id) != 5 or saved_id[0] != "storage":
            raise Refused("a persistent id that is not a storage")
        _, type_name, key, _location, _numel = saved_id
        s = cache.get(key)
        if s is None:
            if type(type_name) is not str or type_name not in _DTYPES or type(key) is not str:
                raise Refused("a persistent id of an unknown storage type")
            s = cache[key] = _Storage(storage(key), _DTYPES[type_name])
        return s

    up.persistent_load = persistent_load
    return up.load()
