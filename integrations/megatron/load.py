"""Megatron-LM's ``load_checkpoint`` (torch_dist format) through snapckpt: which checkpoint, then restore.

A load (collective, every rank):

1. rank 0 reads ``latest_checkpointed_iteration.txt`` for every rank
   (:func:`~snapckpt.integrations.megatron.tracker.agreed_tracker`);
2. when it names a directory megatron-core wrote natively that is newer than anything snapckpt holds, that
   directory is read with the stock loader; else ``Checkpointer.load_with`` agrees on the newest step with
   every rank: from memory the record is mapped back onto a fresh sharded state dict (same parallel layout
   only; any mismatch falls back to disk, :func:`~snapckpt.integrations.megatron.memory.from_memory`), from
   disk through stock ``megatron.core.dist_checkpointing.load``, which reshards (e.g. DP=2 to TP=2);
3. with no candidate of this world size: snapckpt's directories of another world size, newest intact first
   (:func:`~snapckpt.integrations.megatron.reshard.load_resharded`), then the tracker's native directory;
4. the state goes into the model, optimizer, scheduler, RNGs and Megatron-LM's args counters.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Tuple

from snapckpt import Checkpointer, StorageType
from snapckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, IncompatibleCheckpointError

from snapckpt.integrations.megatron.memory import MEMORY_FILE, from_memory
from snapckpt.integrations.megatron.registry import context_checkpointer, split_options
from snapckpt.integrations.megatron.reshard import FreshFn, load_resharded, newest_snapckpt, stock_load
from snapckpt.integrations.megatron.state import (CONTENT_METADATA_KEY, apply_state, arg, build_state_dict,
                                                  megatron_lm_args, restore_counters, restore_rng, same_tp_pp)
from snapckpt.integrations.megatron.tracker import TRACKER, agreed_tracker

__all__ = ["load_checkpoint"]

log = logging.getLogger(__name__)


def load_checkpoint(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, checkpointing_context: Optional[dict] = None,
                    skip_load_to_model_and_opt: bool = False, *, load_dir: Optional[str] = None,
                    args: Any = None, **checkpointer_options: Any) -> Tuple[int, int]:
    """Megatron-LM's ``load_checkpoint`` (torch_dist format) through snapckpt; collective.

    Loads the newest iteration complete on every rank: from memory when every rank holds it and it is at
    least as new as the newest committed directory, else from disk through stock
    ``megatron.core.dist_checkpointing.load`` (which reshards to the current parallel layout). When snapckpt
    has no candidate of this world size, its newest directory of another world size whose files (every
    saving rank's) pass their checksums is loaded that way; damaged ones are named in warnings. The
    directory named by ``latest_checkpointed_iteration.txt`` is loaded with the stock loader instead when
    megatron-core wrote it natively (no ``.snapckpt`` sidecar) and it is newer than anything snapckpt
    holds. A tracker naming a directory that does not exist is ignored with a warning naming it (then the
    newest native ``iter_*`` directory stands for it, if any).

    Args (Megatron-LM's):
        ddp_model: model chunks (list) or one module, as for ``save_checkpoint``.
        optimizer, opt_param_scheduler: restored unless None (or ``args.no_load_optim`` / ``args.finetune``).
        load_arg: name of the args attribute holding the directory (``load``).
        strict: passed to ``model.load_state_dict``.
        checkpointing_context: dict kept across calls, or None.
        skip_load_to_model_and_opt: read the checkpoint but do not load model and optimizer.
    Keyword-only (snapckpt): ``load_dir`` when Megatron-LM's args are not available; ``args`` as for
        ``save_checkpoint``; ``**checkpointer_options`` for the Checkpointer created on first use.

    Returns:
        ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when there is no checkpoint
        (as Megatron-LM). ``Checkpointer.last_load`` tells the tier and iteration (None for a native
        directory).

    Raises:
        ValueError: no directory given. CheckpointCorruptError: every candidate failed on some rank, or
        every directory snapckpt committed is damaged (each named), or the tracker names a directory that
        does not exist and there is no other checkpoint.
    """
    args = args if args is not None else megatron_lm_args()
    load_dir = load_dir or arg(args, load_arg, None)
    if not load_dir:
        raise ValueError(f"load_checkpoint needs a directory: pass load_dir=... (Megatron-LM's args.{load_arg} "
                         "is not available)")
    if arg(args, "snapckpt_remote_dir", None):  # --snapckpt-remote-dir: a fresh node resumes from it
        checkpointer_options.setdefault("remote_dir", arg(args, "snapckpt_remote_dir", None))
    ck = context_checkpointer(checkpointing_context, load_dir, split_options(checkpointer_options, "load"))
    finetune = arg(args, "finetune", False)
    with_opt = not (arg(args, "no_load_optim", False) or finetune)
    with_rng = not (arg(args, "no_load_rng", False) or finetune)

    def fresh(common: Dict[str, Any]) -> Dict[str, Any]:
        rng = with_rng and same_tp_pp(common)
        if with_rng and not rng:
            log.warning("the checkpoint was saved with another (TP, PP) layout: its RNG states are not loaded "
                        "(as Megatron-LM does)")
        return build_state_dict(args, ddp_model, optimizer, opt_param_scheduler, 0, 0, is_loading=True,
                                with_optimizer=with_opt, with_rng=rng, metadata=common.get(CONTENT_METADATA_KEY))

    got = _read_state(ck, fresh, arg(args, "dist_ckpt_strictness", "assume_ok_unexpected"))
    if got is None:
        return 0, 0
    state, source = got
    log.info("rank %d: loaded iteration %s from %s", ck.rank, state.get("iteration"), source)
    if not skip_load_to_model_and_opt:
        apply_state(state, ddp_model, optimizer, opt_param_scheduler, strict, with_opt)
    if with_rng and "rng_state" in state:
        restore_rng(state["rng_state"], args)
    iteration = 0 if finetune else int(state.get("iteration", 0))
    flops = int(state.get("num_floating_point_operations_so_far", 0))
    if args is not None:
        args.iteration = iteration
        args.num_floating_point_operations_so_far = flops
        if not finetune and state.get("args") is not None:
            restore_counters(args, state["args"])
    return iteration, flops


def agree(ck: Checkpointer, name: str, error: Optional[BaseException]) -> None:
    """All ranks learn whether any rank failed before a collective load starts (so none is left in it).

    Raises:
        ``error`` on the rank that failed; CheckpointCorruptError naming the failed ranks on the others.
    """
    bad = ck.coordinator.agree(name, error)
    if bad:
        if error is not None:
            raise error
        raise CheckpointCorruptError(f"ranks {sorted(bad)} cannot read this checkpoint: {bad}")


def _read_state(ck: Checkpointer, fresh: FreshFn, strictness: str) -> Optional[Tuple[Dict[str, Any], str]]:
    """Steps 1-3 of the module docstring: ``(state, where it came from)``, or None when there is no
    checkpoint at all (a warning says so; training starts at iteration 0). Collective.

    Sets ``ck.last_load`` to None when the state comes from a directory megatron-core wrote natively (no
    snapckpt load took place; the core's ``load_with`` sets it otherwise)."""

    def from_candidate(cand: Any) -> Dict[str, Any]:
        if cand.tier == StorageType.MEMORY:
            files = cand.files()
            return from_memory(fresh(files.get(MEMORY_FILE, {}).get("common", {})), files)
        err = None
        try:
            cand.verify()
        except CheckpointCorruptError as e:
            err = e
        agree(ck, "megatron-verify", err)
        return stock_load(fresh, cand.path, strictness)

    tracker = agreed_tracker(ck)
    state = None
    e: Optional[Exception] = None
    if tracker["native"] and ((newest := newest_snapckpt(ck)) is None or tracker["iteration"] > newest):
        source = f"directory {tracker['dirname']} written by megatron-core"
    else:
        try:
            state, cand = ck.load_with(from_candidate)
            source = f"{cand.tier.value} step {cand.step}"
        except (CheckpointNotFoundError, IncompatibleCheckpointError) as missed:
            e = missed  # handled below, outside this block: its traceback would not belong to what follows
        if e is not None:
            # nothing of this world size: snapckpt's directories of another one, verified, then resharded
            try:
                got = load_resharded(ck, fresh, strictness)
            except CheckpointCorruptError as bad:
                if not tracker["native"]:
                    raise
                log.warning("%s\nloading %s instead, which megatron-core wrote", bad, tracker["dirname"])
                got = None
            if got is not None:
                state, source = got
            elif tracker["dirname"] is None:
                if "ignored" in tracker:
                    raise CheckpointCorruptError(f"{tracker['ignored']}; but there is no other checkpoint in "
                                                 f"{ck.checkpoint_dir}: restore {TRACKER}'s directory, or delete "
                                                 f"{TRACKER} to start afresh")
                log.warning("no checkpoint found in %s (%s); starting from iteration 0", ck.checkpoint_dir, e)
                return None
            elif not tracker["native"]:
                # the tracker names a directory snapckpt committed, yet it is no candidate: it fails its
                # manifest checks (e names the damage); megatron-core's loader must not read it blindly
                raise e
            else:
                source = f"directory {tracker['dirname']} ({e})"
    if state is None:
        ck.last_load = None
        state = stock_load(fresh, os.path.join(ck.checkpoint_dir, tracker["dirname"]), strictness)
    return state, source
