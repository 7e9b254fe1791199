"""Accelerate integration: ``Accelerator.save_state`` folders written by the snapckpt persister.

``AcceleratorCheckpointer(accelerator, checkpoint_dir).save_state(step)`` snapshots what
``accelerator.save_state(dir)`` (accelerate 1.15, ``safe_serialization=True``) would write, and the node
persister writes and commits ``<checkpoint_dir>/checkpoint_<step>/`` in the background:

==================================  ====================================================================
file                                content
==================================  ====================================================================
``model.safetensors``,              ``accelerator.get_state_dict(model, unwrap=False)`` without shared
``model_{i}.safetensors``           aliases (accelerate's ``clean_state_dict_for_safetensors``)
``optimizer.bin``, ``_{i}``         ``optimizer.state_dict()``
``scheduler.bin``, ``_{i}``         ``scheduler.state_dict()``
``sampler.bin``, ``_{i}``           a ``SeedableRandomSampler`` of an ``IterableDatasetShard`` loader
``dl_state_dict.bin``, ``_{i}``     ``dataloader.state_dict()`` with ``use_stateful_dataloader``
``scaler.pt``                       the ``GradScaler`` state (fp16)
``random_states_{process}.pkl``     ``step`` and python, numpy, torch (and CUDA) RNG states, per process
``custom_checkpoint_{i}.pkl``       ``state_dict()`` of each ``register_for_checkpointing`` object
==================================  ====================================================================

so the stock ``accelerator.load_state(path)`` restores it (case F1). :meth:`AcceleratorCheckpointer.load_state`
picks the newest snapshot with every rank (memory or disk); a memory-only one is first written out as
its folder, then loaded with ``accelerator.load_state``.

The objects come from the lists ``save_state`` itself walks (``accelerator._models``, ``_optimizers``,
``_schedulers``, ``_dataloaders``, ``_custom_objects``): accelerate has no public accessor for them.
Hooks registered with ``register_save_state_pre_hook`` (which write their own files into the folder, as
diffusers' do) cannot write into a folder that another process commits later: an accelerator with such
hooks is refused with :class:`NotImplementedError`, as are FSDP, DeepSpeed, Megatron-LM and XLA runs
(their ``save_state`` is a collective framework call).
"""
from __future__ import annotations

import logging
import os
import random
from typing import Any, Dict, Optional

import numpy as np
import torch

from snapckpt import Checkpointer, SaveHandle, StorageType, check_step
from snapckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from snapckpt.formats import RawBytes, TorchSave, safetensors_file

from snapckpt.integrations.transformers.files import torch_bytes  # no transformers import (see that module)

__all__ = ["AcceleratorCheckpointer"]

log = logging.getLogger(__name__)


