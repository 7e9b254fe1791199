"""Megatron: ``save_checkpoint`` / ``load_checkpoint`` in Megatron's ``torch_dist`` layout through snapckpt.

Public face: :mod:`snapckpt.megatron_dist_ckpt` (the drop-in functions) and :mod:`snapckpt.megatron` (the
``--snapckpt`` flag). Layout (Megatron-LM's, unchanged)::

    <save>/iter_0000100/__{rank}_{n}.distcp, .metadata, common.pt, metadata.json   (+ .snapckpt/manifest.json)
    <save>/latest_checkpointed_iteration.txt        written by the committer after the commit: "100"

A save (collective, every rank):

1. the state dict Megatron-LM builds (``generate_state_dict``: ``model`` / ``model{i}``, ``optimizer``,
   ``opt_param_scheduler``, ``rng_state`` as a ``ShardedObject``, ``iteration``,
   ``num_floating_point_operations_so_far``, ``checkpoint_version``, ``args`` when known), from the
   model's and optimizer's own ``sharded_state_dict()``;
2. megatron-core's ``save_preprocess`` (factories, common part, sharding validation) and, for DISK, its
   DCP planning with :class:`~snapckpt.integrations.megatron_format.ArenaDistcpWriter`: the ``.distcp``
   files become ``Concat`` specs, rank 0 adds ``.metadata``, ``common.pt`` and ``metadata.json``;
3. a ``MemoryOnly`` record ``snapckpt_memory.pt`` lets every rank reload its own shards from memory
   (the tensors it wrote itself are read back from its ``.distcp`` bytes; the replicas it did not write,
   its sharded objects and the common state are kept in the record);
4. ``Checkpointer._save_files``: the copy into the arena; the persister writes and commits.

A MEMORY save (``storage_type=MEMORY`` or ``non_persistent_ckpt=True``) skips the DCP planning (no
collective): the snapshot is the record of step 3 with every tensor.

A load agrees on the newest step with every rank (``Checkpointer._load_with``): from memory the record is
mapped back onto a fresh sharded state dict (same parallel layout only; any mismatch falls back to disk);
from disk through stock ``megatron.core.dist_checkpointing.load``, which reshards (e.g. DP=2 to TP=2). A
directory megatron-core wrote natively (no snapckpt manifest), or one of another world size, is loaded
through ``latest_checkpointed_iteration.txt`` and the stock loader.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from snapckpt import Checkpointer, StorageType
from snapckpt.errors import (CheckpointCorruptError, CheckpointNotFoundError, IncompatibleCheckpointError)
from snapckpt.formats import Concat, MemoryOnly, RawBytes, TorchSave

from .megatron_format import ArenaDistcpWriter

__all__ = ["save_checkpoint", "load_checkpoint", "get_checkpointer", "checkpoint_dirname", "TRACKER",
           "MEMORY_FILE", "close_all"]

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MEMORY_FILE = "snapckpt_memory.pt"
CHECKPOINT_VERSION = 3.0
PARALLEL_KEY = "snapckpt_parallel_layout"  # in common.pt: the (TP, PP) sizes of the run that saved it
_checkpointers: Dict[str, Checkpointer] = {}


# --------------------------------------------------------------------------------------------- helpers
def checkpoint_dirname(iteration: int, release: bool = False) -> str:
    """Megatron-LM's directory name of an iteration: ``iter_%07d`` (``release`` for a release)."""
    return "release" if release else f"iter_{iteration:07d}"


def _megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's global ``args`` when ``megatron.training`` is importable and initialized, else None."""
    try:
        from megatron.training import get_args  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return get_args()
    except Exception:  # imported but not initialized (no parse_args yet)
        return None


def _arg(args: Any, name: str, default: Any) -> Any:
    v = getattr(args, name, None) if args is not None else None
    return default if v is None else v


