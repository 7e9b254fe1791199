"""File specs: how one file of a rank's snapshot is laid out on disk (integrations pick one per file).

A snapshot is ``{relative file name: value}``. A plain value is a :class:`TorchSave`. The others let an
integration write its framework's native files without the persister ever running framework code:

- :class:`TorchSave` ``(obj)``: the file ``torch.save(obj, path)`` writes (a zip of a pickle and one raw
  record per storage; see :mod:`snapckpt.formats.torch_zip`).
- :class:`RawBytes` ``(data)``: ``data`` verbatim (a JSON file, a tracker-like text file).
- :class:`Concat` ``(parts)``: ``bytes`` and tensors back to back, each tensor as its raw bytes in native
  byte order (the building block of safetensors files and of formats that store raw tensor records).
- :class:`MemoryOnly` ``(value)``: kept in the rank's memory snapshot, never written to disk (a file a
  rank needs to reload from memory although another rank owns it on disk).

Each of the first three takes ``mode``: the file's permission bits on disk (``None``, the default: as
``open(path, "wb")`` creates it, ``0o666`` less the umask), for a framework whose own save sets them
(``safetensors.torch.save_file`` writes ``0o600``, DeepSpeed makes ``zero_to_fp32.py`` executable). The
mode is recorded in the manifest, and kept by the memory tier's write-out and by downloads from the remote
tier.

:func:`safetensors_file` builds a :class:`Concat` in the safetensors format.
"""
from __future__ import annotations

import functools
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from snapckpt.errors import SnapshotError

__all__ = ["TorchSave", "RawBytes", "Concat", "MemoryOnly", "safetensors_file", "safetensors_mode", "unwrap",
           "respec", "check_mode"]


def check_mode(mode: Optional[int]) -> Optional[int]:
    """``mode`` if it is ``None`` or permission bits (an int in ``0 .. 0o777``: read, write and execute for
    user, group and others; setuid, setgid and sticky bits are never written, so they are refused rather
    than recorded in the manifest for a file that does not have them).

    Raises:
        ValueError: anything else.
    """
    if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777):
        shown = oct(mode) if type(mode) is int and mode > 0 else repr(mode)
        raise ValueError(f"a file mode must be permission bits such as 0o644 (an int in 0..0o777; setuid, "
                         f"setgid and sticky bits are not written) or None, got {shown}")
    return mode


@dataclass(frozen=True)
class TorchSave:
    """A file written exactly as ``torch.save(obj, path)`` would write it (``obj``: any picklable object
    holding tensors). Loaded back with ``torch.load``. ``mode``: its permission bits (module docstring)."""

    obj: Any
    mode: Optional[int] = None

    def __post_init__(self) -> None:
        check_mode(self.mode)


@dataclass(frozen=True)
class RawBytes:
    """A file holding ``data`` verbatim (``bytes``). Loaded back as ``bytes``. ``mode``: its permission bits
    (module docstring).

    Raises:
        TypeError: ``data`` is not bytes. ValueError: a bad ``mode``.
    """

    data: bytes
    mode: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise TypeError(f"RawBytes needs bytes, got {type(self.data).__name__}")
        check_mode(self.mode)

    @classmethod
    def from_file(cls, path: str) -> "RawBytes":
        """The file at ``path`` as it is: its whole content (``bytes``) and its permission bits
        (``0o777`` of the open file's mode, e.g. ``0o755`` for an executable script; setuid, setgid and
        sticky bits are dropped, see :func:`check_mode`).

        Raises:
            OSError: ``path`` cannot be opened or read (``FileNotFoundError``, ``IsADirectoryError``, ...).
        """
        with open(path, "rb") as f:
            return cls(f.read(), os.fstat(f.fileno()).st_mode & 0o777)


