"""Public import path of the Hugging Face integration: ``from snapckpt.hf import SnapckptCallback``.

See :mod:`snapckpt.integrations.transformers` for how the callback plugs into the ``Trainer`` and
:mod:`snapckpt.integrations.accelerate` for ``Accelerator.save_state`` folders.
"""
from snapckpt.integrations.transformers import SnapckptCallback

__all__ = ["SnapckptCallback"]