def get_checkpointer(checkpoint_dir: str, **options: Any) -> Checkpointer:
    """The process's :class:`~snapckpt.Checkpointer` of ``checkpoint_dir`` (created on first use; collective).

    ``weights_only`` defaults to False: Megatron checkpoints hold ``argparse.Namespace`` args, numpy RNG
    states and pickled sharded objects, and megatron-core itself loads them with ``weights_only=False``;
    only load directories you trust.
    """
    key = os.path.abspath(checkpoint_dir)
    ck = _checkpointers.get(key)
    if ck is None or ck._closed:
        options.setdefault("weights_only", False)
        ck = _checkpointers[key] = Checkpointer(key, **options)
    return ck


def close_all() -> None:
    """Wait for outstanding commits and close every Checkpointer this module opened."""
    while _checkpointers:
        _, ck = _checkpointers.popitem()
        ck.close()


def _model_chunks(model: Any) -> List[Any]:
    from megatron.core.utils import unwrap_model

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [unwrap_model(m) for m in chunks]


def _rng_state(args: Any) -> Any:
    """Megatron-LM's ``rng_state`` ShardedObject: python, numpy, torch, CUDA and the RNG tracker's states."""
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    states = [state]
    if _arg(args, "data_parallel_random_init", False) and ps.get_data_parallel_world_size() > 1:
        states = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(states, state, group=ps.get_data_parallel_group())
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", states, (pp_size, tp_size), (pp_rank, tp_rank),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _restore_rng(states: List[Dict[str, Any]], args: Any) -> None:
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if _arg(args, "data_parallel_random_init", False) and len(states) > 1:
        state = states[ps.get_data_parallel_rank()]
    else:
        state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


# ------------------------------------------------------------------------------- optimizer adapters
def _is_megatron_optimizer(optimizer: Any) -> bool:
    return hasattr(optimizer, "sharded_state_dict")


def _plain_params(optimizer: torch.optim.Optimizer) -> List[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _plain_optimizer_sharded(optimizer: torch.optim.Optimizer, model_sd: Dict[str, Any],
                             is_loading: bool) -> Dict[str, Any]:
    """A plain ``torch.optim`` optimizer's state as a sharded state dict (per-parameter tensors sharded like
    their parameter; scalar per-parameter values such as Adam's ``step`` kept in the common part)."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    if is_loading:
        _prime_plain_optimizer(optimizer)
    sd = optimizer.state_dict()
    sd["state"] = {pid: dict(st) for pid, st in sd["state"].items()}  # the live optimizer's dicts otherwise
    params = _plain_params(optimizer)
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    scalars: Dict[int, Dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for k in [k for k, v in st.items() if not (torch.is_tensor(v) and v.dim() > 0)]:
            scalars.setdefault(pid, {})[k] = st.pop(k)
    optim_state_to_sharding_state(sd, id_map)
    sd["snapckpt_scalars"] = scalars
    return sd


def _prime_plain_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create a plain optimizer's lazily-built per-parameter state (one step on zero gradients, parameters
    and gradients restored), so a sharded state dict for loading has every state tensor."""
    params = [p for p in _plain_params(optimizer) if p not in optimizer.state or not optimizer.state[p]]
    if not params:
        return
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad


def _plain_optimizer_load(optimizer: torch.optim.Optimizer, loaded: Dict[str, Any]) -> None:
    scalars = loaded.pop("snapckpt_scalars", {})
    for pid, extra in scalars.items():
        loaded["state"].setdefault(int(pid), {}).update(extra)
    optimizer.load_state_dict(loaded)


# --------------------------------------------------------------------------------- state dict build
def _state_dict(args: Any, model: Any, optimizer: Any, scheduler: Any, iteration: int, flops: int,
                is_loading: bool, with_optimizer: bool, with_rng: bool) -> Dict[str, Any]:
    """The sharded state dict Megatron-LM's ``generate_state_dict`` builds for torch_dist."""
    chunks = _model_chunks(model)
    sd: Dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                          "num_floating_point_operations_so_far": flops}
    if args is not None:
        sd["args"] = args
    if len(chunks) == 1:
        sd["model"] = chunks[0].sharded_state_dict()
        model_sd = sd["model"]
    else:
        for i, m in enumerate(chunks):
            sd[f"model{i}"] = m.sharded_state_dict()
        model_sd = {k: sd[k] for k in sd if k.startswith("model")}
    if optimizer is not None and with_optimizer:
        if _is_megatron_optimizer(optimizer):
            sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        else:
            sd["optimizer"] = _plain_optimizer_sharded(optimizer, model_sd, is_loading)
    if scheduler is not None and with_optimizer:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_state(args)
    sd[PARALLEL_KEY] = _parallel_layout()
    return sd


