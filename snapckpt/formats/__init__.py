"""On-disk and in-arena layouts: file specs, the torch.save-compatible zip writer, safetensors files.

The specs are imported on first use (they import torch): the persister imports
:mod:`snapckpt.formats.torch_archive` from this package and runs without torch.
"""
from typing import Any

__all__ = ["Concat", "MemoryOnly", "RawBytes", "TorchSave", "respec", "safetensors_file"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from snapckpt.formats import specs

        return getattr(specs, name)
    raise AttributeError(f"module 'snapckpt.formats' has no attribute {name!r}")
