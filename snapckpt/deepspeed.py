"""Public import path of the DeepSpeed integration (code: ``snapckpt.integrations.deepspeed``).

::

    from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType
    checkpointer = DeepSpeedCheckpointer(engine, checkpoint_dir)
    checkpointer.save_checkpoint(checkpoint_dir, tag=step, storage_type=StorageType.MEMORY)
    checkpointer.load_checkpoint(checkpoint_dir)

or ``engine, *_ = snapckpt.deepspeed.initialize(..., config={..., "snapckpt": {...}})``.
"""
from snapckpt.integrations.deepspeed import (DeepSpeedCheckpointer, DeepSpeedSnapckptConfig, SnapckptCheckpointEngine,
                                     StorageType, initialize)

__all__ = ["DeepSpeedCheckpointer", "DeepSpeedSnapckptConfig", "SnapckptCheckpointEngine", "StorageType",
           "initialize"]
