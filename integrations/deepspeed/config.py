"""The config entry: the ``"snapckpt"`` section of a DeepSpeed config, and :func:`initialize`.

Where it sits: before the data path starts. :func:`initialize` takes ``deepspeed.initialize``'s arguments,
removes the section (:func:`_split_config`, validated into :class:`DeepSpeedSnapckptConfig`) before DeepSpeed
sees the config, builds the engine, and attaches a :class:`~.checkpointer.DeepSpeedCheckpointer` to it
(``engine.snapckpt``) with the section's intervals as its snapshot policy.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple

from snapckpt.options import CheckpointOptions
from snapckpt.storage.urls import check_remote_url

from snapckpt.integrations.deepspeed.checkpointer import DeepSpeedCheckpointer

__all__ = ["DeepSpeedSnapckptConfig", "initialize"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedSnapckptConfig:
    """The ``"snapckpt"`` section of a DeepSpeed config.

    Attributes:
        enabled: attach snapckpt (``false`` leaves the engine untouched).
        checkpoint_dir: where DISK saves go (DeepSpeed's ``save_dir``); required when enabled.
        memory_interval_steps: MEMORY snapshot every N optimizer steps (``None``: none).
        disk_interval_steps: DISK save every N optimizer steps (``None``: only explicit saves).
        keep_last: retention: keep the N most recently saved tags (``None``: all).
        remote_dir: the remote tier, an object store URL (``"s3://bucket/run1"``): every committed tag is also
            uploaded there, and a fresh node resumes from it (docs/remote.md). ``None``: none (or
            ``$SNAPCKPT_REMOTE_DIR``).
        options: further :class:`snapckpt.CheckpointOptions` fields (``shm_dir``, timeouts...).
    """

    enabled: bool = True
    checkpoint_dir: Optional[str] = None
    memory_interval_steps: Optional[int] = None
    disk_interval_steps: Optional[int] = None
    keep_last: Optional[int] = None
    remote_dir: Optional[str] = None
    options: Optional[Dict[str, Any]] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeepSpeedSnapckptConfig":
        """Validate and build; ``ValueError`` names an unknown key or a bad value and what is allowed."""
        if not isinstance(d, Mapping):
            raise ValueError(f'the DeepSpeed config\'s "snapckpt" section must be an object, got {type(d).__name__}')
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f'unknown key(s) {unknown} in the "snapckpt" section; valid keys: {names}')
        cfg = cls(**d)
        if not isinstance(cfg.enabled, bool):
            raise ValueError(f'"snapckpt.enabled" must be true or false, got {cfg.enabled!r}')
        for key in ("memory_interval_steps", "disk_interval_steps", "keep_last"):
            v = getattr(cfg, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f'"snapckpt.{key}" must be a positive integer or null, got {v!r}')
        if cfg.enabled and (not isinstance(cfg.checkpoint_dir, str) or not cfg.checkpoint_dir):
            raise ValueError('"snapckpt.checkpoint_dir" is required (a directory path) when snapckpt is enabled')
        if cfg.remote_dir is not None:  # the same check, and error type (RemoteURLError), as the option's
            check_remote_url(cfg.remote_dir, '"snapckpt.remote_dir"')
        if cfg.options is not None:
            if not isinstance(cfg.options, Mapping):
                raise ValueError('"snapckpt.options" must be an object of snapckpt CheckpointOptions fields')
            for key in ("checkpoint_dir", "keep_last", "remote_dir"):
                if key in cfg.options:
                    raise ValueError(f'"snapckpt.options.{key}" is not an option: set "snapckpt.{key}" instead')
            try:
                CheckpointOptions.from_kwargs(**cfg.options)
            except (TypeError, ValueError) as e:
                raise ValueError(f'"snapckpt.options": {e}') from e
        return cfg


def _split_config(config) -> Tuple[Any, Optional[DeepSpeedSnapckptConfig]]:
    """``(DeepSpeed's config without the section, the section or None)`` of a config dict or JSON file path;
    any other config object is returned as it is, with no section.

    Raises:
        ValueError: an invalid ``"snapckpt"`` section.
    """
    if config is None:
        return None, None
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        return config, None
    rest = dict(config)
    section = rest.pop("snapckpt", None)
    return rest, (DeepSpeedSnapckptConfig.from_dict(section) if section is not None else None)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """``deepspeed.initialize`` that also reads the config's ``"snapckpt"`` section.

    Same arguments and return value as ``deepspeed.initialize`` (``(engine, optimizer, training_dataloader,
    lr_scheduler)``). The section (see :class:`DeepSpeedSnapckptConfig`) is removed before DeepSpeed sees the
    config; when enabled, a :class:`DeepSpeedCheckpointer` is attached to the engine (``engine.snapckpt``):
    snapshots by policy at step boundaries, ``engine.save_checkpoint`` through snapckpt's checkpoint
    engine, ``engine.load_checkpoint`` with the memory tier. Call ``engine.snapckpt.close()`` (or
    ``engine.destroy()``) at the end to wait for the last commit.

    Raises:
        ValueError: an invalid ``"snapckpt"`` section (unknown key, bad value).
    """
    import deepspeed

    if config is None and args is not None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
        args.deepspeed_config = None
    if config is None and config_params is not None:
        config, config_params = config_params, None
    ds_config, section = _split_config(config)
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                  mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, mesh_param=mesh_param,
                  config_params=config_params)
    out = deepspeed.initialize(config=ds_config, **{k: v for k, v in kwargs.items() if v is not None})
    engine = out[0]
    if section is not None and section.enabled:
        options = dict(section.options or {})
        if section.keep_last is not None:
            options["keep_last"] = section.keep_last
        if section.remote_dir is not None:
            options["remote_dir"] = section.remote_dir
        ck = DeepSpeedCheckpointer(engine, section.checkpoint_dir, **options)
        ck.attach(section.memory_interval_steps, section.disk_interval_steps)
        engine.snapckpt = ck
        log.info("snapckpt attached to the DeepSpeed engine: %s (memory every %s steps, disk every %s)",
                 ck.checkpoint_dir, section.memory_interval_steps, section.disk_interval_steps)
    elif section is not None:
        log.info('snapckpt is disabled by the config ("snapckpt": {"enabled": false})')
    return out
