"""Version seams: Python 3.10 versus 3.11+, and the private PyTorch APIs snapckpt relies on.

Python: ``requires-python >= 3.10``; ``BaseException.add_note`` exists from 3.11 only, so notes are added
through :func:`add_note`.

PyTorch (the supported range is :data:`SUPPORTED_TORCH`, as in ``pyproject.toml``): the skeleton pickler of
:mod:`snapckpt.formats.torch_zip` and the loaders use private PyTorch names (the ``torch.save`` archive itself
is written without torch, by :mod:`snapckpt.formats.torch_archive`; :func:`torch_file_writer` is torch's
writer, which its tests compare it with). Each is checked
once, by :func:`check_torch`, and a missing one raises :class:`UnsupportedTorchError` naming the range,
instead of an ``AttributeError`` deep inside a save. What sets the floor (read from the release sources):

- ``torch._C.PyTorchFileWriter(file, compute_crc32)`` and ``torch.serialization.set_crc32_options``:
  PyTorch 2.6 (pytorch/pytorch#137735). The third argument, ``storage_alignment``, came in 2.7
  (pytorch/pytorch#147788); on 2.6 the alignment is the fixed 64 bytes snapckpt writes anyway, see
  :func:`torch_file_writer`.
- ``torch._weights_only_unpickler.Unpickler(file, encoding=)``, ``torch._utils._rebuild_tensor_v2`` /
  ``_rebuild_parameter``, ``TypedStorage._pickle_storage_type``, ``torch.serialization.location_tag``,
  ``torch.distributed.distributed_c10d._get_default_store``: all present in 2.6 and every later release
  checked (2.7, 2.13).
- ``torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION`` (Megatron's ``torch_dist`` writer only):
  added after 2.7 (pytorch/pytorch#155343); older releases' ``FileSystemWriter`` writes no version, and
  ``snapckpt.integrations.megatron.torch_dist`` then writes none either.
"""
from __future__ import annotations

import importlib
import io
from typing import Any, Callable, List, Optional

__all__ = ["SUPPORTED_TORCH", "UnsupportedTorchError", "add_note", "check_torch", "torch_file_writer"]

#: The PyTorch releases snapckpt supports (the ``torch`` requirement in ``pyproject.toml``).
SUPPORTED_TORCH = ">=2.6,<3"


class UnsupportedTorchError(ImportError):
    """The installed PyTorch lacks an API snapckpt uses: install a release in :data:`SUPPORTED_TORCH`."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc``: ``exc.add_note(note)`` on Python 3.11+.

    On 3.10 (no ``add_note``, and tracebacks do not print ``__notes__``) the note is appended to
    ``exc.__notes__`` as 3.11 would, and to the message so that it is seen: to ``strerror`` of an
    ``OSError`` (``str()`` is built from it), else to the single string argument. An exception whose
    arguments are not one string keeps its message; the note is still in ``__notes__``.
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    _add_note_310(exc, note)


def _add_note_310(exc: BaseException, note: str) -> None:
    """The Python 3.10 path of :func:`add_note` (callable on any version, for its tests)."""
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    notes.append(note)
    exc.__notes__ = notes  # type: ignore[attr-defined]
    if isinstance(exc, OSError) and isinstance(exc.strerror, str):
        exc.strerror = f"{exc.strerror}; {note}"
    elif len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",)


def _has(module: str, attr: str) -> bool:
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


# (module, attribute path) of every private or recent PyTorch name the core uses
_TORCH_NAMES = [
    ("torch._C", "PyTorchFileWriter"),
    ("torch._C", "PyTorchFileReader"),
    ("torch.serialization", "set_crc32_options"),
    ("torch.serialization", "get_crc32_options"),
    ("torch.serialization", "location_tag"),
    ("torch._weights_only_unpickler", "Unpickler"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "TypedStorage._pickle_storage_type"),
]

_checked = False


def check_torch(names: Optional[List[tuple]] = None) -> None:
    """Check that the installed PyTorch has every private API snapckpt uses (once per process).

    Raises:
        UnsupportedTorchError: one is missing (the message names it, the installed version and
            :data:`SUPPORTED_TORCH`).
    """
    global _checked
    if _checked and names is None:
        return
    import torch

    missing = []
    for module, attr in names if names is not None else _TORCH_NAMES:
        try:
            ok = _has(module, attr)
        except ImportError:
            ok = False
        if not ok:
            missing.append(f"{module}.{attr}")
    if missing:
        raise UnsupportedTorchError(
            f"snapckpt needs PyTorch {SUPPORTED_TORCH}; the installed torch {torch.__version__} lacks "
            f"{', '.join(missing)}. Install a supported release: pip install 'torch{SUPPORTED_TORCH}'")
    if names is None:
        _checked = True


_writer_takes_alignment: Optional[bool] = None


def torch_file_writer(fileobj: Any, storage_alignment: int) -> Any:
    """``torch._C.PyTorchFileWriter(fileobj, compute_crc32=False, storage_alignment)``, the writer
    ``torch.save`` uses, without per-record CRC-32.

    PyTorch 2.6 takes no ``storage_alignment`` and always aligns records to 64 bytes: it is used there only
    when ``storage_alignment`` is 64.

    Raises:
        UnsupportedTorchError: this PyTorch's writer takes neither signature (older than 2.6), or it is
            2.6 and ``storage_alignment`` is not 64.
    """
    import torch

    global _writer_takes_alignment
    writer_cls: Callable[..., Any] = torch._C.PyTorchFileWriter
    if _writer_takes_alignment is None:
        try:  # probed on a scratch buffer, so that a bad ``fileobj`` is not taken for an old PyTorch
            writer_cls(io.BytesIO(), False, 64)
            _writer_takes_alignment = True
        except TypeError:
            _writer_takes_alignment = False
    if _writer_takes_alignment:
        return writer_cls(fileobj, False, storage_alignment)
    if storage_alignment != 64:
        raise UnsupportedTorchError(f"torch {torch.__version__} aligns torch.save records to 64 bytes only; "
                                    f"{storage_alignment} needs PyTorch 2.7 or newer")
    try:
        return writer_cls(fileobj, False)
    except TypeError as e:
        raise UnsupportedTorchError(
            f"snapckpt needs PyTorch {SUPPORTED_TORCH}: the torch.save writer of torch {torch.__version__} "
            f"cannot turn off its CRC-32 (torch._C.PyTorchFileWriter: {e})") from e

