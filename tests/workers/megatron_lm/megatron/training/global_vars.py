"""Stand-in for ``megatron.training.global_vars``: the args, timers and TensorBoard writer of the job."""
_ARGS = None
_TIMERS = None
_TENSORBOARD_WRITER = None


def set_global_variables(args):
    """As Megatron-LM's initialization: ``Timers(args.timing_log_level, args.timing_log_option)`` on every
    rank, a ``SummaryWriter(args.tensorboard_dir)`` on the last rank only."""
    global _ARGS, _TIMERS, _TENSORBOARD_WRITER
    from megatron.core.timers import Timers

    _ARGS = args
    _TIMERS = Timers(args.timing_log_level, args.timing_log_option)
    if args.tensorboard_dir and args.rank == args.world_size - 1:
        from torch.utils.tensorboard import SummaryWriter

        _TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir)


def get_args():
    assert _ARGS is not None, "args is not initialized."
    return _ARGS


def get_timers():
    assert _TIMERS is not None, "timers is not initialized."
    return _TIMERS


def get_tensorboard_writer():
    return _TENSORBOARD_WRITER
