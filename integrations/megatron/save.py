"""Megatron-LM's ``save_checkpoint`` (torch_dist format) through snapckpt: the save side of the data path.

A save (collective, every rank):

1. the state dict Megatron-LM builds (``generate_state_dict``: ``model`` / ``model{i}``, ``optimizer``,
   ``opt_param_scheduler``, ``rng_state`` as a ``ShardedObject``, ``iteration``,
   ``num_floating_point_operations_so_far``, ``checkpoint_version``, ``args`` when known), from the
   model's and optimizer's own ``sharded_state_dict()`` (:func:`~snapckpt.integrations.megatron.state.build_state_dict`);
2. megatron-core's ``save_preprocess`` (factories, common part, sharding validation) and, for DISK, its
   DCP planning with :class:`~snapckpt.integrations.megatron.torch_dist.ArenaDistcpWriter`: the ``.distcp``
   files become ``Concat`` specs, rank 0 adds ``.metadata``, ``common.pt`` and ``metadata.json``;
3. a ``MemoryOnly`` record ``snapckpt_memory.pt`` lets every rank reload its own shards from memory
   (:mod:`~snapckpt.integrations.megatron.memory`);
4. ``Checkpointer.save_files``: the copy into the arena; the persister writes and commits, then writes
   the tracker (:data:`~snapckpt.integrations.megatron.tracker.TRACKER`).

A MEMORY save (``storage_type=MEMORY`` or ``non_persistent_ckpt=True``) skips the DCP planning (no
collective): the snapshot is the record of step 3 with every tensor.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any, Callable, Dict, Optional

from snapckpt import StorageType, check_step
from snapckpt.formats import Concat, MemoryOnly, RawBytes, TorchSave

from snapckpt.integrations.megatron.memory import MEMORY_FILE, memory_record
from snapckpt.integrations.megatron.metrics import check_writer, report_to
from snapckpt.integrations.megatron.registry import context_checkpointer, split_options
from snapckpt.integrations.megatron.state import (arg, build_state_dict, megatron_lm_args,
                                                  megatron_lm_sharded_sd_metadata)
from snapckpt.integrations.megatron.torch_dist import ArenaDistcpWriter
from snapckpt.integrations.megatron.tracker import TRACKER, checkpoint_dirname

__all__ = ["expect_checkpoint", "save_checkpoint", "step_files"]


class _PlanCache:
    """megatron-core's cached save structure (``--ckpt-assume-constant-structure``): the local and central
    DCP plans and the coordinator's global metadata of the previous save, reused once two saves planned the
    same (the logic of ``TorchDistSaveShardedStrategy.async_save`` with ``cached_metadata=True``)."""

    def __init__(self) -> None:
        self.central: Any = None
        self.local: Any = None
        self.validated = False
        self.metadata: Any = None
        self.sharding_validated = False


_plan_caches: Dict[str, _PlanCache] = {}  # one per checkpoint directory (absolute path)


def step_files(sharded_sd: Dict[str, Any], path: str, storage_type: StorageType, rank: int,
               validate: bool, preprocess_common_fn: Optional[Callable], thread_count: int,
               cache: Optional[_PlanCache] = None) -> Dict[str, Any]:
    """This rank's files of one save (see the module docstring, steps 2-3): file name -> file spec.

    Args:
        sharded_sd: the sharded state dict of step 1.
        path: the checkpoint's directory (``<save>/iter_%07d``), as megatron-core's writer names it.
        storage_type: MEMORY (only the ``MemoryOnly`` record, no collective) or DISK.
        rank: this rank (rank 0 adds ``.metadata``, ``common.pt``, ``metadata.json``).
        validate: megatron-core's sharding validation (a collective; DISK only).
        preprocess_common_fn: megatron-core's common-state consistency check, or None.
        thread_count: ``.distcp`` files of this rank.
        cache: with constant structure assumed, the sharding is validated once and the DCP plans reused.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize, save_state_dict_async_plan)
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    memory = storage_type == StorageType.MEMORY
    validate = validate and not memory and not (cache is not None and cache.sharding_validated)
    sharded, common = save_preprocess(sharded_sd, validate, None if memory else preprocess_common_fn)
    if cache is not None and validate:
        cache.sharding_validated = True
    if memory:
        return {MEMORY_FILE: MemoryOnly(memory_record(sharded, common, {}))}  # never flushed to disk
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)
    pyt_sd = mcore_to_pyt_state_dict(flat, False)
    writer = ArenaDistcpWriter(path, thread_count=thread_count)
    cached = None if cache is None else (cache.central, cache.local, cache.validated)
    planned = save_state_dict_async_plan(
        pyt_sd, writer, None, 0, planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        cached_ckpt_structure=cached)
    ret = planned[0]
    if cache is not None:
        _, cache.central, cache.local, cache.validated, _ = planned
        if cache.validated:
            if ret[1] is not None:
                cache.metadata = ret[1]
            elif rank == 0:
                ret = (ret[0], cache.metadata, ret[2])
    save_state_dict_async_finalize(*ret)
    files: Dict[str, Any] = {name: Concat(parts) for name, parts in writer.files.items()}
    written = {(idx.fqn, tuple(idx.offset)): loc for idx, loc in writer.item_locations.items()
               if idx.offset is not None}
    files[MEMORY_FILE] = MemoryOnly(memory_record(sharded, common, written))
    if rank == 0:
        files[".metadata"] = RawBytes(writer.metadata_bytes)
        files["common.pt"] = TorchSave(common)
        files["metadata.json"] = RawBytes(json.dumps(asdict(CheckpointingConfig("torch_dist", 1))).encode())
    return files


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: int, checkpointing_context: Optional[dict] = None,
                    pipeline_rank: Optional[int] = None, expert_rank: Optional[int] = None,
                    tensor_rank: Optional[int] = None, pipeline_parallel: Optional[bool] = None,
                    expert_parallel: Optional[bool] = None, non_persistent_ckpt: bool = False,
                    train_data_iterator: Any = None, preprocess_common_state_dict_fn: Optional[Callable] = None,
                    release: bool = False, *, save_dir: Optional[str] = None,
                    storage_type: StorageType = StorageType.DISK, args: Any = None,
                    validate_access_integrity: bool = True, thread_count: int = 2,
                    assume_constant_structure: Optional[bool] = None,
                    sharded_sd_metadata: Optional[Dict[str, Any]] = None, tensorboard_writer: Any = None,
                    **checkpointer_options: Any):
    """Megatron-LM's ``save_checkpoint`` (torch_dist format) through snapckpt; collective.

    Args (Megatron-LM's, same order):
        iteration: training iteration, an ``int`` in ``[0, 2**63 - 1]``; names ``iter_%07d`` and is the snapckpt step.
        model: the model chunks (a list, as Megatron-LM passes it) or one module; DDP/Float16 wrappers are
            unwrapped; each chunk provides ``sharded_state_dict()``.
        optimizer: a megatron-core ``MegatronOptimizer`` (``sharded_state_dict``), a plain ``torch.optim``
            optimizer, or None.
        opt_param_scheduler: anything with ``state_dict()``, or None.
        num_floating_point_operations_so_far: returned again by ``load_checkpoint``.
        checkpointing_context: a dict kept across calls (the Checkpointer is cached in it), or None.
        pipeline_rank, expert_rank, tensor_rank, pipeline_parallel, expert_parallel, train_data_iterator:
            accepted for signature compatibility; the torch_dist format does not use them.
        non_persistent_ckpt: Megatron-LM's non-persistent checkpoint: taken to the MEMORY tier.
        preprocess_common_state_dict_fn: passed to megatron-core's common-state consistency check.
        release: save as ``release`` (tracker content ``release``).
    Keyword-only (snapckpt):
        save_dir: checkpoint directory when Megatron-LM's ``args.save`` is not available.
        storage_type: ``StorageType.DISK`` (default: written and committed in the background) or ``MEMORY``.
        args: Megatron-LM-style args (``save``, ``no_save_optim``, ``no_save_rng``,
            ``data_parallel_random_init``, ``snapckpt_keep_last``); read from ``megatron.training`` when
            importable and not given. Saved into ``common.pt`` as Megatron-LM does.
        validate_access_integrity: megatron-core's sharding validation (a collective) on DISK saves.
        thread_count: ``.distcp`` files per rank (megatron-core's default strategy writes 2).
        assume_constant_structure: Megatron-LM's ``--ckpt-assume-constant-structure`` (default: read from
            ``args``, else False): validate the sharding once and reuse the DCP plans of earlier saves.
        sharded_sd_metadata: Megatron-LM's sharded-state-dict metadata (default: built by Megatron-LM from
            ``args`` when it is importable, else None: megatron-core's defaults); saved as the checkpoint's
            ``content_metadata``.
        tensorboard_writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar(tag, value,
            global_step)``), or a function of no argument returning one or None: from this save on, each
            checkpoint's ``snapckpt/*`` metrics of this rank are written to it at the iteration saved
            (:mod:`~snapckpt.integrations.megatron.metrics`). None: as before (none unless an earlier
            call gave one). Pass it on the rank that logs; ``None`` on the others.
        **checkpointer_options: options for the Checkpointer created on first use (``keep_last``...);
            arguments of other Megatron-LM versions (``ft_client``, process groups: ``OTHER_VERSION_KEYWORDS``
            in ``registry.py``) are ignored; any other keyword raises ``TypeError``.

    Returns:
        the :class:`~snapckpt.SaveHandle` (Megatron-LM's returns None): ``wait()`` blocks until
        committed (DISK) or held (MEMORY).

    Raises:
        ValueError: no directory (neither ``args.save`` nor ``save_dir``), or a bad iteration.
        TypeError: ``tensorboard_writer`` is neither a writer nor a function (nothing is saved).
        snapckpt errors of :meth:`Checkpointer.save`.
    """
    args = args if args is not None else megatron_lm_args()
    save_dir = save_dir or arg(args, "save", None)
    if not save_dir:
        raise ValueError("save_checkpoint needs a directory: pass save_dir=... (Megatron-LM's args.save is not "
                         "available)")
    check_step(iteration, "iteration")
    check_writer(tensorboard_writer, "tensorboard_writer")
    storage_type = StorageType.MEMORY if non_persistent_ckpt else StorageType(storage_type)
    keep_last = arg(args, "snapckpt_keep_last", None)
    if keep_last is not None:
        checkpointer_options.setdefault("keep_last", keep_last)
    if arg(args, "snapckpt_remote_dir", None):  # --snapckpt-remote-dir: the remote tier
        checkpointer_options.setdefault("remote_dir", arg(args, "snapckpt_remote_dir", None))
    ck = context_checkpointer(checkpointing_context, save_dir, split_options(checkpointer_options, "save"))
    if tensorboard_writer is not None:
        report_to(ck, tensorboard_writer)
    if sharded_sd_metadata is None and args is not None:
        sharded_sd_metadata = megatron_lm_sharded_sd_metadata(args)
    sd = build_state_dict(args, model, optimizer, opt_param_scheduler, iteration,
                          num_floating_point_operations_so_far, is_loading=False,
                          with_optimizer=not arg(args, "no_save_optim", False),
                          with_rng=not arg(args, "no_save_rng", False), metadata=sharded_sd_metadata)
    dirname = checkpoint_dirname(iteration, release)
    if assume_constant_structure is None:
        assume_constant_structure = bool(arg(args, "ckpt_assume_constant_structure", False))
    cache = _plan_caches.setdefault(ck.checkpoint_dir, _PlanCache()) if assume_constant_structure else None
    files = step_files(sd, os.path.join(ck.checkpoint_dir, dirname), storage_type, ck.rank,
                       validate_access_integrity, preprocess_common_state_dict_fn, thread_count, cache)
    return ck.save_files(files, iteration, storage_type, dirname=dirname, tracker_name=TRACKER,
                         tracker_content="release" if release else str(iteration))


def expect_checkpoint(model: Any, optimizer: Any, *, save_dir: str, **checkpointer_options: Any) -> bool:
    """Have the persister reserve this rank's arena for a checkpoint of ``model`` and ``optimizer``, in the
    background (:meth:`snapckpt.Checkpointer.expect`), so that the first ``save_checkpoint`` does not allocate its
    shared memory on the training thread. Call it on every rank once the optimizer made its state (after the first
    iteration) and before the first save; the ``--snapckpt`` flag path does. Collective: it creates the directory's
    Checkpointer when this process has none yet (``checkpointer_options`` as :func:`save_checkpoint`'s), and builds
    the sharded state dict once, as a save does (the bytes counted: each ``ShardedTensor``'s local data).

    Returns:
        bool: whether a reservation started (see :meth:`snapckpt.Checkpointer.expect`).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from snapckpt.integrations.megatron.registry import get_checkpointer

    sd = build_state_dict(None, model, optimizer, None, 0, 0, is_loading=False, with_optimizer=True, with_rng=False)
    data = [sh.data for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]
    return get_checkpointer(save_dir, **checkpointer_options).expect(data)
