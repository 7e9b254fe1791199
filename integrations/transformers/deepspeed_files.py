"""The Trainer's ``checkpoint-N/`` under DeepSpeed (``TrainingArguments(deepspeed=...)``), as file specs.

What ``Trainer._save_checkpoint`` of transformers 5.24 writes with DeepSpeed enabled, besides the files every
save has (``trainer_state.json``, ``rng_state_{rank}.pth``, ``training_args.bin``, tokenizer files, which
the callback builds as without DeepSpeed):

- the model files of ``save_model``: ZeRO 0-2 ``save_pretrained`` of the full state dict with tied weights
  untied (each written under its own name: the Trainer clones every tensor first); ZeRO-3 the 16-bit weights
  gathered by ``engine._zero3_consolidated_16bit_state_dict()`` when the DeepSpeed config sets
  ``stage3_gather_16bit_weights_on_model_save``, else the configs only (the Trainer removes the dummy
  weights file and points at ``zero_to_fp32.py``);
- DeepSpeed's own checkpoint of ``engine.save_checkpoint(checkpoint-N)`` in place of ``optimizer.pt``:
  ``global_stepN/`` (model and ZeRO optimizer states of every rank), ``latest``, ``zero_to_fp32.py`` and
  ``zero_to_torch.py``, captured by :func:`snapckpt.integrations.deepspeed.capture.capture_save`;
- ``scheduler.pt`` only for a Trainer-made scheduler (a scheduler from the DeepSpeed config is in
  DeepSpeed's files).

The stock resume (``trainer.train(resume_from_checkpoint=...)``) then loads the folder natively:
``engine.load_checkpoint(checkpoint-N)`` reads ``latest``.

The ``"snapckpt"`` section of the DeepSpeed config (:func:`section_options`) sets the callback's options.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from snapckpt.formats import RawBytes

from snapckpt.integrations.transformers import files as F
from snapckpt.integrations.transformers import peft as P

__all__ = ["engine_of", "checkpoint_files", "section_options"]

# keys of the DeepSpeed config's "snapckpt" section that the Trainer's own arguments decide instead
TRAINER_DECIDES = {"disk_interval_steps": "TrainingArguments(save_steps=..., save_strategy=...)",
                    "keep_last": "TrainingArguments(save_total_limit=...)"}


def engine_of(trainer: Any) -> Optional[Any]:
    """The ``DeepSpeedEngine`` the Trainer trains with (``trainer.model_wrapped``), ``None`` without
    DeepSpeed or before ``train()`` has built it."""
    if trainer is None or not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = getattr(trainer, "model_wrapped", None)
    return engine if isinstance(engine, DeepSpeedEngine) else None


def checkpoint_files(engine: Any, model: Any, lr_scheduler: Any, *, is_zero: bool, max_shard_size: "int | str",
                     save_only_model: bool) -> Dict[str, Any]:
    """Collective: this rank's share of the DeepSpeed-specific files of a Trainer checkpoint (see the module
    docstring), as ``{name relative to checkpoint-N: spec}``.

    Args:
        engine: the Trainer's ``DeepSpeedEngine``.
        model: the unwrapped model (``Trainer.model``).
        lr_scheduler: ``Trainer.lr_scheduler``.
        is_zero: this is world rank 0 (it writes the model files and ``scheduler.pt``, as the Trainer).
        max_shard_size: shard threshold of the weights, as ``save_pretrained``.
        save_only_model: ``TrainingArguments.save_only_model`` (then no DeepSpeed states, except under
            ZeRO-3 without gathered weights, where the Trainer saves them as the model).

    Raises:
        NotImplementedError: a PEFT model (the Trainer saves it with frozen parameters excluded, which this
            integration does not reproduce yet), or what
            :func:`~snapckpt.integrations.transformers.files.model_files` and
            :func:`~snapckpt.integrations.deepspeed.capture.capture_save` raise.
    """
    from snapckpt.integrations.deepspeed.capture import capture_save

    if P.is_adapter_model(model):
        raise NotImplementedError("SnapckptCallback does not take over the Trainer's DeepSpeed saves of a PEFT model "
                                  "(DeepSpeed saves it without its frozen parameters); remove the callback for this "
                                  "run to let the Trainer save")
    files: Dict[str, Any] = {}
    zero3 = engine.zero_optimization_stage() == 3
    model_is_ds = False  # ZeRO-3 without gathered weights: the Trainer saves DeepSpeed's checkpoint as the model
    if zero3 and engine.zero_gather_16bit_weights_on_model_save():
        sd = engine._zero3_consolidated_16bit_state_dict()  # collective; the full dict on rank 0 only
        if is_zero:
            files.update(F.model_files(model, max_shard_size, state_dict=sd))
    elif zero3:
        if is_zero:
            files.update(F.model_files(model, max_shard_size, state_dict={}))
        model_is_ds = True
    elif is_zero:
        files.update(F.model_files(model, max_shard_size, state_dict=_unaliased(model.state_dict())))
    if model_is_ds or not save_only_model:
        files.update(capture_save(engine))
    if is_zero and not save_only_model and lr_scheduler is not None and not _deepspeed_scheduler(lr_scheduler):
        files[F.SCHEDULER_NAME] = RawBytes(F.torch_bytes(lr_scheduler.state_dict()))
    return files


def _unaliased(sd: Dict[str, Any]) -> Dict[str, Any]:
    """``sd`` with every tensor that shares storage with an earlier one cloned: the Trainer's DeepSpeed save
    takes ``accelerator.get_state_dict``, whose ``clone_tensors_for_torch_save`` unties tied weights, so
    ``save_pretrained`` writes each of them (``lm_head.weight`` besides ``wte.weight``). Only the aliases
    are copied here; the other tensors go to the snapshot as they are."""
    import torch
    from transformers.pytorch_utils import id_tensor_storage

    seen: set = set()
    out: Dict[str, Any] = {}
    for name, t in sd.items():
        if isinstance(t, torch.Tensor):
            key = id_tensor_storage(t)
            if key in seen:
                t = t.detach().clone()
            seen.add(key)
        out[name] = t
    return out


def _deepspeed_scheduler(lr_scheduler: Any) -> bool:
    from accelerate.utils import DeepSpeedSchedulerWrapper

    return isinstance(lr_scheduler, DeepSpeedSchedulerWrapper)


def section_options(args: Any, given: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The callback's settings from the ``"snapckpt"`` section of the DeepSpeed config the Trainer was given
    (``TrainingArguments(deepspeed=<dict or JSON path>)``): ``None`` when the section says
    ``"enabled": false`` (the Trainer then saves itself), else ``{"memory_interval_steps": ..., "options":
    {...}}`` with what the section sets (``{}`` without a section).

    Args:
        args: the ``TrainingArguments``.
        given: what the callback was constructed with (``memory_interval_steps`` and its options), to refuse
            a setting given both ways with different values.

    Raises:
        ValueError: an invalid section (see :class:`~snapckpt.integrations.deepspeed.DeepSpeedSnapckptConfig`), a
            key the Trainer's own arguments decide (``disk_interval_steps``, ``keep_last``), a
            ``checkpoint_dir`` other than ``output_dir``, or a setting that differs from the callback's.
    """
    hf = getattr(args, "hf_deepspeed_config", None)
    section = getattr(hf, "config", {}).get("snapckpt") if hf is not None else None
    if section is None:
        return {}
    from snapckpt.integrations.deepspeed.config import DeepSpeedSnapckptConfig

    if not isinstance(section, Mapping):  # dict() of a string or a list fails with an unrelated message
        DeepSpeedSnapckptConfig.from_dict(section)  # raises the section's own error
    section = dict(section)
    for key, instead in TRAINER_DECIDES.items():
        if section.get(key) is not None:
            raise ValueError(f'"snapckpt.{key}" in the DeepSpeed config is decided by the Trainer under '
                             f'SnapckptCallback: remove it and set {instead}')
    ckdir = section.pop("checkpoint_dir", None)
    if ckdir is not None and not isinstance(ckdir, str):
        raise ValueError(f'"snapckpt.checkpoint_dir" must be a directory path (the Trainer\'s output_dir) or be '
                         f'left out, got {ckdir!r}')
    if ckdir is not None and os.path.realpath(ckdir) != os.path.realpath(args.output_dir):
        raise ValueError(f'"snapckpt.checkpoint_dir" ({ckdir!r}) must be the Trainer\'s output_dir '
                         f'({args.output_dir!r}) or be left out: the Trainer\'s checkpoints go to output_dir')
    cfg = DeepSpeedSnapckptConfig.from_dict({**section, "checkpoint_dir": args.output_dir})
    if not cfg.enabled:
        return None
    options = dict(cfg.options or {})
    if cfg.remote_dir is not None:
        options["remote_dir"] = cfg.remote_dir
    out: Dict[str, Any] = {"options": options}
    if cfg.memory_interval_steps is not None:
        out["memory_interval_steps"] = cfg.memory_interval_steps
    for key, value in [("memory_interval_steps", out.get("memory_interval_steps")), *options.items()]:
        if value is not None and given.get(key) is not None and given[key] != value:
            raise ValueError(f'"snapckpt" in the DeepSpeed config sets {key}={value!r} but SnapckptCallback was '
                             f"given {key}={given[key]!r}: set it in one place")
    return out
