"""The ``--snapckpt`` flag for Megatron-LM (see :mod:`snapckpt.integrations.megatron.args`).

    import snapckpt.megatron
    pretrain(..., extra_args_provider=snapckpt.megatron.add_arguments)
    snapckpt.megatron.enable(get_args())    # routes save/load_checkpoint through snapckpt, or says why not

The drop-in functions themselves are in :mod:`snapckpt.megatron_dist_ckpt`.
"""
from snapckpt.integrations.megatron.args import EnableResult, add_arguments, checkpointer_options, enable, resolve_flags

__all__ = ["add_arguments", "enable", "EnableResult", "checkpointer_options", "resolve_flags"]
