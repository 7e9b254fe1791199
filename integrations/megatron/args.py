"""The ``--snapckpt`` flag for Megatron-LM: argparse options and the switch that routes checkpoints.

Megatron-LM has no checkpoint-engine hook: its training loop calls ``save_checkpoint`` /
``load_checkpoint`` imported into ``megatron.training.training`` from ``megatron.training.checkpointing``.
:func:`enable` therefore rebinds those two names in both modules (the only seam there is), and wraps
``megatron.training.training.train_step``: it fences an overlapped snapshot copy before the iteration,
learns of finished commits after it (so their ``committed`` events, and the durable time they carry,
come within an iteration), and takes a MEMORY snapshot every ``--snapckpt-memory-interval`` iterations.
``--snapckpt-disk-interval`` becomes Megatron-LM's ``--save-interval``: its own loop saves to disk,
through snapckpt, at those iterations.

Each checkpoint's ``snapckpt/*`` metrics go to Megatron-LM's TensorBoard writer, and the wrapper's memory
snapshots to its timers (:mod:`~snapckpt.integrations.megatron.metrics`).

Megatron-LM's own flags map onto the tiers (see :func:`resolve_flags`): ``--non-persistent-save-interval N``
(any ``--non-persistent-ckpt-type``) is the memory tier, taken by Megatron-LM's own loop every N
iterations (its ``save_checkpoint(..., non_persistent_ckpt=True)`` becomes a MEMORY snapshot), so
``--snapckpt-memory-interval`` is its alias; ``--async-save`` is what snapckpt's disk tier does anyway
(Megatron-LM's async queue stays empty; its finalize calls return at once).

Usage in a Megatron-LM pretraining script::

    import snapckpt.megatron
    pretrain(..., extra_args_provider=snapckpt.megatron.add_arguments)   # before initialize_megatron
    snapckpt.megatron.enable(get_args())                                   # after it, before training
"""
from __future__ import annotations

import argparse
import atexit
import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from snapckpt import SnapshotPolicy, StorageType

from snapckpt.integrations.megatron.metrics import NON_PERSISTENT_TIMER, megatron_lm_timed, megatron_lm_writer
from snapckpt.integrations.megatron.registry import fence, poll

__all__ = ["add_arguments", "enable", "EnableResult", "resolve_flags"]