def _parallel_layout() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size()}


def _same_tp_pp(common: Dict[str, Any]) -> bool:
    """Whether the checkpoint (its common state) has this run's (TP, PP): Megatron-LM's condition for
    loading the RNG states, which are sharded by (PP, TP)."""
    saved = common.get(PARALLEL_KEY)
    if saved is None and common.get("args") is not None:
        a = common["args"]
        saved = {k: getattr(a, k, None) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")}
    return saved is None or saved == _parallel_layout()


def _sid(sh: Any) -> str:
    """A key naming one ShardedTensor/ShardedObject of this rank (stable across saves of one layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(sh, ShardedObject):
        return f"O|{sh.unique_key}"
    fr = sh.flattened_range
    flat = "" if fr is None else f"{fr.start}:{fr.stop}"
    return f"T|{sh.key}|{tuple(sh.global_offset)}|{flat}"


def _memory_record(sharded: Dict[str, Any], common: Dict[str, Any],
                   written: Dict[Tuple[str, Tuple[int, ...]], Tuple[str, int, int]]) -> Dict[str, Any]:
    """The per-rank record a memory-tier load maps back: tensors (those not in ``written``), references
    ``(file, offset, length)`` into this rank's ``.distcp`` files for those in it, objects, common state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tensors: Dict[str, torch.Tensor] = {}
    refs: Dict[str, List[Any]] = {}
    objects: Dict[str, Any] = {}
    for sh in nested_values(sharded):
        sid = _sid(sh)
        if isinstance(sh, ShardedObject):
            objects[sid] = sh.data
            continue
        where = written.get((sh.key, tuple(sh.global_offset))) if sh.flattened_range is None else None
        if where is not None:
            refs[sid] = list(where)
        else:
            tensors[sid] = sh.data.detach()  # a device tensor is copied straight into host memory
    return {"format_version": 1, "tensors": tensors, "refs": refs, "objects": objects, "common": common}


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


_plan_caches: Dict[str, _PlanCache] = {}


def _step_files(sharded_sd: Dict[str, Any], path: str, storage_type: StorageType, rank: int,
                validate: bool, preprocess_common_fn: Optional[Callable], thread_count: int,
                cache: Optional[_PlanCache] = None) -> Dict[str, Any]:
    """This rank's files of one save (see the module docstring, steps 2-3). With ``cache`` (constant
    structure assumed) the sharding is validated once and the DCP plans are reused."""
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
        return {MEMORY_FILE: _memory_record(sharded, common, {})}
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
    files[MEMORY_FILE] = MemoryOnly(_memory_record(sharded, common, written))
    if rank == 0:
        files[".metadata"] = RawBytes(writer.metadata_bytes)
        files["common.pt"] = TorchSave(common)
        files["metadata.json"] = RawBytes(json.dumps(asdict(CheckpointingConfig("torch_dist", 1))).encode())
    return files


# ------------------------------------------------------------------------------------------ save
def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: int, checkpointing_context: Optional[dict] = None,
                    pipeline_rank: Optional[int] = None, expert_rank: Optional[int] = None,
                    tensor_rank: Optional[int] = None, pipeline_parallel: Optional[bool] = None,
                    expert_parallel: Optional[bool] = None, non_persistent_ckpt: bool = False,
                    train_data_iterator: Any = None, preprocess_common_state_dict_fn: Optional[Callable] = None,
                    release: bool = False, *, save_dir: Optional[str] = None,
                    storage_type: StorageType = StorageType.DISK, args: Any = None,
                    validate_access_integrity: bool = True, thread_count: int = 2,
                    assume_constant_structure: Optional[bool] = None, **checkpointer_options: Any):
    """Megatron-LM's ``save_checkpoint`` (torch_dist format) through snapckpt; collective.

    Args (Megatron-LM's, same order):
        iteration: training iteration (int >= 0); names ``iter_%07d`` and is the snapckpt step.
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
        **checkpointer_options: options for the Checkpointer created on first use (``keep_last``...);
            other keywords (arguments of other Megatron-LM versions, e.g. ``ft_client``) are ignored.

    Returns:
        the :class:`~snapckpt.handle.SaveHandle` (Megatron-LM's returns None): ``wait()`` blocks until
        committed (DISK) or held (MEMORY).

    Raises:
        ValueError: no directory (neither ``args.save`` nor ``save_dir``), or a bad iteration.
        snapckpt errors of :meth:`Checkpointer.save`.
    """
    args = args if args is not None else _megatron_lm_args()
    save_dir = save_dir or _arg(args, "save", None)
    if not save_dir:
        raise ValueError("save_checkpoint needs a directory: pass save_dir=... (Megatron-LM's args.save is not "
                         "available)")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    storage_type = StorageType.MEMORY if non_persistent_ckpt else StorageType(storage_type)
    keep_last = _arg(args, "snapckpt_keep_last", None)
    if keep_last is not None:
        checkpointer_options.setdefault("keep_last", keep_last)
    ck = _context_checkpointer(checkpointing_context, save_dir, _split_options(checkpointer_options, "save"))
    sd = _state_dict(args, model, optimizer, opt_param_scheduler, iteration,
                     num_floating_point_operations_so_far, is_loading=False,
                     with_optimizer=not _arg(args, "no_save_optim", False),
                     with_rng=not _arg(args, "no_save_rng", False))
    dirname = checkpoint_dirname(iteration, release)
    if assume_constant_structure is None:
        assume_constant_structure = bool(_arg(args, "ckpt_assume_constant_structure", False))
    cache = _plan_caches.setdefault(ck.checkpoint_dir, _PlanCache()) if assume_constant_structure else None
    files = _step_files(sd, os.path.join(ck.checkpoint_dir, dirname), storage_type, ck.rank,
                        validate_access_integrity, preprocess_common_state_dict_fn, thread_count, cache)
    return ck._save_files(files, iteration, storage_type, dirname=dirname, tracker_name=TRACKER,
                          tracker_content="release" if release else str(iteration))


