"""Adapter-only files of a Trainer ``checkpoint-N/`` folder for PEFT models, as snapckpt file specs.

``Trainer._save`` (transformers 5.24) saves a ``peft.PeftModel`` (``get_peft_model``,
``PeftModel.from_pretrained``) through ``PeftModel.save_pretrained``, which (peft 0.21) writes the adapter
only; for the adapter ``"default"``:

=============================  ===========================================  ================================
file                           content                                      built with
=============================  ===========================================  ================================
``adapter_model.safetensors``  the adapter's tensors, keys                  ``peft.get_peft_model_state_
                               ``base_model.model.<module>.lora_A.weight``  dict``, :func:`safetensors_file`
                               ..., metadata ``{"format": "pt"}``
``adapter_config.json``        the ``PeftConfig`` with                      ``PeftConfig.to_dict``, JSON as
                               ``inference_mode=true`` (and                 ``PeftConfig.save_pretrained``
                               ``auto_mapping`` when it has no task type)   writes it
``README.md``                  the model card                               ``PeftModel.create_or_update_
                                                                            model_card``, once per train
=============================  ===========================================  ================================

and no ``config.json``: neither the base model's weights nor its config are saved.

Not written: a ``PreTrainedModel`` with adapters loaded through transformers (``model.add_adapter``,
``model.load_adapter``: ``model._hf_peft_config_loaded``). ``Trainer._save`` saves those adapter-only too,
through ``PreTrainedModel.save_pretrained``, but transformers 5.24 requires peft >= 0.22 for it, newer than
any peft release available to this project (0.21.2 is pinned), so neither the Trainer's save nor a test of
snapckpt's can run; the callback refuses such a model when training starts.

Only the adapter's tensors go through the snapshot. ``peft`` is needed only when such a model is
trained (it is in snapckpt's ``hf`` extra); this module imports it lazily.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Dict

import torch

from snapckpt.formats import RawBytes, safetensors_file

__all__ = ["ADAPTER_SAFE_WEIGHTS_NAME", "ADAPTER_CONFIG_NAME", "adapter_files", "card_files", "check_supported",
           "is_adapter_model", "is_peft_model"]

ADAPTER_SAFE_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
MODEL_CARD_NAME = "README.md"
DEFAULT_ADAPTER = "default"


def is_peft_model(model: Any) -> bool:
    """``model`` is a ``peft.PeftModel`` (False when peft was never imported: no such model can exist)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_model(model: Any) -> bool:
    """``Trainer._save`` writes ``model``'s adapter only: a ``PeftModel``, or a transformers model with
    adapters loaded (``_hf_peft_config_loaded``)."""
    return is_peft_model(model) or bool(getattr(model, "_hf_peft_config_loaded", False))


def adapter_files(model: torch.nn.Module) -> Dict[str, Any]:
    """The adapter files ``Trainer._save`` writes for a ``peft.PeftModel`` (see the module docstring),
    without the model card (:func:`card_files`, which does not change during training).

    Returns:
        ``{file name: spec}``; tensors are the live adapter tensors (the snapshot copies them).

    Raises:
        NotImplementedError: see :func:`check_supported`.
    """
    check_supported(model)
    from peft import get_peft_model_state_dict

    config = model.peft_config[DEFAULT_ADAPTER]
    sd = get_peft_model_state_dict(model, adapter_name=DEFAULT_ADAPTER, save_embedding_layers="auto")
    # As PeftModel.save_pretrained: fill in the base model's name, save with inference_mode=True, and name
    # the base model class when the config has no task type.
    base = model.base_model if config.is_prompt_learning else model.base_model.model
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    auto_mapping = None
    if config.task_type is None:
        auto_mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    inference_mode, config.inference_mode = config.inference_mode, True
    try:
        config_json = _config_bytes(config, auto_mapping_dict=auto_mapping)
    finally:
        config.inference_mode = inference_mode
    return {ADAPTER_SAFE_WEIGHTS_NAME: safetensors_file(_unaliased(sd), {"format": "pt"}),
            ADAPTER_CONFIG_NAME: RawBytes(config_json)}


def card_files(model: Any) -> Dict[str, RawBytes]:
    """``README.md`` as ``PeftModel.save_pretrained`` writes it into a new folder (its
    ``create_or_update_model_card``, run once in a temporary directory and read back, with its mode); ``{}``
    for any other model."""
    if not is_peft_model(model):
        return {}
    with tempfile.TemporaryDirectory(prefix="snapckpt-card-") as d:
        model.create_or_update_model_card(d)
        return {MODEL_CARD_NAME: RawBytes.from_file(os.path.join(d, MODEL_CARD_NAME))}


def check_supported(model: Any) -> None:
    """Raise now what :func:`adapter_files` would raise at the first save (``SnapckptCallback`` calls it
    when training starts); nothing for a model without adapters.

    Raises:
        NotImplementedError: a ``PeftModel`` holds an adapter not named ``"default"`` (``save_pretrained``
            writes those into sub-folders of ``checkpoint-N``, and snapckpt's checkpoint files are flat), or
            a transformers model carries adapters loaded through transformers (see the module docstring).
    """
    if is_peft_model(model):
        names = list(model.peft_config)
        if names != [DEFAULT_ADAPTER]:
            raise NotImplementedError(
                f"SnapckptCallback writes a PeftModel's adapter named 'default' only, this model has {names}: "
                "PeftModel.save_pretrained writes every other adapter into a sub-folder of checkpoint-N, and "
                "snapckpt's checkpoint files are flat; train with one adapter named 'default', or remove the "
                "callback for this run to let the Trainer save")
    elif getattr(model, "_hf_peft_config_loaded", False):
        raise NotImplementedError(
            "SnapckptCallback does not write adapters added through transformers (model.add_adapter / "
            "load_adapter; transformers 5.24 needs peft >= 0.22 for them, snapckpt pins peft 0.21.2): wrap the "
            "model with peft.get_peft_model(model, config) instead, or remove the callback for this run to let "
            "the Trainer save")


def _config_bytes(config: Any, auto_mapping_dict: Any = None) -> bytes:
    """``adapter_config.json`` exactly as ``config.save_pretrained(directory, auto_mapping_dict=...)``
    writes it (peft 0.21 ``PeftConfigMixin.save_pretrained``: ``to_dict()``, sets as lists, the auto
    mapping added, ``json.dumps(indent=2, sort_keys=True)``, no final newline), without touching the disk
    on the training thread."""
    d = config.to_dict()
    for key, value in d.items():
        if isinstance(value, set):
            d[key] = list(value)
    if auto_mapping_dict is not None:
        d["auto_mapping"] = auto_mapping_dict
    return json.dumps(d, indent=2, sort_keys=True).encode("utf-8")


def _unaliased(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Contiguous tensors, a name that shares memory with an earlier one cloned (safetensors stores each
    tensor once; ``PeftModel.save_pretrained`` clones such names the same way)."""
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in sd.items():
        t = t.contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out
