"""The files of a Trainer ``checkpoint-N/`` folder, built as snapckpt file specs (no disk I/O here).

Each builder returns ``{file name: spec}`` for :meth:`snapckpt.Checkpointer.save_files`; the node persister
writes them. The contents are those ``Trainer._save_checkpoint`` of transformers 5.24 writes:

==========================  ========================================  =====================================
file                        content                                   built with
==========================  ========================================  =====================================
``model.safetensors``       weights without tied aliases, metadata    ``remove_tied_weights_from_state_dict``,
(or ``model-0000i-of-       ``{"format": "pt"}``; shards and          ``revert_weight_conversion``,
0000n.safetensors`` +       ``model.safetensors.index.json`` past     ``huggingface_hub.split_torch_state_dict_
index)                      ``max_shard_size``                        into_shards``, :func:`safetensors_file`
``config.json``             ``config.to_json_string(use_diff=True)``  the config's own serializer
``generation_config.json``  the generation config (generative models) ``GenerationConfig.to_json_string``
``optimizer.pt``            ``optimizer.state_dict()``                :class:`TorchSave` (tensors snapshotted)
``scheduler.pt``            ``lr_scheduler.state_dict()``             ``torch.save`` bytes (:class:`RawBytes`)
``rng_state.pth`` /         python, numpy, torch CPU (and CUDA)       ``torch.save`` bytes (:class:`RawBytes`)
``rng_state_{rank}.pth``    generator states
``trainer_state.json``      ``TrainerState`` as ``save_to_json``      ``dataclasses.asdict`` + ``json.dumps``
``training_args.bin``       ``torch.save(args)``                      ``torch.save`` bytes (:class:`RawBytes`)
tokenizer files             ``processing_class.save_pretrained``      read back once per ``train()``
==========================  ========================================  =====================================

A ``peft.PeftModel`` gets ``adapter_model.safetensors``, ``adapter_config.json`` and ``README.md`` instead of
the model files, as ``PeftModel.save_pretrained`` (:mod:`snapckpt.integrations.transformers.peft`).

Small pickled files are serialized to bytes in the training process (``RawBytes``) so that neither the
persister nor a memory-tier reload ever unpickles user classes (case E5: a ``TrainingArguments``
subclass defined in the training script) or numpy RNG states (which ``weights_only=True`` refuses).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import tempfile
from typing import Any, Dict, Optional

import numpy as np
import torch

from snapckpt.formats import RawBytes, TorchSave, safetensors_file
from snapckpt.integrations.transformers import peft as transformers_peft

__all__ = ["model_files", "optimizer_file", "processing_class_files", "rng_file_name",
           "rng_state_bytes", "scheduler_file", "torch_bytes", "trainer_state_bytes"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"


def torch_bytes(obj: Any) -> bytes:
    """``obj`` serialized exactly as ``torch.save`` writes it (a zip archive), as ``bytes``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def model_files(model: torch.nn.Module, max_shard_size: "int | str" = "50GB",
                state_dict: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, Any]:
    """The model files ``Trainer._save`` writes through ``save_pretrained``: weights and configs.

    Args:
        model: the unwrapped model: a ``PreTrainedModel``; a ``peft.PeftModel`` (then the adapter only, as
            ``PeftModel.save_pretrained``: see :mod:`snapckpt.integrations.transformers.peft`); or any other
            ``nn.Module`` (then only ``model.safetensors`` of its ``state_dict()``, as the Trainer does).
        max_shard_size: shard threshold (bytes, or a string such as ``"5GB"``), as ``save_pretrained``.
        state_dict: the weights to write instead of ``model.state_dict()`` (``save_pretrained(state_dict=)``:
            the weights DeepSpeed ZeRO-3 gathers); ``{}``: the configs only (what the Trainer keeps of a
            ZeRO-3 save without gathered weights).

    Returns:
        ``{file name: spec}``; tensors are the live ones (the snapshot copies them).

    Raises:
        NotImplementedError: the model is quantized or tensor-parallel, or its adapters cannot be written
            (see :func:`~snapckpt.integrations.transformers.peft.adapter_files`).
    """
    # lazy: the Accelerate integration imports this module where transformers is not installed
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import PreTrainedModel

    metadata = {"format": "pt"}
    if transformers_peft.is_adapter_model(model):
        return transformers_peft.adapter_files(model)
    if not isinstance(model, PreTrainedModel):
        if state_dict is not None and not state_dict:
            return {}
        sd = {k: v.contiguous() for k, v in (model.state_dict() if state_dict is None else state_dict).items()}
        return {SAFE_WEIGHTS_NAME: safetensors_file(sd, metadata)}
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "_tp_size", None):
        raise NotImplementedError(
            "SnapckptCallback does not write quantized or tensor-parallel models (save_pretrained converts or "
            "gathers their weights first); remove the callback for this run to let the Trainer save")
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    files: Dict[str, Any] = {}
    # save_pretrained records these two in the config before writing it.
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [model.__class__.__name__.removeprefix("FSDP")]
    files["config.json"] = RawBytes(model.config.to_json_string(use_diff=True).encode("utf-8"))
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        text = model.generation_config.to_json_string(use_diff=True, keys_to_pop=["compile_config"])
        files["generation_config.json"] = RawBytes(text.encode("utf-8"))

    if state_dict is not None and not state_dict:
        return files
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    ignore = getattr(model, "_keys_to_ignore_on_save", None) or []
    for k in ignore:
        sd.pop(k, None)
    sd = remove_tied_weights_from_state_dict(sd, model)
    sd = revert_weight_conversion(model, sd)
    split = split_torch_state_dict_into_shards(sd, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for shard, names in split.filename_to_tensors.items():
        files[shard] = safetensors_file({n: sd[n].contiguous() for n in names}, metadata)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        files[SAFE_WEIGHTS_INDEX_NAME] = RawBytes((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return files


def rng_state_bytes(distributed: bool) -> bytes:
    """This process's RNG states as ``Trainer._save_rng_state`` records them (python, numpy, torch CPU,
    and CUDA when available: every device's state when ``distributed``), serialized."""
    states: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return torch_bytes(states)


def rng_file_name(world_size: int, process_index: int) -> str:
    """``rng_state.pth`` for one process, ``rng_state_{process_index}.pth`` otherwise (the Trainer's rule)."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{process_index}.pth"


def trainer_state_bytes(state: Any, drop_last_log: bool = False) -> bytes:
    """``trainer_state.json`` exactly as ``TrainerState.save_to_json`` writes it.

    Args:
        state: the ``TrainerState``.
        drop_last_log: leave out the newest ``log_history`` entry (the end-of-training summary, which a
            checkpoint written at the last step does not hold).
    """
    d = dataclasses.asdict(state)
    if drop_last_log and d["log_history"]:
        d["log_history"] = d["log_history"][:-1]
    return (json.dumps(d, indent=2, sort_keys=True) + "\n").encode("utf-8")


def processing_class_files(processing_class: Any) -> Dict[str, RawBytes]:
    """The files ``processing_class.save_pretrained`` writes (tokenizer, processor), read back as bytes, each
    with the permission bits it was written with.

    Saved once into a temporary directory; ``{}`` for ``None``. Nested directories are not supported
    (none of the tokenizers' own files use them).

    Raises:
        ValueError: ``save_pretrained`` wrote a sub-directory.
    """
    if processing_class is None:
        return {}
    out: Dict[str, RawBytes] = {}
    with tempfile.TemporaryDirectory(prefix="snapckpt-tok-") as d:
        processing_class.save_pretrained(d)
        for name in sorted(os.listdir(d)):
            p = os.path.join(d, name)
            if os.path.isdir(p):
                raise ValueError(f"{type(processing_class).__name__}.save_pretrained wrote a directory {name!r}; "
                                 "SnapckptCallback supports flat processing-class folders only")
            out[name] = RawBytes.from_file(p)  # with the mode save_pretrained gave it
    return out


def optimizer_file(optimizer: Optional[Any]) -> Dict[str, Any]:
    """``optimizer.pt`` of ``optimizer.state_dict()`` (tensors go through the snapshot); ``{}`` for None."""
    return {} if optimizer is None else {OPTIMIZER_NAME: TorchSave(optimizer.state_dict())}


def scheduler_file(lr_scheduler: Optional[Any]) -> Dict[str, Any]:
    """``scheduler.pt`` of ``lr_scheduler.state_dict()``; ``{}`` for None."""
    return {} if lr_scheduler is None else {SCHEDULER_NAME: RawBytes(torch_bytes(lr_scheduler.state_dict()))}
