"""Stand-in for ``megatron.training.training``: its loop's use of ``train_step``, ``save_checkpoint`` and
the timers (names looked up as module globals at each call, which is what ``enable``'s rebinding relies on)."""
from megatron.training.checkpointing import load_checkpoint, save_checkpoint  # noqa: F401  (rebound by enable)
from megatron.training.global_vars import get_args, get_timers


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    raise NotImplementedError("set by the test worker: one forward/backward/optimizer step")


def preprocess_common_state_dict(common_state_dict):
    """What megatron-core compares across ranks: ``args`` without the per-rank fields (as Megatron-LM's)."""
    out = dict(common_state_dict)
    out["args"] = {k: v for k, v in vars(out["args"]).items() if k not in ("rank", "local_rank")}
    return out


def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                             checkpointing_context, non_persistent_ckpt=False):
    """Megatron-LM times every save it makes itself, under these two names, and logs the timer."""
    timers = get_timers()
    key = "save-checkpoint-non-persistent" if non_persistent_ckpt else "save-checkpoint"
    timers(key, log_level=0).start(barrier=False)
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context, non_persistent_ckpt=non_persistent_ckpt,
                    preprocess_common_state_dict_fn=preprocess_common_state_dict)
    timers(key).stop(barrier=False)
    timers.log([key])


def train(forward_step_func, model, optimizer, opt_param_scheduler, data_iterator, config, checkpointing_context):
    """Iterations ``args.iteration`` to ``args.train_iters``; a disk save every ``args.save_interval``."""
    args = get_args()
    iteration = args.iteration
    while iteration < args.train_iters:
        args.curr_iteration = iteration
        train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config)
        iteration += 1
        args.consumed_train_samples += args.global_batch_size
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                     args.num_floating_point_operations_so_far, checkpointing_context)
    return iteration
