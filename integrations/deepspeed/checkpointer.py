"""The facade: :class:`DeepSpeedCheckpointer`, snapckpt for one DeepSpeed engine (save, load, policy, close).

It owns the pieces and wires them to the engine: a :class:`snapckpt.Checkpointer` of the checkpoint
directory, the save side (:class:`~.save.DeepSpeedSaver`), the framework seam installed as
``engine.checkpoint_engine`` (:class:`~.engine.SnapckptCheckpointEngine`), and the load side
(:class:`~.load.DeepSpeedLoader`). With :meth:`DeepSpeedCheckpointer.attach` it also takes snapshots at step
boundaries by the core's :class:`snapckpt.SnapshotPolicy`.

When the DeepSpeed config enables a monitor (``"tensorboard"``, ``"csv_monitor"``, ``"wandb"``, ``"comet"``),
each checkpoint's metrics (:mod:`snapckpt.metrics`: ``snapckpt/stall_secs``, ``snapckpt/durable_secs``...)
go to ``engine.monitor.write_events`` as ``(name, value, step)``, ``step`` being the step saved; DeepSpeed's
monitor writes rank 0's.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from snapckpt import Checkpointer, SnapshotPolicy
from snapckpt.errors import CheckpointDirError
from snapckpt.events import Event, StorageType
from snapckpt.metrics import event_metrics

from snapckpt.integrations.deepspeed.engine import SnapckptCheckpointEngine
from snapckpt.integrations.deepspeed.layout import same_directory
from snapckpt.integrations.deepspeed.load import DeepSpeedLoader
from snapckpt.integrations.deepspeed.save import DeepSpeedSaver

__all__ = ["DeepSpeedCheckpointer"]

log = logging.getLogger(__name__)


class DeepSpeedCheckpointer:
    """snapckpt for one DeepSpeed engine: native layout, memory and disk tiers, crash-safe ``latest``.

    Args:
        engine: a ``DeepSpeedEngine`` from ``deepspeed.initialize`` (dense model, ZeRO stage 0-3).
        checkpoint_dir: the directory ``save_checkpoint``/``load_checkpoint`` use (DeepSpeed's ``save_dir``).
        **options: :class:`snapckpt.CheckpointOptions` fields (``keep_last``, timeouts...). ``weights_only``
            defaults to ``False`` here, as DeepSpeed's loader (see the package docstring).

    Construction is collective (every rank, same order). The engine's ``checkpoint_engine`` is replaced
    until :meth:`close`.

    Raises:
        NotImplementedError: a pipeline engine, an MoE model or NVMe optimizer offload.
        and what :class:`snapckpt.Checkpointer` raises.
    """

    def __init__(self, engine, checkpoint_dir: "str | os.PathLike[str]", **options: Any) -> None:
        _check_engine(engine)
        options.setdefault("weights_only", False)
        self.engine = engine
        self._checkpointer = Checkpointer(checkpoint_dir, **options)
        self.checkpoint_dir = self._checkpointer.checkpoint_dir
        # DeepSpeed decided at init which rank writes mp_rank_XX_model_states.pt; every rank now builds it
        # (for its memory snapshot) and only the original writers persist it.
        self._writes_model_states = bool(engine.save_non_zero_checkpoint)
        self._original_engine = engine.checkpoint_engine
        self._saver = DeepSpeedSaver(engine, self._checkpointer, self._original_engine, self._writes_model_states)
        engine.save_non_zero_checkpoint = True
        self._ckpt_engine = SnapckptCheckpointEngine(self._saver, self.close)
        engine.checkpoint_engine = self._ckpt_engine
        self._loader = DeepSpeedLoader(engine, self._checkpointer, self._ckpt_engine)
        self._closed = False
        self._hook = None
        # the first forward after an optimizer step reserves the arena for the state's size (_expect_once)
        self._expect_hook = engine.register_forward_pre_hook(self._expect_once)
        self._policy: Optional[SnapshotPolicy] = None
        self._last_policy_step: Optional[int] = None
        monitor = getattr(engine, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            self._monitor = monitor
            self._checkpointer.add_listener(self._report)

    def _report(self, event: Event) -> None:
        """Write an event's metrics to the DeepSpeed monitor (on the training thread, where events fire)."""
        m = event_metrics(event)
        if m:
            self._monitor.write_events([(name, value, event.step) for name, value in m.items()])

    # -------------------------------------------------------------------------------- properties
    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`snapckpt.Checkpointer` (events, ``last_load``, ``last_stats``)."""
        return self._checkpointer

    @property
    def last_handle(self):
        """The :class:`snapckpt.SaveHandle` of the newest snapshot (``None`` before the first)."""
        return self._saver.last_handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (also through ``engine.destroy()``): the engine has its own checkpoint
        engine back."""
        return self._closed

    def _check_dir(self, path, what: str) -> None:
        if not same_directory(path, self.checkpoint_dir):
            raise CheckpointDirError(f"{what}({os.fspath(path)!r}) but this DeepSpeedCheckpointer uses "
                                f"{self.checkpoint_dir!r}; use one DeepSpeedCheckpointer per checkpoint directory")

    # -------------------------------------------------------------------------------------- save
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False,
                        storage_type: StorageType = StorageType.DISK) -> bool:
        """``engine.save_checkpoint`` through snapckpt; returns once the snapshot is taken.

        Args:
            save_dir: must be this checkpointer's ``checkpoint_dir``.
            tag: DeepSpeed's tag (default ``global_step<N>``); an int or a string, one path component.
            client_state: extra items saved in the model-states file (DeepSpeed semantics).
            save_latest: DISK only: replace ``<save_dir>/latest`` once this tag is committed.
            exclude_frozen_parameters: DeepSpeed semantics (LoRA: only trainable weights are saved).
            storage_type: ``MEMORY`` (shared memory only; never touches ``save_dir``'s tags, though DeepSpeed
                itself still copies its recovery scripts into ``save_dir`` on rank 0) or ``DISK``
                (also written and committed in the background; :meth:`wait` blocks until durable).

        Returns ``True`` like DeepSpeed. Collective. Raises what ``Checkpointer.save`` raises, plus
        ``ValueError`` for a tag that is not one path component.
        """
        self._check_dir(save_dir, "save_checkpoint")
        self._saver.tier = StorageType(storage_type)
        try:
            self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                        save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
            self._ckpt_engine.flush()
        finally:
            self._saver.tier = StorageType.DISK
        return True

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every DISK save of this rank is committed (``latest`` names the newest); raises the
        first failure (full disk, missing rank, persister death) not raised before.

        Args:
            timeout: seconds to wait at most (``None``: the checkpointer's own timeout).
        """
        self._ckpt_engine.flush()
        self._checkpointer.wait(timeout)

    # -------------------------------------------------------------------------------------- load
    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """``engine.load_checkpoint`` with snapckpt's tiers; returns ``(load_path, client_state)`` like it.

        With ``tag=None`` every rank agrees on the newest step complete on all ranks, in memory or
        committed on disk, and loads it (memory first when at least as new); a damaged candidate is
        skipped by all ranks together. A directory with no snapckpt commit but a DeepSpeed ``latest`` (a
        checkpoint DeepSpeed wrote itself) is loaded natively. With a ``tag``, that tag is loaded from disk
        (its manifest verified when it has one). ``load_path`` names ``<load_dir>/<tag>/<model file>`` for
        either tier. Returns ``(None, None)`` when there is nothing to load, as DeepSpeed does.

        Raises:
            IncompatibleCheckpointError: under ZeRO stage 1-3, the checkpoint was written at another
                data-parallel size (the message names DeepSpeed's universal checkpoint route). A ZeRO stage 0
                one loads at any data-parallel size, as with DeepSpeed's own ``load_checkpoint``.
            CheckpointCorruptError: every candidate failed (the message lists each failure per rank).
            CheckpointNotFoundError: no such ``tag``; or, with ``tag=None``, ``latest`` is empty or names a
                tag that is not in the directory and no other checkpoint is there (a warning names
                ``latest`` when another one is loaded instead).
            ValueError: ``tag`` is not one directory name of ``load_dir`` (``'..'``, ``'/'``...).
        """
        self._ckpt_engine.flush()
        kwargs = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                      load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                      custom_load_fn=custom_load_fn)
        result = self._loader.load(load_dir, tag, kwargs)
        if result[0] is not None:
            # the loaded step is saved already: the policy saves again at its next interval after it, never
            # the loaded tag itself (whose re-commit would replace it, or be refused in a moved directory)
            self._last_policy_step = int(self.engine.global_steps)
        return result

    # -------------------------------------------------------------------------------- policy, close
    def attach(self, memory_interval_steps: Optional[int], disk_interval_steps: Optional[int],
               bind_engine_methods: bool = True) -> None:
        """Take snapshots by policy at step boundaries and route ``engine.save_checkpoint`` /
        ``engine.load_checkpoint`` through this checkpointer (what the config entry does).

        The policy (:class:`snapckpt.SnapshotPolicy` over the two intervals, in optimizer steps; ``None``
        or 0: none) runs in a forward pre-hook of the engine (the first forward after the optimizer step
        that completed step ``N``, before DeepSpeed gathers any ZeRO-3 parameter): at ``N % disk == 0`` a
        DISK save, else at ``N % memory == 0`` a MEMORY save, of tag ``global_step<N>``. Step 0 is never
        saved by policy; the last step of a run is saved by :meth:`close` when the disk policy asks for it
        (no forward follows it; a memory snapshot then would be dropped with the persister). Nor is the
        step a :meth:`load_checkpoint` resumed at: after a resume at step ``N`` the first policy save is
        at the first interval after ``N``.

        Raises:
            ValueError: an interval that is not a positive int (nor ``None`` or 0).
        """
        self._policy = SnapshotPolicy(memory_interval_steps=memory_interval_steps or None,
                                      disk_interval_steps=disk_interval_steps or None)
        self._last_policy_step = int(self.engine.global_steps)
        self._hook = self.engine.register_forward_pre_hook(self._on_forward)
        if bind_engine_methods:
            self.engine.load_checkpoint = self.load_checkpoint  # instance attribute; removed by close()

    def _expect_once(self, module, args) -> None:
        """Once the optimizer made its state (the first forward after an optimizer step): have the persister reserve
        this rank's arena for the engine's module and optimizer tensors (:meth:`snapckpt.Checkpointer.expect`), so
        that the first save does not allocate its shared memory on the training thread. Once per engine."""
        if int(self.engine.global_steps) < 1 or not torch.is_grad_enabled():
            return
        self._expect_hook.remove()
        self._expect_hook = None
        # a state_dict() that fails costs only the hint: expect logs it and returns False
        self._checkpointer.expect({"module": self.engine.module, "optimizer": self.engine.optimizer})

    def _on_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._policy_tick()

    def _policy_tick(self, disk_only: bool = False) -> None:
        step = int(self.engine.global_steps)
        if self._policy is None or step == self._last_policy_step or step == 0:
            return
        self._last_policy_step = step
        # step intervals only: the policy has no seconds intervals, so the elapsed times do not matter
        tier = self._policy.decide(step, secs_since_snapshot=0.0, secs_since_disk=0.0)
        if tier is StorageType.DISK or (tier is StorageType.MEMORY and not disk_only):
            self.save_checkpoint(self.checkpoint_dir, tag=f"global_step{step}", storage_type=tier)

    def close(self) -> None:
        """Wait for outstanding commits, give the engine its own checkpoint engine back, and detach from
        the persister. Idempotent; raises the first outstanding failure."""
        if self._closed:
            return
        self._closed = True
        try:
            self._policy_tick(disk_only=True)  # the run's last step, if the policy saves it to disk
            self._ckpt_engine.flush()
        finally:
            for hook in (self._hook, self._expect_hook):
                if hook is not None:
                    hook.remove()
            self.engine.__dict__.pop("load_checkpoint", None)
            self.engine.checkpoint_engine = self._original_engine
            self.engine.save_non_zero_checkpoint = self._writes_model_states
            self._checkpointer.close()

    def __enter__(self) -> "DeepSpeedCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                log.exception("error while closing the DeepSpeedCheckpointer after another error")


def _check_engine(engine) -> None:
    """Refuse what this integration cannot save natively.

    Raises:
        TypeError: not a DeepSpeed engine (a plain module, or the optimizer of ``deepspeed.initialize``).
        NotImplementedError: a ``PipelineEngine``, an MoE model, or ZeRO-Infinity NVMe optimizer offload.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"DeepSpeedCheckpointer needs the engine that deepspeed.initialize returns (its first "
                        f"value: engine, optimizer, _, _ = deepspeed.initialize(...)), got a "
                        f"{type(engine).__module__}.{type(engine).__qualname__}")

    if isinstance(engine, PipelineEngine):
        raise NotImplementedError("snapckpt does not support DeepSpeed's PipelineEngine yet (it writes per-layer "
                                  "files itself); use engine.save_checkpoint with the stock checkpoint engine")
    if getattr(engine, "has_moe_layers", False):
        raise NotImplementedError("snapckpt does not support DeepSpeed MoE checkpoints yet (expert files)")
    if engine.zero_nvme_offload_optimizer():
        raise NotImplementedError("snapckpt does not support ZeRO-Infinity NVMe optimizer offload (its swap files "
                                  "are copied outside the checkpoint engine)")