@dataclass(frozen=True)
class Concat:
    """A file made of ``parts`` back to back: ``bytes`` verbatim, tensors as their raw bytes.

    Each tensor must be contiguous (its bytes are one range of its storage) and of a plain dtype; its
    bytes are copied into the snapshot like any tensor (so later mutation does not reach the file) and
    written in native byte order (little-endian on every platform PyTorch supports). Loaded back as
    ``bytes`` (the whole file). ``mode``: its permission bits (module docstring).

    Raises:
        SnapshotError: a tensor part is not contiguous.
        TypeError: a part is neither ``bytes`` nor a tensor.
        ValueError: a bad ``mode``.
    """

    parts: Tuple[Union[bytes, torch.Tensor], ...]
    mode: Optional[int] = None

    def __init__(self, parts: Sequence[Union[bytes, torch.Tensor]], mode: Optional[int] = None) -> None:
        out = []
        for i, p in enumerate(parts):
            if isinstance(p, torch.Tensor):
                if not p.is_contiguous():
                    raise SnapshotError(f"Concat part {i} (shape {tuple(p.shape)}) is not contiguous; pass "
                                        "t.contiguous()")
                out.append(p)
            elif isinstance(p, (bytes, bytearray, memoryview)):
                out.append(bytes(p))
            else:
                raise TypeError(f"Concat part {i} must be bytes or a tensor, got {type(p).__name__}")
        object.__setattr__(self, "parts", tuple(out))
        object.__setattr__(self, "mode", check_mode(mode))

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes."""
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else len(p) for p in self.parts)


@dataclass(frozen=True)
class MemoryOnly:
    """``value`` (any spec or plain object) is part of the memory snapshot but not of the disk checkpoint."""

    value: Any


def unwrap(value: Any) -> Tuple[Any, bool]:
    """``(spec, persist)``: the file spec of a snapshot value (plain objects become :class:`TorchSave`) and
    whether it is written to disk."""
    persist = True
    while isinstance(value, MemoryOnly):
        value, persist = value.value, False
    if not isinstance(value, (TorchSave, RawBytes, Concat)):
        value = TorchSave(value)
    return value, persist


# safetensors dtype names (source: the safetensors format specification, huggingface/safetensors README,
# "Format" section; the same table as safetensors.torch._TYPES).
_ST_DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


@functools.lru_cache(maxsize=None)
def safetensors_mode() -> Optional[int]:
    """The permission bits ``safetensors.torch.save_file`` gives the files it writes in this process (0.8
    writes through a temporary file created ``0o600``, whatever the umask), found once by letting it write an
    empty file; ``None`` (the default mode) where safetensors is not installed or the probe cannot be
    written (a full or read-only temporary directory must not fail a save)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="snapckpt-st-mode-") as d:
            path = os.path.join(d, "probe.safetensors")
            save_file({}, path)
            return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None


def safetensors_file(tensors: Mapping[str, torch.Tensor],
                     metadata: Optional[Mapping[str, str]] = None) -> Concat:
    """A safetensors file of ``tensors`` (``{name: contiguous tensor}``), as a :class:`Concat` with the mode
    ``safetensors.torch.save_file`` gives its files (:func:`safetensors_mode`).

    Layout (safetensors format): an 8-byte little-endian header size ``N``, ``N`` bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with
    spaces to a multiple of 8, then each tensor's bytes in the order of the header's offsets. Tensors are
    laid out in sorted name order, as ``safetensors.torch.save_file`` does. ``safetensors.torch.load_file``
    reads the result.

    Raises:
        SnapshotError: a tensor is not contiguous, or two names share memory (safetensors refuses shared
            tensors; save one name and tie on load, as transformers does).
        TypeError: an unsupported dtype or a non-string metadata value.
    """
    header: Dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    parts: list = []
    offset = 0
    seen: Dict[Tuple[int, int], str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        if not t.is_contiguous():
            raise SnapshotError(f"tensor {name!r} is not contiguous; pass t.contiguous() to safetensors_file")
        n = t.numel() * t.element_size()
        if n:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in seen:
                raise SnapshotError(f"tensors {seen[key]!r} and {name!r} share memory; safetensors stores each "
                                    "tensor once: drop one name (and tie them again on load)")
            seen[key] = name
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
        parts.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return Concat([len(raw).to_bytes(8, "little"), raw] + parts, mode=safetensors_mode())


def respec(files: Mapping[str, Any], modes: Optional[Mapping[str, int]] = None) -> Dict[str, Any]:
    """Files read back from a snapshot (``LoadCandidate.files()``: ``bytes`` for raw files, unpickled objects
    for torch files) as specs to save again: ``bytes`` become :class:`RawBytes`, anything else a
    :class:`TorchSave`; ``modes`` (``LoadCandidate.modes()``): the permission bits they were saved with."""
    modes = modes or {}
    return {k: RawBytes(v, modes.get(k)) if isinstance(v, (bytes, bytearray)) else TorchSave(v, modes.get(k))
            for k, v in files.items()}