log = logging.getLogger(__name__)
_ENABLED: Optional["EnableResult"] = None  # the result of the enable() that routed, once it has


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    v = _nonnegative_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add snapckpt's options to ``parser`` and return it (usable as Megatron-LM's ``extra_args_provider``).

    Options: ``--snapckpt`` (on/off), ``--snapckpt-memory-interval N`` (iterations between memory
    snapshots; 0: none), ``--snapckpt-disk-interval N`` (iterations between disk checkpoints; replaces
    ``--save-interval``; 0: keep ``--save-interval``), ``--snapckpt-keep-last K`` (committed checkpoints
    kept; default all), ``--snapckpt-shm-dir PATH`` (shared-memory directory, default ``/dev/shm``),
    ``--snapckpt-on-slot-busy {wait,skip}`` (what a snapshot does when the persister is behind),
    ``--snapckpt-overlap`` (the snapshot copy runs on a copy thread; see :func:`snapckpt.megatron_dist_ckpt.fence`),
    ``--snapckpt-remote-dir URL`` (the remote tier, ``s3://bucket/run1``: every committed checkpoint is also
    uploaded there, and a fresh node resumes from it; docs/remote.md).
    """
    g = parser.add_argument_group("snapckpt", "asynchronous checkpoints to memory and disk (snapckpt)")
    g.add_argument("--snapckpt", action="store_true", help="route save/load_checkpoint through snapckpt")
    g.add_argument("--snapckpt-memory-interval", type=_nonnegative_int, default=0,
                   help="iterations between memory snapshots (0: none)")
    g.add_argument("--snapckpt-disk-interval", type=_nonnegative_int, default=0,
                   help="iterations between disk checkpoints (replaces --save-interval; 0: keep it)")
    g.add_argument("--snapckpt-keep-last", type=_positive_int, default=None,
                   help="committed checkpoints to keep (default: all)")
    g.add_argument("--snapckpt-shm-dir", default=None, help="shared-memory directory (default /dev/shm)")
    g.add_argument("--snapckpt-on-slot-busy", choices=("wait", "skip"), default="wait",
                   help="when every arena slot is busy: wait for the persister, or skip the snapshot")
    g.add_argument("--snapckpt-overlap", action="store_true",
                   help="copy snapshots on a copy thread while training goes on (fenced before the next step)")
    g.add_argument("--snapckpt-remote-dir", default=None, metavar="URL",
                   help="remote tier, an object store URL such as s3://bucket/run1 (default: $SNAPCKPT_REMOTE_DIR)")
    return parser


@dataclass(frozen=True)
class EnableResult:
    """What :func:`enable` did: ``enabled`` (routed or not), ``reason`` (one sentence), ``routed`` (the
    names rebound, e.g. ``megatron.training.training.save_checkpoint``)."""

    enabled: bool
    reason: str
    routed: Tuple[str, ...] = ()


def checkpointer_options(args: Any) -> dict:
    """Checkpointer options from the parsed flags."""
    opts: dict = {"on_slot_busy": getattr(args, "snapckpt_on_slot_busy", "wait") or "wait"}
    if getattr(args, "snapckpt_keep_last", None) is not None:
        opts["keep_last"] = args.snapckpt_keep_last
    if getattr(args, "snapckpt_shm_dir", None):
        opts["shm_dir"] = args.snapckpt_shm_dir
    if getattr(args, "snapckpt_overlap", False):
        opts["overlap"] = True
    if getattr(args, "snapckpt_remote_dir", None):
        opts["remote_dir"] = args.snapckpt_remote_dir
    return opts


def resolve_flags(args: Any) -> Tuple[int, bool, str]:
    """How Megatron-LM's checkpoint flags map onto snapckpt's tiers.

    Returns ``(memory_interval, wrap_train_step, description)``: iterations between MEMORY snapshots (0:
    none); whether :func:`enable` must take them itself by wrapping ``train_step`` (``--snapckpt-memory-
    interval``) or Megatron-LM's loop takes them (``--non-persistent-save-interval``, whose non-persistent
    saves the routed ``save_checkpoint`` turns into MEMORY snapshots, whatever ``--non-persistent-ckpt-type``
    says); and one sentence for the log.

    Raises:
        ValueError: ``--snapckpt-memory-interval`` and ``--non-persistent-save-interval`` are both set and
            differ (two schedules for one tier): the message names both and the fix.
    """
    ours = getattr(args, "snapckpt_memory_interval", 0) or 0
    theirs = getattr(args, "non_persistent_save_interval", None) or 0
    if ours and theirs and ours != theirs:
        raise ValueError(f"--snapckpt-memory-interval {ours} and --non-persistent-save-interval {theirs} both set "
                         "the memory tier's schedule: give one of them (they are aliases with --snapckpt)")
    notes = []
    if theirs:
        kind = getattr(args, "non_persistent_ckpt_type", None) or "global"
        notes.append(f"--non-persistent-save-interval {theirs} (--non-persistent-ckpt-type {kind}) is served by "
                     "snapckpt's memory tier")
    if getattr(args, "async_save", False):
        notes.append("--async-save is what snapckpt's disk tier does (Megatron-LM's async queue stays empty)")
    interval = theirs or ours
    return interval, bool(ours) and not theirs, "; ".join(notes)


def enable(args: Any) -> EnableResult:
    """Route Megatron-LM's checkpointing through snapckpt when ``args.snapckpt`` is set; say what happened.

    Returns an :class:`EnableResult` and logs it (INFO when routed, WARNING when the flag is on but nothing
    could be routed). Nothing is changed when the flag is off or Megatron-LM (``megatron.training``) is
    not importable; then call :func:`snapckpt.megatron_dist_ckpt.save_checkpoint` /
    ``load_checkpoint`` from your own loop.

    Raises:
        ValueError: the flag is on but ``args`` has no ``save`` directory, or two flags set the memory
            tier's schedule (:func:`resolve_flags`).
    """
    global _ENABLED
    if _ENABLED is not None:  # model_provider may run more than once (virtual pipeline chunks)
        return _ENABLED
    if not getattr(args, "snapckpt", False):
        result = EnableResult(False, "--snapckpt is off: Megatron-LM checkpoints as usual")
        log.info("snapckpt: %s", result.reason)
        return result
    try:
        import megatron.training.checkpointing as mcheckpointing  # type: ignore[import-not-found]
        import megatron.training.training as mtraining  # type: ignore[import-not-found]
    except ImportError as e:
        result = EnableResult(False, f"--snapckpt is on but Megatron-LM is not importable ({e}); nothing was "
                                     "routed: call snapckpt.megatron_dist_ckpt.save_checkpoint/load_checkpoint "
                                     "from your training loop")
        log.warning("snapckpt: %s", result.reason)
        return result
    if not getattr(args, "save", None):
        raise ValueError("--snapckpt needs --save (the checkpoint directory)")
    memory_interval, wrap, mapped = resolve_flags(args)
    # imported here, not at the top: they import megatron-core, which snapckpt.megatron must not need
    from snapckpt.integrations.megatron.load import load_checkpoint
    from snapckpt.integrations.megatron.registry import close_all_at_exit
    from snapckpt.integrations.megatron.save import save_checkpoint

    opts = checkpointer_options(args)
    save = functools.partial(save_checkpoint, tensorboard_writer=megatron_lm_writer, **opts)
    load = functools.partial(load_checkpoint, **opts)
    routed = []
    for mod, name in ((mcheckpointing, "megatron.training.checkpointing"), (mtraining, "megatron.training.training")):
        for fn_name, fn in (("save_checkpoint", save), ("load_checkpoint", load)):
            if hasattr(mod, fn_name):
                setattr(mod, fn_name, fn)
                routed.append(f"{name}.{fn_name}")
    if getattr(args, "snapckpt_disk_interval", 0):
        args.save_interval = args.snapckpt_disk_interval
    if hasattr(mtraining, "train_step"):
        from snapckpt.integrations.megatron.save import expect_checkpoint

        reserve = functools.partial(expect_checkpoint, save_dir=args.save, **opts)
        mtraining.train_step = _with_memory_snapshots(mtraining.train_step, args, save, memory_interval if wrap else 0,
                                                      reserve)
        routed.append("megatron.training.training.train_step")
    atexit.register(close_all_at_exit)
    result = _ENABLED = EnableResult(True, f"checkpoints go through snapckpt (memory every "
                                f"{memory_interval or 'never'}, disk every "
                                f"{getattr(args, 'save_interval', None)} iterations)"
                                + (f"; {mapped}" if mapped else ""), tuple(routed))
    log.info("snapckpt: %s; rebound %s", result.reason, ", ".join(routed))
    return result


def _with_memory_snapshots(train_step: Any, args: Any, save: Any, interval: Optional[int] = None,
                           reserve: Optional[Any] = None) -> Any:
    """``train_step`` between a fence and a poll, followed every ``interval`` iterations by a MEMORY snapshot.

    Megatron-LM's ``train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
    config, ...)`` runs iteration ``args.curr_iteration``. Before it, :func:`fence`: with ``overlap=True``
    the copy of the last snapshot ends before this iteration's optimizer step (inside ``train_step``), so
    the copy overlaps only Megatron-LM's own work between two iterations. After it, :func:`poll`: the
    commits finished meanwhile are learnt (their events fire; a background failure is raised here).

    ``interval`` (default ``args.snapckpt_memory_interval``; 0: no snapshots) is :func:`memory_policy`'s
    schedule, decided on the iterations done after each ``train_step``; the snapshot is of the state
    after it, timed with Megatron-LM's timer ``save-checkpoint-non-persistent`` as its loop times its own
    non-persistent saves. Megatron-LM's loop advances ``args.consumed_train_samples`` and its
    floating-point-operation count only after ``train_step`` returns, so the snapshot records them as the
    loop will have them: consumed samples plus this iteration's global batch, and the count of the last
    disk save plus Megatron-LM's ``num_floating_point_operations`` of each iteration since (0 where that
    function is missing).

    ``reserve(model, optimizer)`` (:func:`~snapckpt.integrations.megatron.save.expect_checkpoint`) runs once, after
    the first ``train_step`` (the optimizer's state exists then): the arena is reserved for the checkpoint's size
    before the first save. A failure there is logged, not raised: it is a size hint.
    """
    interval = args.snapckpt_memory_interval if interval is None else interval
    flops = {"so_far": getattr(args, "num_floating_point_operations_so_far", 0) or 0}
    pending = [reserve] if reserve is not None else []

    @functools.wraps(train_step)
    def wrapped(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *rest, **kw):
        fence()  # an overlapped copy of the last snapshot ends before this iteration's optimizer step
        out = train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *rest, **kw)
        poll()
        if pending:
            try:
                pending.pop()(model, optimizer)
            except Exception as e:  # noqa: BLE001 - a size hint only: the first save sizes its slot itself
                log.info("snapckpt: no arena reserved ahead of the first save: %s", e)
        if not interval:
            return out
        batch = _global_batch_size(args)
        flops["so_far"] = max(flops["so_far"], getattr(args, "num_floating_point_operations_so_far", 0) or 0)
        flops["so_far"] += _iteration_flops(args, batch)
        done = getattr(args, "curr_iteration", -1) + 1
        policy = memory_policy(interval, getattr(args, "save_interval", None))
        if done > 0 and policy.decide(done, 0.0, 0.0) == StorageType.MEMORY:
            after = argparse.Namespace(**vars(args))
            after.consumed_train_samples = (getattr(args, "consumed_train_samples", 0) or 0) + batch
            with megatron_lm_timed(NON_PERSISTENT_TIMER):
                save(done, model, optimizer, opt_param_scheduler, flops["so_far"], storage_type=StorageType.MEMORY,
                     args=after)
        return out

    return wrapped


def memory_policy(memory_interval: int, save_interval: Any) -> SnapshotPolicy:
    """The wrapper's schedule as the core's :class:`~snapckpt.SnapshotPolicy`: a MEMORY snapshot every
    ``memory_interval`` iterations, except at Megatron-LM's own disk saves (every ``save_interval``
    iterations; None or 0: none), where ``decide`` answers DISK and the wrapper takes nothing. By steps
    only: the seconds ``decide`` is given do not matter.

    Args:
        memory_interval: ``--snapckpt-memory-interval``, an int >= 1.
        save_interval: Megatron-LM's ``--save-interval`` (iterations), or None.
    Raises:
        ValueError: ``memory_interval`` is not an int >= 1 (from :class:`~snapckpt.SnapshotPolicy`).
    """
    return SnapshotPolicy(memory_interval_steps=memory_interval,
                          disk_interval_steps=abs(int(save_interval)) if save_interval else None)


def _global_batch_size(args: Any) -> int:
    """Samples of one iteration, as Megatron-LM's loop counts them."""
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return ps.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
    except Exception:  # not initialized the Megatron-LM way
        return getattr(args, "global_batch_size", 0) or 0


def _iteration_flops(args: Any, batch: int) -> int:
    try:
        from megatron.training.training import num_floating_point_operations  # type: ignore[import-not-found]

        return int(num_floating_point_operations(args, batch))
    except Exception:
        return 0
