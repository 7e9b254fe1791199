"""Public import path of the Hugging Face integrations.

- ``SnapckptCallback``: ``Trainer(..., callbacks=[SnapckptCallback(...)])`` (see
  :mod:`snapckpt.integrations.transformers.callback`);
- ``AcceleratorCheckpointer``: ``Accelerator.save_state`` folders written in the background (see
  :mod:`snapckpt.integrations.accelerate`).
"""
from snapckpt.integrations.accelerate import AcceleratorCheckpointer
from snapckpt.integrations.transformers.callback import SnapckptCallback

__all__ = ["AcceleratorCheckpointer", "SnapckptCallback"]
