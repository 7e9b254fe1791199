"""Megatron-LM's checkpoint state dict built from megatron-core's pieces, and its restoration.

:func:`build_state_dict` is what Megatron-LM's ``generate_state_dict`` builds for the torch_dist format
(``model`` / ``model{i}``, ``optimizer``, ``opt_param_scheduler``, ``rng_state`` as a ``ShardedObject``
sharded by (PP, TP), ``iteration``, ``num_floating_point_operations_so_far``, ``checkpoint_version``, ``args``
when known), plus the (TP, PP) sizes under :data:`PARALLEL_KEY` so a loader knows whether the RNG states
fit. Optimizers: megatron-core's (``sharded_state_dict``) or a plain ``torch.optim`` one, whose
per-parameter tensors are sharded like their parameters (megatron-core's ``optim_state_to_sharding_state``).
"""
from __future__ import annotations

import random
from typing import Any, Dict, List, Optional

import torch

__all__ = ["build_state_dict", "apply_state", "restore_rng", "restore_counters", "same_tp_pp",
           "megatron_lm_args", "megatron_lm_sharded_sd_metadata", "arg", "model_chunks", "CHECKPOINT_VERSION",
           "PARALLEL_KEY", "CONTENT_METADATA_KEY"]

CHECKPOINT_VERSION = 3.0
PARALLEL_KEY = "snapckpt_parallel_layout"  # in common.pt: the (TP, PP) sizes of the run that saved it
CONTENT_METADATA_KEY = "content_metadata"  # megatron-core's serialization._CONTENT_METADATA_KEY


def megatron_lm_sharded_sd_metadata(args: Any) -> Optional[Dict[str, Any]]:
    """Megatron-LM's ``sharded_sd_metadata`` for ``args`` (its ``_build_sharded_state_dict_metadata``) when
    Megatron-LM is importable, else None (megatron-core's defaults)."""
    try:
        from megatron.training.checkpointing import (  # type: ignore[import-not-found]
            _build_sharded_state_dict_metadata)
    except ImportError:
        return None
    return _build_sharded_state_dict_metadata(args)


def megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's global ``args`` when ``megatron.training`` is importable and initialized, else None."""
    try:
        from megatron.training import get_args  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return get_args()
    except Exception:  # imported but not initialized (no parse_args yet)
        return None


def arg(args: Any, name: str, default: Any) -> Any:
    v = getattr(args, name, None) if args is not None else None
    return default if v is None else v


def model_chunks(model: Any) -> List[Any]:
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
    if arg(args, "data_parallel_random_init", False) and ps.get_data_parallel_world_size() > 1:
        states = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(states, state, group=ps.get_data_parallel_group())
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", states, (pp_size, tp_size), (pp_rank, tp_rank),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def restore_rng(states: List[Dict[str, Any]], args: Any) -> None:
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if arg(args, "data_parallel_random_init", False) and len(states) > 1:
        state = states[ps.get_data_parallel_rank()]
    else:
        state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


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


def build_state_dict(args: Any, model: Any, optimizer: Any, scheduler: Any, iteration: int, flops: int,
                     is_loading: bool, with_optimizer: bool, with_rng: bool,
                     metadata: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The sharded state dict Megatron-LM's ``generate_state_dict`` builds for torch_dist.

    ``metadata``: Megatron-LM's ``sharded_sd_metadata`` (how model and optimizer shard their state, e.g.
    the distributed optimizer's sharding type), passed to their ``sharded_state_dict`` and, when saving,
    stored as the checkpoint's ``content_metadata`` (which a loader passes back: see ``load_checkpoint``).
    """
    chunks = model_chunks(model)
    sd: Dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                          "num_floating_point_operations_so_far": flops}
    kw = {} if metadata is None else {"metadata": metadata}
    if args is not None:
        sd["args"] = args
    if len(chunks) == 1:
        sd["model"] = chunks[0].sharded_state_dict(**kw)
        model_sd = sd["model"]
    else:
        for i, m in enumerate(chunks):
            sd[f"model{i}"] = m.sharded_state_dict(**kw)
        model_sd = {k: sd[k] for k in sd if k.startswith("model")}
    if optimizer is not None and with_optimizer:
        if _is_megatron_optimizer(optimizer):
            sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **kw)
        else:
            sd["optimizer"] = _plain_optimizer_sharded(optimizer, model_sd, is_loading)
    if metadata is not None and not is_loading:  # as Megatron-LM: after the calls above (which may add keys)
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

        sd[CONTENT_METADATA_KEY] = _clean_metadata_for_serialization(metadata)
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


def same_tp_pp(common: Dict[str, Any]) -> bool:
    """Whether the checkpoint (its common state) has this run's (TP, PP): Megatron-LM's condition for
    loading the RNG states, which are sharded by (PP, TP)."""
    saved = common.get(PARALLEL_KEY)
    if saved is None and common.get("args") is not None:
        a = common["args"]
        saved = {k: getattr(a, k, None) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")}
    return saved is None or saved == _parallel_layout()


def restore_counters(args: Any, saved: Any) -> None:
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


def apply_state(state: Dict[str, Any], model: Any, optimizer: Any, scheduler: Any, strict: bool,
           with_opt: bool) -> None:
    chunks = model_chunks(model)
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
