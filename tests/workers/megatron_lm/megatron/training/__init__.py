"""Stand-in for Megatron-LM's ``megatron.training`` (see ../../README.md): its global getters."""
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers  # noqa: F401
