"""Megatron integration: ``torch_dist`` checkpoints through snapckpt (public faces:
:mod:`snapckpt.megatron_dist_ckpt` and :mod:`snapckpt.megatron`)."""
