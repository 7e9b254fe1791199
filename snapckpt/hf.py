"""Public import path of the Hugging Face integrations.

- ``SnapckptCallback``: ``Trainer(..., callbacks=[SnapckptCallback(...)])`` (see
  :mod:`snapckpt.integrations.transformers.callback`);
- ``AcceleratorCheckpointer``: ``Accelerator.save_state`` folders written in the background (see
  :mod:`snapckpt.integrations.accelerate`).

``SnapckptCallback`` is imported on first use of the name (it needs transformers), so that
``from snapckpt.hf import AcceleratorCheckpointer`` works where only accelerate is installed.
"""
from typing import TYPE_CHECKING, Any

from snapckpt.integrations.accelerate import AcceleratorCheckpointer

if TYPE_CHECKING:  # for type checkers and linters only; at run time see __getattr__
    from snapckpt.integrations.transformers.callback import SnapckptCallback

__all__ = ["AcceleratorCheckpointer", "SnapckptCallback"]


def __getattr__(name: str) -> Any:
    """``SnapckptCallback``, imported lazily (PEP 562): the callback module imports transformers.

    Raises:
        ImportError: transformers (the ``hf`` extra) is not installed.
        AttributeError: any other name.
    """
    if name == "SnapckptCallback":
        from snapckpt.integrations.transformers.callback import SnapckptCallback

        globals()[name] = SnapckptCallback  # later look-ups skip this function
        return SnapckptCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(__all__))