def _split_options(kwargs: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Checkpointer options out of ``kwargs``; other keywords are Megatron-LM arguments of other versions
    (``ft_client``...), which the torch_dist path does not use: logged and ignored."""
    import dataclasses

    from snapckpt.options import CheckpointOptions

    names = {f.name for f in dataclasses.fields(CheckpointOptions)}
    ignored = sorted(k for k in kwargs if k not in names)
    if ignored:
        log.debug("%s: ignoring Megatron-LM arguments %s", where, ignored)
    return {k: v for k, v in kwargs.items() if k in names}


def _context_checkpointer(context: Optional[dict], directory: str, options: Dict[str, Any]) -> Checkpointer:
    if context is not None:
        ck = context.get("snapckpt")
        if ck is not None and not ck._closed and ck.checkpoint_dir == os.path.abspath(directory):
            return ck
    ck = get_checkpointer(directory, **options)
    if context is not None:
        context["snapckpt"] = ck
    return ck


# ------------------------------------------------------------------------------------------ load
def _from_memory(sharded_sd: Dict[str, Any], files: Dict[str, Any]) -> Dict[str, Any]:
    """Map this rank's memory record back onto ``sharded_sd`` (what ``dist_checkpointing.load`` returns).

    Raises:
        IncompatibleCheckpointError: a shard is missing or of another shape (the parallel layout changed).
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    if MEMORY_FILE not in files:
        raise IncompatibleCheckpointError(f"the memory snapshot has no {MEMORY_FILE} (not a Megatron snapshot)")
    rec = files[MEMORY_FILE]
    sharded, nonpersistent, factories = load_preprocess(sharded_sd)
    state = rec["common"]
    merge(state, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)

    def fill(sh: Any) -> Any:
        if not isinstance(sh, ShardedBase):
            return sh
        sid = _sid(sh)
        if isinstance(sh, ShardedObject):
            if sid not in rec["objects"]:
                raise IncompatibleCheckpointError(f"memory snapshot lacks sharded object {sid}")
            return rec["objects"][sid]
        if sid in rec["tensors"]:
            t = rec["tensors"][sid]
        elif sid in rec["refs"]:
            name, off, length = rec["refs"][sid]
            t = torch.load(io.BytesIO(memoryview(files[name])[off:off + length]), map_location="cpu",
                           weights_only=True)
        else:
            raise IncompatibleCheckpointError(f"memory snapshot lacks shard {sid} (parallel layout changed?)")
        if tuple(t.shape) != tuple(sh.data.shape) and t.numel() == sh.data.numel():
            t = t.reshape(sh.data.shape)
        if tuple(t.shape) != tuple(sh.data.shape):
            raise IncompatibleCheckpointError(f"memory snapshot shard {sid} has shape {tuple(t.shape)}, the "
                                              f"model needs {tuple(sh.data.shape)}")
        return t

    dict_list_map_inplace(fill, sharded)
    merge(state, sharded)
    return apply_factory_merges(state, factories)


def _agree(ck: Checkpointer, name: str, error: Optional[BaseException]) -> None:
    """All ranks learn whether any rank failed before a collective load starts (so none is left in it)."""
    everyone = ck._coord.all_gather(name, {"error": "" if error is None else f"{type(error).__name__}: {error}"},
                                    ck.options.coordination_timeout_secs)
    bad = {r: p["error"] for r, p in enumerate(everyone) if p["error"]}
    if bad:
        if error is not None:
            raise error
        raise CheckpointCorruptError(f"ranks {sorted(bad)} cannot read this checkpoint: {bad}")


def _read_tracker(directory: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, TRACKER)) as f:
            content = f.read().strip()
    except FileNotFoundError:
        return None
    if content == "release":
        return "release"
    if not content.isdigit():
        raise CheckpointCorruptError(f"{os.path.join(directory, TRACKER)} holds {content!r}, not an iteration; "
                                     "fix or delete it")
    return checkpoint_dirname(int(content))