class AcceleratorCheckpointer:
    """Asynchronous ``save_state`` / ``load_state`` for an ``accelerate.Accelerator``.

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved (call after ``prepare``).
        checkpoint_dir: directory of the ``checkpoint_<step>`` folders; None: ``<project_dir>/checkpoints``
            of the accelerator's ``ProjectConfiguration(automatic_checkpoint_naming=True)``, whose
            ``total_limit`` is then the default ``keep_last`` (accelerate's own rotation).
        **options: :class:`~snapckpt.options.CheckpointOptions` fields (``keep_last``, ``shm_dir``...).

    Collective like the :class:`~snapckpt.Checkpointer` it holds (``self.checkpointer``).

    Raises:
        NotImplementedError: FSDP, DeepSpeed, Megatron-LM or XLA distributed types; (at ``save_state``)
            ``save_state`` pre-hooks registered.
        ValueError: no ``checkpoint_dir`` and no automatic checkpoint naming.
    """

    def __init__(self, accelerator: Any, checkpoint_dir: "str | os.PathLike[str] | None" = None,
                 **options: Any) -> None:
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if kind.upper() in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
            raise NotImplementedError(f"AcceleratorCheckpointer does not support distributed_type {kind}: its "
                                      "save_state is a collective framework call; use accelerator.save_state")
        config = accelerator.project_configuration
        self.automatic_naming = bool(config.automatic_checkpoint_naming)
        if checkpoint_dir is None:
            if not self.automatic_naming:
                raise ValueError("AcceleratorCheckpointer needs a checkpoint_dir, or an Accelerator with "
                                 "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) (then "
                                 "the folders go to <project_dir>/checkpoints, as accelerator.save_state() puts them)")
            checkpoint_dir = os.path.join(accelerator.project_dir, "checkpoints")
        if self.automatic_naming and config.total_limit is not None:
            options.setdefault("keep_last", config.total_limit)
        self.accelerator = accelerator
        self.checkpointer = Checkpointer(checkpoint_dir, **options)
        # the main process's files hold the models and optimizers: once an optimizer made its state (its first
        # step), the arena is reserved for their size (_expect_once)
        self._expect_hooks = [getattr(opt, "optimizer", opt).register_step_post_hook(self._expect_once)
                              for opt in accelerator._optimizers] if accelerator.is_main_process else []

    @staticmethod
    def dirname(step: int) -> str:
        """The folder name of ``step``: ``checkpoint_<step>`` (accelerate's automatic naming)."""
        return f"checkpoint_{step}"

    def save_state(self, step: Optional[int] = None, storage_type: StorageType = StorageType.DISK) -> SaveHandle:
        """Snapshot the accelerator's state as ``checkpoint_<step>``; returns once the state may change.

        Collective. ``step`` None: ``accelerator.save_iteration``, the iteration of accelerate's automatic
        naming (``ProjectConfiguration(automatic_checkpoint_naming=True)``), advanced by one afterwards as
        ``accelerator.save_state()`` advances it; with automatic naming and a ``step`` given, the iteration
        becomes ``step + 1``. ``storage_type=MEMORY`` keeps it in the node's memory only. Call before the
        next ``optimizer.step()`` mutates the state (``self.checkpointer.fence()`` there, once copies overlap).

        Raises:
            ValueError: ``step`` None without automatic naming, or a bad ``step``.
        """
        if step is None:
            if not self.automatic_naming:
                raise ValueError("save_state() without a step needs ProjectConfiguration(automatic_checkpoint_"
                                 "naming=True) on the Accelerator; pass the step (an int >= 0)")
            step = self.accelerator.save_iteration
        check_step(step)
        files = self._files(step)
        handle = self.checkpointer.save_files(files, step, storage_type, dirname=self.dirname(step),
                                              tracker_name=None)
        if self.automatic_naming:
            self.accelerator.project_configuration.iteration = step + 1
        return handle

    def _files(self, step: int) -> Dict[str, Any]:
        from accelerate.utils.other import clean_state_dict_for_safetensors

        acc = self.accelerator
        main = acc.is_main_process
        files: Dict[str, Any] = {}
        if acc._save_model_state_pre_hook:
            raise NotImplementedError("this Accelerator has save_state pre-hooks (register_save_state_pre_hook); "
                                      "they write files into the checkpoint folder themselves, which snapckpt "
                                      "commits from another process: use accelerator.save_state for this run")
        weights = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
        if main:
            for i, sd in enumerate(weights):
                sd = clean_state_dict_for_safetensors(sd)
                name = "model.safetensors" if i == 0 else f"model_{i}.safetensors"
                files[name] = safetensors_file({k: v.contiguous() for k, v in sd.items()}, {"format": "pt"})
            for i, opt in enumerate(acc._optimizers):
                files[_indexed("optimizer", i, ".bin")] = TorchSave(opt.state_dict())
            for i, sched in enumerate(acc._schedulers):
                files[_indexed("scheduler", i, ".bin")] = RawBytes(torch_bytes(sched.state_dict()))
            files.update(self._dataloader_files())
            if acc.scaler is not None:
                files["scaler.pt"] = RawBytes(torch_bytes(acc.scaler.state_dict()))
            for i, obj in enumerate(acc._custom_objects):
                files[f"custom_checkpoint_{i}.pkl"] = RawBytes(torch_bytes(obj.state_dict()))
        files[f"random_states_{acc.process_index}.pkl"] = RawBytes(torch_bytes(self._rng_states()))
        return files

    def _dataloader_files(self) -> Dict[str, Any]:
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

        out: Dict[str, Any] = {}
        for i, dl in enumerate(self.accelerator._dataloaders):
            if isinstance(dl.dataset, IterableDatasetShard):
                sampler = dl.get_sampler()
                if isinstance(sampler, SeedableRandomSampler):
                    out[_indexed("sampler", i, ".bin")] = RawBytes(torch_bytes(sampler))
            if getattr(dl, "use_stateful_dataloader", False):
                out[_indexed("dl_state_dict", i, ".bin")] = RawBytes(torch_bytes(dl.state_dict()))
        return out

    def _rng_states(self) -> Dict[str, Any]:
        states: Dict[str, Any] = {"step": self.accelerator.step, "random_state": random.getstate(),
                                  "numpy_random_seed": np.random.get_state(),
                                  "torch_manual_seed": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        return states

    def load_state(self, **load_kwargs: Any) -> Optional[str]:
        """Restore the newest snapshot complete on every rank with ``accelerator.load_state``; collective.

        A memory-only snapshot newer than every committed folder is first written out as its folder.
        Returns the folder loaded, or ``None`` when there is no checkpoint. ``load_kwargs`` go to
        ``accelerator.load_state``. With automatic naming, ``accelerator.save_iteration`` becomes the
        loaded step + 1, so that the next ``save_state()`` names a new folder (accelerate's own
        ``load_state`` leaves it at 0 and the next save then finds its folder taken). A folder that the job
        saving there committed again (or deleted) while accelerate read it is not kept: the load is done again,
        the folder now there verified first. A folder saved by another number of processes is loaded as
        ``accelerator.load_state`` loads it (a warning names the world size that saved it); memory snapshots of
        another world size are not used.

        Raises:
            CheckpointCorruptError: every checkpoint was refused, or the folder changed under 3 loads in a row.
        """
        ck = self.checkpointer

        def probe(cand):
            if cand.tier == StorageType.MEMORY:
                return cand.files()
            cand.verify()
            return None

        for attempt in range(3):
            try:
                # accelerate's load_state reads a folder saved by any number of processes (model and
                # optimizer files are the main process's; a missing random_states_{i}.pkl is skipped): so are
                # committed folders of another world size (memory snapshots are per rank: this world's only)
                files, cand = ck.load_with(probe, any_world_size=True)
            except CheckpointNotFoundError:
                return None
            path = os.path.join(ck.checkpoint_dir, self.dirname(cand.step))
            if files is not None and not os.path.isdir(path):
                log.warning("the newest snapshot, step %d, is held in memory only; writing it to %s", cand.step,
                            path)
                ck.write_out(files, cand.step, self.dirname(cand.step), modes=cand.modes())
            self.accelerator.load_state(path, **load_kwargs)
            # accelerate read the folder by path after snapckpt verified it: the job saving there may have
            # committed it again in between (a copy nobody verified, another one on each rank): load again
            error: Optional[BaseException] = None
            try:
                cand.check_unchanged()
            except Exception as e:
                error = e
            changed = ck.coordinator.agree("accelerate load unchanged", error)
            if not changed:
                break
            log.warning("%s changed while accelerate loaded it (%s); loading again", path,
                        "; ".join(f"rank {r}: {e}" for r, e in sorted(changed.items())))
        else:
            raise CheckpointCorruptError(f"{ck.checkpoint_dir}: the folder loaded was committed again or deleted "
                                         "while accelerate read it, 3 times; load again once the job saving "
                                         "there has settled")
        if self.automatic_naming:
            self.accelerator.project_configuration.iteration = cand.step + 1
        return path

    def _expect_once(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After the first optimizer step: have the persister reserve this rank's arena for the models' and
        optimizers' tensors (:meth:`snapckpt.Checkpointer.expect`), so that the first save does not allocate its
        shared memory on the training thread. Once."""
        self._remove_hooks()
        # a state_dict() that fails costs only the hint: expect logs it and returns False
        self.checkpointer.expect({"models": list(self.accelerator._models),
                                  "optimizers": list(self.accelerator._optimizers)})

    def _remove_hooks(self) -> None:
        hooks, self._expect_hooks = self._expect_hooks, []
        for h in hooks:
            h.remove()

    def close(self) -> None:
        """Wait for outstanding commits and detach from the persister (idempotent)."""
        self._remove_hooks()
        self.checkpointer.close()


def _indexed(stem: str, i: int, ext: str) -> str:
    return f"{stem}{ext}" if i == 0 else f"{stem}_{i}{ext}"