def load_checkpoint(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, checkpointing_context: Optional[dict] = None,
                    skip_load_to_model_and_opt: bool = False, *, load_dir: Optional[str] = None,
                    args: Any = None, **checkpointer_options: Any) -> Tuple[int, int]:
    """Megatron-LM's ``load_checkpoint`` (torch_dist format) through snapckpt; collective.

    Loads the newest iteration complete on every rank: from memory when every rank holds it and it is at
    least as new as the newest committed directory, else from disk through stock
    ``megatron.core.dist_checkpointing.load`` (which reshards to the current parallel layout). Without a
    snapckpt-committed candidate of this world size, the directory named by
    ``latest_checkpointed_iteration.txt`` is loaded with the stock loader (checkpoints megatron-core wrote
    natively, or another world size).

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
        (as Megatron-LM). ``Checkpointer.last_load`` tells the tier (None for a native directory).

    Raises:
        ValueError: no directory given. CheckpointCorruptError: every candidate failed on some rank.
    """
    args = args if args is not None else _megatron_lm_args()
    load_dir = load_dir or _arg(args, load_arg, None)
    if not load_dir:
        raise ValueError(f"load_checkpoint needs a directory: pass load_dir=... (Megatron-LM's args.{load_arg} "
                         "is not available)")
    ck = _context_checkpointer(checkpointing_context, load_dir, _split_options(checkpointer_options, "load"))
    finetune = _arg(args, "finetune", False)
    strictness = _arg(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    with_opt = not (_arg(args, "no_load_optim", False) or finetune)
    with_rng = not (_arg(args, "no_load_rng", False) or finetune)

    def fresh(common: Dict[str, Any]) -> Dict[str, Any]:
        rng = with_rng and _same_tp_pp(common)
        if with_rng and not rng:
            log.warning("the checkpoint was saved with another (TP, PP) layout: its RNG states are not loaded "
                        "(as Megatron-LM does)")
        return _state_dict(args, ddp_model, optimizer, opt_param_scheduler, 0, 0, is_loading=True,
                           with_optimizer=with_opt, with_rng=rng)

    def from_candidate(cand: Any) -> Dict[str, Any]:
        if cand.tier == StorageType.MEMORY:
            files = cand.files()
            return _from_memory(fresh(files.get(MEMORY_FILE, {}).get("common", {})), files)
        err = None
        try:
            cand.verify()
        except CheckpointCorruptError as e:
            err = e
        _agree(ck, "megatron-verify", err)
        return _stock_load(fresh, cand.path, strictness)

    try:
        state, cand = ck._load_with(from_candidate)
        source = f"{cand.tier.value} step {cand.step}"
    except (CheckpointNotFoundError, IncompatibleCheckpointError) as e:
        dirname = _read_tracker(ck.checkpoint_dir)
        if dirname is None:
            log.warning("no checkpoint found in %s (%s); starting from iteration 0", ck.checkpoint_dir, e)
            return 0, 0
        ck.last_load = None
        state = _stock_load(fresh, os.path.join(ck.checkpoint_dir, dirname), strictness)
        source = f"native directory {dirname}"
    log.info("rank %d: loaded iteration %s from %s", ck.rank, state.get("iteration"), source)
    if not skip_load_to_model_and_opt:
        _apply(state, ddp_model, optimizer, opt_param_scheduler, strict, with_opt)
    if with_rng and "rng_state" in state:
        _restore_rng(state["rng_state"], args)
    iteration = 0 if finetune else int(state.get("iteration", 0))
    flops = int(state.get("num_floating_point_operations_so_far", 0))
    if args is not None:
        args.iteration = iteration
        args.num_floating_point_operations_so_far = flops
        if not finetune and state.get("args") is not None:
            _restore_counters(args, state["args"])
    return iteration, flops


def _restore_counters(args: Any, saved: Any) -> None:
    """Megatron-LM's consumed/skipped sample counters from the checkpoint's args (the data position), and
    the micro-batch calculator brought up to date, as Megatron-LM's loader does."""
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        if hasattr(saved, name):
            setattr(args, name, getattr(saved, name))
    try:
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        update_num_microbatches(consumed_samples=getattr(args, "consumed_train_samples", 0), verbose=False)
    except Exception:  # the calculator is not initialized outside Megatron-LM's loop
        pass


def _stock_load(fresh: Callable[[Dict[str, Any]], Dict[str, Any]], path: str,
                strictness: str = "assume_ok_unexpected") -> Dict[str, Any]:
    """Stock ``dist_checkpointing.load`` of ``path`` into ``fresh(common state)`` (collective), with
    Megatron-LM's ``--dist-ckpt-strictness``."""
    import argparse

    from megatron.core import dist_checkpointing

    # common.pt holds Megatron-LM's args when they were saved; megatron-core loads it with torch.load's
    # default weights_only=True, so allow the Namespace as Megatron-LM itself does.
    torch.serialization.add_safe_globals([argparse.Namespace])
    common = dist_checkpointing.load_common_state_dict(path)
    state = dist_checkpointing.load(fresh(common), path, strict=strictness)
    return state[0] if isinstance(state, tuple) else state  # strictness modes that also return mismatches


def _apply(state: Dict[str, Any], model: Any, optimizer: Any, scheduler: Any, strict: bool,
           with_opt: bool) -> None:
    chunks = _model_chunks(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"], strict=strict)
    else:
        for i, m in enumerate(chunks):
            m.load_state_dict(state[f"model{i}"], strict=strict)
    if optimizer is not None and with_opt and "optimizer" in state:
        if _is_megatron_optimizer(optimizer):
            optimizer.load_state_dict(state["optimizer"])
        else:
            _plain_optimizer_load(optimizer, state["optimizer"])
    if scheduler is not None and with_opt and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
