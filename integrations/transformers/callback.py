"""Hugging Face ``Trainer`` integration: :class:`SnapckptCallback`.

``Trainer(..., callbacks=[SnapckptCallback(memory_interval_steps=10)])`` replaces the Trainer's blocking
checkpoint save by a snapckpt snapshot; the node persister writes the same ``checkpoint-N/`` folder the
Trainer would have written (see :mod:`snapckpt.integrations.transformers.files`), so
``trainer.train(resume_from_checkpoint=True)`` and ``from_pretrained`` work unchanged. For a
``peft.PeftModel`` (LoRA and the other peft methods) that folder holds the adapter only, as the Trainer's
does (:mod:`snapckpt.integrations.transformers.peft`).

How it plugs in (transformers 5.24, public callback events only):

1. ``on_step_end`` (after the Trainer's ``DefaultFlowCallback``): if the Trainer decided to save
   (``control.should_save``), the callback takes the save over and sets ``control.should_save = False``,
   so ``Trainer._save_checkpoint`` does not run; the save is *pending*. (A callback listed after this one
   that sets ``should_save`` itself still gets the Trainer's own save: list ``SnapckptCallback`` last.)
   The Trainer's ``on_save`` then fires (after :meth:`SnapckptCallback.attach`) when the folder is
   committed (the callback finds its Trainer at construction, or is given it by
   :meth:`SnapckptCallback.attach`).
   Every ``memory_interval_steps`` steps (:class:`~snapckpt.SnapshotPolicy`) a memory snapshot is pending
   the same way. The RNG states are captured here (and in ``on_evaluate``), where the Trainer does.
2. The pending snapshot is taken at the next ``on_step_begin`` / ``on_epoch_begin`` / ``on_epoch_end`` (or
   the end-of-training ``on_log``/``on_train_end``): after the step's logging and evaluation, so that
   ``trainer_state.json`` holds this step's logs, best metric and ``best_model_checkpoint``, and before
   the next ``optimizer.step()``, so model, optimizer and scheduler are those of step N. A save requested
   by ``on_epoch_end`` (``save_strategy="epoch"``) merges with a pending save of the same step.
3. ``on_pre_optimizer_step`` calls :meth:`Checkpointer.fence` (under DeepSpeed, which steps inside
   ``accelerator.backward``, the snapshot is fenced as soon as it is taken).
4. Retention: after each commit, world rank 0 applies the rule of transformers' own ``rotate_checkpoints``
   with ``save_total_limit`` and ``state.best_model_checkpoint``. It only sees committed folders (folders in
   flight are hidden ``.checkpoint-N.partial-*``), keeps the newest committed one and the best one, and never
   retires a folder whose ``on_save`` has not fired yet: as ``Trainer._save_checkpoint`` does, it runs just
   before the ``on_save`` of step N, over the folders up to N, N counting as the newest (commits may be learnt
   of late and out of order on a loaded host). transformers' ``get_last_checkpoint`` only matches
   ``checkpoint-<digits>``, so auto-resume never picks an incomplete folder.
5. Resume (:mod:`snapckpt.integrations.transformers.resume`) at ``on_init_end``, before ``train()`` looks for
   a checkpoint: a memory-only snapshot is written out as ``checkpoint-N``, damaged folders are set aside.
6. Metrics (:mod:`snapckpt.metrics`), after :meth:`SnapckptCallback.attach`: each checkpoint's
   ``snapckpt/*`` values go through the public ``Trainer.log``, so they reach ``state.log_history`` and
   every ``report_to`` integration (TensorBoard, W&B, ...), which see them as ``train/snapckpt/...``. A
   callback gets no handle on the Trainer, and the reporting callbacks run before user callbacks on the
   ``logs`` of ``on_log`` (which ``log_history`` holds a copy of), so there is no other public path.
   They are logged at the ``on_step_begin`` after they are known (never in ``on_step_end``: a
   ``Trainer.log`` there would clear the ``should_log`` that the Trainer's own loss logging of that step
   needs), and the last commits at the end-of-training summary, after it.

``save_strategy="best"``: the Trainer decides to save after every ``on_evaluate`` (``_determine_best_metric``),
with no callback event before its save. The callback, listed after every callback that handles ``on_evaluate``
(checked at construction and at ``train()``: :class:`ValueError` otherwise), makes that decision in its
``on_evaluate`` by the documented rule and records the new best in ``state`` as the Trainer would; the
Trainer then finds no new best and skips its save, and the callback's snapshot takes its place. Should the
Trainer save a step itself all the same (its ``on_save`` reaches the callback), the callback drops its own
save of that step.

DeepSpeed (``TrainingArguments(deepspeed=...)``, ZeRO 0-3): the folder also holds DeepSpeed's own checkpoint
(``global_stepN/``, ``latest``, ``zero_to_fp32.py``), captured from DeepSpeed's ``save_checkpoint`` and
snapshotted with the Trainer's files (:mod:`snapckpt.integrations.transformers.deepspeed_files`); the
``"snapckpt"`` section of the DeepSpeed config sets the callback's options.

Not covered (the Trainer keeps saving itself, or the callback raises): FSDP (the Trainer
saves through torch.distributed.checkpoint), XLA and SageMaker model parallel runs (their saves are
collective framework calls); a PEFT model under DeepSpeed; ``push_to_hub=True``
with a ``hub_strategy`` that pushes checkpoints (:class:`ValueError`: use ``hub_strategy="end"``); a ``PeftModel``
with an adapter not named ``"default"`` (peft saves those in sub-folders) and adapters added through
transformers' own ``add_adapter``/``load_adapter`` (``NotImplementedError`` at ``train()``; see
:mod:`snapckpt.integrations.transformers.peft`); the GradScaler's ``scaler.pt`` (fp16 mixed precision on
GPU; the callback has no handle on the Accelerator); hyper-parameter search run directories;
``save_on_each_node``. ``trainer_state.json``'s ``total_flos`` holds the FLOPs stored at the last logging
step (the Trainer's ``store_flos`` is not reachable from a callback), and the states of
``ExportableState`` callbacks other than ``TrainerControl`` are those of train start.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import numpy as np
from transformers import TrainerCallback
from transformers.trainer_utils import sort_checkpoints
from transformers.utils.hub import convert_file_size_to_int

from snapckpt import Checkpointer, CheckpointOptions, Event, SnapshotPolicy, StorageType
from snapckpt.errors import CheckpointCorruptError
from snapckpt.formats import RawBytes
from snapckpt.metrics import event_metrics

from snapckpt.integrations.transformers import deepspeed_files as D
from snapckpt.integrations.transformers import files as F
from snapckpt.integrations.transformers import peft as P
from snapckpt.integrations.transformers.resume import PREFIX, materialize_newest

__all__ = ["SnapckptCallback"]

log = logging.getLogger(__name__)

#: transformers' own progress displays: their ``on_evaluate`` only closes a progress bar.
_DISPLAY = ("ProgressCallback", "NotebookProgressCallback")


@dataclass
class _Pending:
    step: int
    tier: StorageType
    rng: bytes


def _check_options(options: Dict[str, Any]) -> None:
    """Validate the callback's ``**options`` now, not at Trainer construction.

    Raises:
        ValueError: a key the Trainer's own arguments decide (``keep_last``, ``disk_interval_steps``),
            naming the ``TrainingArguments`` field to set; or a bad value.
        TypeError: an unknown name, listing the callback's parameters and the valid options.
    """
    for key, instead in D.TRAINER_DECIDES.items():
        if key in options:
            raise ValueError(f"SnapckptCallback does not take {key}: set {instead}, which the callback honours "
                             "(retention together with the best-model rule)")
    valid = sorted(f.name for f in dataclasses.fields(CheckpointOptions) if f.name not in D.TRAINER_DECIDES)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown snapckpt option(s) {unknown} for SnapckptCallback; its parameters: "
                        f"['memory_interval_steps', 'max_shard_size', 'resume_from_memory'], and the "
                        f"CheckpointOptions fields: {valid}")
    CheckpointOptions.from_kwargs(**options)


class SnapckptCallback(TrainerCallback):
    """A ``TrainerCallback`` that takes over the Trainer's checkpoint saves with snapckpt snapshots.

    Args:
        memory_interval_steps: also snapshot into the node's shared memory every this many optimizer
            steps (``None``: only at the Trainer's own save points, ``save_steps``/``save_strategy``, which
            go to disk).
        max_shard_size: shard threshold of ``model.safetensors``, as ``save_pretrained`` (default
            ``"50GB"``, the Trainer's).
        resume_from_memory: at Trainer construction, write a memory-only snapshot newer than every
            ``checkpoint-*`` folder out as that folder, so that ``resume_from_checkpoint=True`` finds it.
        **options: :class:`~snapckpt.options.CheckpointOptions` fields (``shm_dir``, timeouts...). The
            checkpoint directory is ``TrainingArguments.output_dir``. Retention is
            ``TrainingArguments.save_total_limit``; ``keep_last`` is refused.

    Attributes:
        checkpointer: the :class:`~snapckpt.Checkpointer` (``None`` before Trainer construction and after
            training ends).
        stall_secs: seconds each snapshot blocked training (list, one per snapshot taken).
        metrics: every ``{name: value}`` record of :mod:`snapckpt.metrics` this rank saw, in order (list;
            what :meth:`attach` sends to ``Trainer.log``).
        resumed_from: ``(step, tier)`` of the snapshot the callback wrote out at construction, else ``None``.

    Raises:
        ValueError: bad ``memory_interval_steps``, ``keep_last`` given, or (at Trainer construction)
            ``push_to_hub=True`` with a ``hub_strategy`` other than ``"end"`` and a ``save_strategy`` other
            than ``"no"`` (the Trainer pushes those checkpoints from inside the save the callback
            replaces), or (at Trainer construction and when ``train()`` starts) ``save_strategy="best"``
            with a callback handling ``on_evaluate`` listed after this one.
        TypeError: an unknown option.
        NotImplementedError: (at Trainer construction) FSDP or ``save_on_each_node``; (when ``train()``
            starts) adapters the callback cannot write
            (:func:`~snapckpt.integrations.transformers.peft.check_supported`), or (at the first save) a PEFT
            model under DeepSpeed.

    Under DeepSpeed, ``weights_only`` defaults to ``False`` (DeepSpeed's files hold its config objects, and its
    own loader reads them so: point the callback only at output directories you trust), and a ``"snapckpt"``
    section of the DeepSpeed config (``memory_interval_steps``, ``remote_dir``, ``options``, ``enabled``)
    sets the callback's options; it raises :class:`ValueError` for a key the Trainer's arguments decide.
    """

    def __init__(self, memory_interval_steps: Optional[int] = None, *, max_shard_size: "int | str" = "50GB",
                 resume_from_memory: bool = True, **options: Any) -> None:
        # the core's cadence rule (and its check: a positive int or None), memory tier only
        self._policy = SnapshotPolicy(memory_interval_steps=memory_interval_steps)
        _check_options(options)
        if not isinstance(resume_from_memory, bool):
            raise ValueError(f"resume_from_memory must be True or False, got {resume_from_memory!r}")
        try:
            if convert_file_size_to_int(max_shard_size) <= 0:
                raise ValueError("not positive")
        except (ValueError, TypeError) as e:
            raise ValueError(f"max_shard_size must be a positive size such as '5GB' or a number of bytes, got "
                             f"{max_shard_size!r}") from e
        self.memory_interval_steps = memory_interval_steps
        self.max_shard_size = max_shard_size
        self.resume_from_memory = resume_from_memory
        self._options = dict(options)
        self.checkpointer: Optional[Checkpointer] = None
        self.stall_secs: List[float] = []
        self.resumed_from: Optional[tuple] = None
        self.metrics: List[Dict[str, float]] = []
        self._unlogged: List[Dict[str, float]] = []  # metrics not yet sent to Trainer.log
        self._trainer: Any = None  # attach(): on_save and metrics through Trainer.log
        self._found: Any = None  # the Trainer found at construction: on_save only
        self._saved_states: Dict[int, Any] = {}  # step -> (args, TrainerState at that step), for on_save
        self._committed_steps: Set[int] = set()  # committed, its on_save not fired yet (_deliver)
        self._rotate_due = False  # a commit with no on_save owed: retention runs at the next _deliver
        self._logging = False  # inside our own Trainer.log call
        self._firing = False  # inside our own CallbackHandler.on_save call
        self._own_eval = False  # the next on_evaluate is the Trainer's evaluation of its training loop
        self._expected = False  # on_step_end asked the Checkpointer to reserve the arena (Checkpointer.expect)
        self._pending: Optional[_Pending] = None
        self._disk_steps: set = set()
        self._static: Dict[str, Any] = {}
        self._args: Any = None
        self._state: Any = None
        self._off = False  # the DeepSpeed config's "snapckpt": {"enabled": false}: the Trainer saves itself

    # ------------------------------------------------------------------------------- lifecycle
    def attach(self, trainer: Any) -> Any:
        """Send each checkpoint's metrics through ``trainer.log``: to ``trainer.state.log_history`` and every
        ``report_to`` integration (TensorBoard, W&B, MLflow, ...), under the names of :mod:`snapckpt.metrics`;
        and fire the Trainer's ``on_save`` event for every callback, as the Trainer's own save does.

        ``on_save`` fires when a disk checkpoint is committed (the folder ``checkpoint-N`` is complete, as
        after the Trainer's own save), on the training thread at the next step boundary, in step order, with
        the ``TrainerState`` as it was at step ``N`` (a copy: ``state.global_step == N``, so callbacks that
        look for ``checkpoint-{state.global_step}`` find it: retention never retires it before). The
        callbacks' returned control is merged into the Trainer's; an exception raised by one of them leaves
        ``train()``, as from the Trainer's own ``on_save``. A save that fails raises its error at the next step
        boundary; one skipped (``on_slot_busy="skip"``) is logged as a warning; neither fires ``on_save``.

        Call it once after constructing the Trainer with this callback::

            cb = SnapckptCallback(memory_interval_steps=10)
            trainer = cb.attach(Trainer(model=model, args=args, callbacks=[cb]))

        Unattached, checkpoints are taken just the same and the values are only in :attr:`metrics`
        (``log_history`` and ``trainer_state.json`` stay exactly the Trainer's own); ``on_save`` fires all
        the same, since the callback finds its Trainer when the Trainer's construction calls its
        ``on_init_end`` (among the callers of that event: a callback has no public handle on it; where
        that fails a warning says so, and ``attach`` is needed for ``on_save`` too).

        Args:
            trainer: the ``transformers.Trainer`` whose callbacks hold this callback.

        Returns:
            ``trainer``.

        Raises:
            ValueError: ``trainer`` is not a Trainer, or this callback is not among its callbacks (pass it in
                ``Trainer(callbacks=[...])``, so that it also sees the Trainer's construction).
        """
        handler = getattr(trainer, "callback_handler", None)
        if not callable(getattr(trainer, "log", None)) or handler is None:
            raise ValueError(f"attach() takes the transformers.Trainer, got {type(trainer).__name__}")
        if not any(cb is self for cb in handler.callbacks):
            raise ValueError("this SnapckptCallback is not among the Trainer's callbacks: pass it as "
                             "Trainer(..., callbacks=[callback]) and then call callback.attach(trainer)")
        self._trainer = trainer
        return trainer

    def _on_save_trainer(self) -> Any:
        return self._trainer if self._trainer is not None else self._found

    def _find_trainer(self) -> Any:
        """The Trainer whose construction called this ``on_init_end`` (transformers: ``Trainer.__init__`` ->
        ``CallbackHandler.on_init_end`` -> ``call_event``), found as ``self`` of a calling frame that is a
        Trainer holding this callback; None when there is none."""
        frame = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                return None
            obj = frame.f_locals.get("self")
            handler = getattr(obj, "callback_handler", None)
            if obj is not self and callable(getattr(obj, "log", None)) and \
                    any(cb is self for cb in getattr(handler, "callbacks", ())):
                return obj
            frame = frame.f_back
        return None

    def _check_args(self, args: Any) -> None:
        if getattr(args, "fsdp", None):
            raise NotImplementedError(
                "SnapckptCallback does not take over the Trainer's saves under FSDP (TrainingArguments.fsdp): "
                "the Trainer saves them with accelerate's save_fsdp_model/save_fsdp_optimizer "
                "(pytorch_model_fsdp_0/ and optimizer_0/ through torch.distributed.checkpoint, or "
                "pytorch_model_fsdp.bin), a layout the callback does not write; remove the callback for FSDP runs")
        if getattr(args, "save_on_each_node", False):
            raise NotImplementedError(
                "SnapckptCallback does not take over the Trainer's saves under save_on_each_node=True (every "
                "node writes its own copy); remove the callback, or save once on a shared filesystem")
        hub_strategy = str(getattr(args.hub_strategy, "value", args.hub_strategy))
        if getattr(args, "push_to_hub", False) and hub_strategy != "end" and _strategy(args.save_strategy) != "no":
            raise ValueError(
                f"SnapckptCallback does not push checkpoints to the Hub (push_to_hub=True with hub_strategy="
                f"'{hub_strategy}'): the Trainer pushes from inside the save the callback replaces, so every "
                "checkpoint push would be dropped. Pass TrainingArguments(hub_strategy='end') and call "
                "trainer.push_to_hub() after training (with hub_strategy='end' the Trainer pushes nothing during "
                "training either), or remove the callback to let the Trainer save and push")

    def _check_best_order(self, args: Any) -> None:
        """``save_strategy="best"``: this callback records the new best metric in ``on_evaluate`` (see
        :meth:`_take_best_save`), so no callback after it may look at ``on_evaluate`` (an
        ``EarlyStoppingCallback`` there would see the new best as no improvement)."""
        if _strategy(args.save_strategy) != "best":
            return
        trainer = self._on_save_trainer()
        if trainer is None:
            raise ValueError("with save_strategy='best' SnapckptCallback needs its Trainer, to check the order of "
                             "the callbacks: pass it in Trainer(callbacks=[...]), or call callback.attach(trainer) "
                             "before train()")
        cbs = trainer.callback_handler.callbacks
        after = cbs[next(i for i, cb in enumerate(cbs) if cb is self) + 1:]
        late = [type(cb).__name__ for cb in after if type(cb).on_evaluate is not TrainerCallback.on_evaluate
                and not (type(cb).__module__.startswith("transformers.") and type(cb).__name__ in _DISPLAY)]
        if late:
            raise ValueError(
                f"with save_strategy='best' SnapckptCallback must come after every callback that handles "
                f"on_evaluate, and {', '.join(late)} comes after it: list SnapckptCallback last in "
                "Trainer(callbacks=[...]) (or trainer.pop_callback(cb); trainer.add_callback(cb)). It records the "
                "new best metric in on_evaluate, where the Trainer records it only after every on_evaluate")

    def _open(self, args: Any) -> Checkpointer:
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(args.output_dir, **self._options)
            self.checkpointer.add_listener(self._on_event)
        return self.checkpointer

    def close(self, *, clean: Optional[bool] = None) -> None:
        """Wait for outstanding commits and detach from the persister (idempotent; ``on_train_end`` calls it).
        ``clean``: see :meth:`snapckpt.Checkpointer.close` (``None``: a close during an exception is a failure)."""
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.close(clean=clean)

    def _apply_section(self, args: Any) -> None:
        """The ``"snapckpt"`` section of the DeepSpeed config (:func:`.deepspeed_files.section_options`)."""
        given = {"memory_interval_steps": self.memory_interval_steps, **self._options}
        sec = D.section_options(args, given)
        if sec is None:
            self._off = True
            log.info('SnapckptCallback is off: the DeepSpeed config says "snapckpt": {"enabled": false}')
            return
        if sec.get("memory_interval_steps") is not None:
            self.memory_interval_steps = sec["memory_interval_steps"]
            self._policy = SnapshotPolicy(memory_interval_steps=self.memory_interval_steps)
        self._options.update(sec.get("options", {}))
        if getattr(args, "deepspeed", None):
            # DeepSpeed's files hold its config objects; the Trainer's resume (DeepSpeed's loader) reads them
            # with weights_only=False, and so does a memory snapshot written out (see the docs' trust note)
            self._options.setdefault("weights_only", False)

    def on_init_end(self, args, state, control, **kwargs):
        self._check_args(args)
        self._apply_section(args)
        if self._off:
            return
        if self._trainer is None and self._found is None:
            self._found = self._find_trainer()
            if self._found is None and _strategy(args.save_strategy) != "best":  # "best": the check below raises
                log.warning("SnapckptCallback could not find its Trainer: the Trainer's on_save event will not fire "
                            "for other callbacks; call callback.attach(trainer) after constructing the Trainer")
        self._check_best_order(args)
        # No TrainerState for retention yet: the fresh one knows no best checkpoint, and rotating after the
        # write-out of a memory snapshot with it would delete the best folder (the Trainer's resume restores
        # best_model_checkpoint; the first commit of training rotates with it)
        self._args, self._state = args, None
        ck = self._open(args)
        try:  # also sets damaged folders aside
            self.resumed_from = materialize_newest(ck, args.output_dir, self.resume_from_memory)
        except CheckpointCorruptError:  # every folder is damaged: Trainer construction fails
            self.close(clean=True)  # a refusal to start, not a crash: nothing in memory to keep
            raise

    def on_train_begin(self, args, state, control, processing_class=None, **kwargs):
        self._check_args(args)
        if self._off:
            return
        try:
            self._check_best_order(args)  # a callback added after construction
        except ValueError:
            self.close(clean=True)  # a refusal to start, not a crash
            raise
        self._own_eval = False
        self._expected = False
        if getattr(args, "deepspeed", None) and self._on_save_trainer() is None:
            raise ValueError("under DeepSpeed SnapckptCallback saves through the Trainer's DeepSpeed engine and needs "
                             "the Trainer: call callback.attach(trainer) after constructing it")
        P.check_supported(kwargs.get("model"))
        self._args, self._state = args, state
        self._open(args)
        self._pending = None
        self._static = {F.TRAINING_ARGS_NAME: RawBytes(F.torch_bytes(args)),  # rank 0 writes them
                        **F.processing_class_files(processing_class),
                        **P.card_files(kwargs.get("model"))} if state.is_world_process_zero else {}

    def on_train_end(self, args, state, control, **kwargs):
        self._state = state
        self._flush(args, state, control, kwargs)
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self._deliver()
        self.close()
        self._deliver()  # a commit close() waited for
        self._log_metrics()

    # ------------------------------------------------------------------------------ save points
    def on_step_end(self, args, state, control, **kwargs):
        self._state = state
        if self._off:
            return control
        self._own_eval = bool(control.should_evaluate)  # the Trainer evaluates right after this event
        if not self._expected:  # the first step made the optimizer's state: reserve the arena for its size
            self._expected = True
            # only the main process's snapshot holds the model and optimizer (_flush); DeepSpeed's engine saves
            # its own partitions on every rank
            if state.is_world_process_zero and not getattr(args, "deepspeed", None):
                self.checkpointer.expect({"model": kwargs.get("model"),
                                          "optimizer": None if args.save_only_model else kwargs.get("optimizer")})
        self.checkpointer.poll()  # background failures surface here; commits trigger retention
        self._deliver()
        disk = bool(control.should_save)
        mem = self._policy.decide(state.global_step, 0.0, 0.0) == StorageType.MEMORY  # no time-based cadence
        if disk:
            control.should_save = False  # the Trainer's own _save_checkpoint does not run
        if disk or mem:
            self._request(args, state, control, kwargs, StorageType.DISK if disk else StorageType.MEMORY)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        self._state = state
        if self._off:
            return control
        self._own_eval = bool(control.should_evaluate)
        if control.should_save:  # save_strategy="epoch"
            control.should_save = False
            self._request(args, state, control, kwargs, StorageType.DISK)
        else:
            self._flush(args, state, control, kwargs)
        self._deliver()
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        own, self._own_eval = self._own_eval, False
        if own and _strategy(args.save_strategy) == "best" and self._take_best_save(args, state, metrics):
            self._request(args, state, control, kwargs, StorageType.DISK)
        p = self._pending
        if p is not None and p.step == state.global_step:  # the Trainer records RNG after evaluating
            p.rng = F.rng_state_bytes(_distributed(args))

    def on_step_begin(self, args, state, control, **kwargs):
        self._own_eval = False
        self._flush(args, state, control, kwargs)
        self._deliver()
        self._log_metrics()

    on_epoch_begin = on_step_begin  # take the pending snapshot before the next step either way

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "train_runtime" in logs and self.checkpointer is not None:
            # The end-of-training summary: _load_best_model comes next and needs the folders committed.
            self._flush(args, state, control, kwargs, drop_last_log=True)
            self.checkpointer.wait()
            self._deliver()
            self._log_metrics()  # the last commits, before on_train_end closes the reporting writers

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.checkpointer is not None:
            self.checkpointer.fence()

    def on_save(self, args, state, control, **kwargs):
        if self._firing:
            return
        # The Trainer saved checkpoint-N itself (a callback after this one asked for it after this one's
        # on_step_end, or a best-model decision this callback did not foresee): never write that folder twice.
        p = self._pending
        if p is not None and p.step == state.global_step and p.tier == StorageType.DISK:
            log.warning("checkpoint-%d was saved by the Trainer itself; SnapckptCallback does not save it again",
                        p.step)
            self._pending = None

    # --------------------------------------------------------------------------------- helpers
    def _take_best_save(self, args, state, metrics) -> bool:
        """``save_strategy="best"``: decide as ``Trainer._determine_best_metric`` (transformers 5.24) will
        right after this ``on_evaluate`` whether ``metrics`` hold a new best, and if so record it in
        ``state`` (``best_metric``, ``best_global_step``) as that method would. The Trainer then finds no
        new best, sets ``control.should_save = False`` and skips its own save: this callback takes it
        instead, as at every other save point. The rule is the documented one: ``metric_for_best_model``
        (``eval_``-prefixed), strictly greater (``greater_is_better``) or strictly less than
        ``state.best_metric``; a metric that is missing or not a new best leaves everything to the Trainer.
        Should the Trainer still save, :meth:`on_save` drops this callback's save of that step."""
        name = args.metric_for_best_model
        if name is None or not metrics:
            return False
        name = name if name.startswith("eval_") else f"eval_{name}"
        if name not in metrics:
            return False  # the Trainer raises its KeyError next
        value = metrics[name]
        greater = bool(args.greater_is_better)
        best = state.best_metric if state.best_metric is not None else (float("-inf") if greater else float("inf"))
        if not (np.greater if greater else np.less)(value, best):
            return False
        state.best_metric = value
        state.best_global_step = state.global_step
        return True

    def _request(self, args, state, control, kwargs, tier: StorageType) -> None:
        step = state.global_step
        p = self._pending
        if p is not None and p.step != step:
            self._flush(args, state, control, kwargs)  # drops it, with a warning
            p = None
        if tier == StorageType.DISK and step in self._disk_steps:
            log.info("checkpoint-%d is already saved; not saving it again", step)
            return
        rng = F.rng_state_bytes(_distributed(args))
        if p is None:
            self._pending = _Pending(step, tier, rng)
        else:
            p.rng = rng
            if tier == StorageType.DISK:
                p.tier = tier

    def _flush(self, args, state, control, kwargs, drop_last_log: bool = False) -> None:
        p, self._pending = self._pending, None
        if p is None:
            return
        if p.step != state.global_step:  # cannot happen through the Trainer's events; never save a mix
            log.warning("snapshot of step %d dropped: training is at step %d already", p.step, state.global_step)
            return
        t0 = time.perf_counter()
        if p.tier == StorageType.DISK:
            self._disk_steps.add(p.step)
            self._set_best(args, state)
            if self._on_save_trainer() is not None:  # what on_save will see once this step is committed
                self._saved_states[p.step] = (args, copy.deepcopy(state))
        files: Dict[str, Any] = {}
        engine = D.engine_of(self._on_save_trainer())
        if engine is not None:  # collective: DeepSpeed's save, captured, in place of optimizer.pt
            files.update(D.checkpoint_files(engine, kwargs["model"], kwargs.get("lr_scheduler"),
                                            is_zero=state.is_world_process_zero, max_shard_size=self.max_shard_size,
                                            save_only_model=args.save_only_model))
        if state.is_world_process_zero:
            if engine is None:
                files.update(F.model_files(kwargs["model"], self.max_shard_size))
                if not args.save_only_model:
                    files.update(F.optimizer_file(kwargs.get("optimizer")))
                    files.update(F.scheduler_file(kwargs.get("lr_scheduler")))
            files.update(self._static)
            if "TrainerControl" in state.stateful_callbacks:
                rec = control.state()
                rec["args"]["should_save"] = True  # as recorded by the Trainer while it saves
                state.stateful_callbacks["TrainerControl"] = rec
            files[F.TRAINER_STATE_NAME] = RawBytes(F.trainer_state_bytes(state, drop_last_log))
        if not args.save_only_model:
            files[F.rng_file_name(args.world_size, args.process_index)] = RawBytes(p.rng)
        try:
            self.checkpointer.save_files(files, p.step, p.tier, dirname=f"{PREFIX}-{p.step}", tracker_name=None)
        except BaseException:
            self._saved_states.pop(p.step, None)  # never committed: must not hold back later steps' on_save
            raise
        if engine is not None:
            # DeepSpeed steps the optimizer inside accelerator.backward, before on_pre_optimizer_step: the
            # copy of an overlapped snapshot must be done before the next backward, so here
            self.checkpointer.fence()
        self.stall_secs.append(time.perf_counter() - t0)

    def _set_best(self, args, state) -> None:
        """``state.best_model_checkpoint`` as ``Trainer._save_checkpoint`` sets it: the best step's folder,
        when that step was saved (in flight or committed)."""
        best = state.best_global_step
        if not best:
            return
        path = os.path.join(args.output_dir, f"{PREFIX}-{best}")
        if best in self._disk_steps or os.path.isdir(path):
            state.best_model_checkpoint = path

    def _on_event(self, event: Event) -> None:
        """The Checkpointer's listener: records only. It runs inside ``poll``/``save_files``/``wait``, which
        log and swallow a listener's exception, so ``on_save`` and retention run later, in :meth:`_deliver`."""
        m = event_metrics(event)
        if m:
            self.metrics.append(m)
            self._unlogged.append(m)
        if event.kind == "committed" and event.tier == StorageType.DISK:
            if event.step in self._saved_states:
                self._committed_steps.add(event.step)  # retention runs before its on_save
            elif self._state is not None:  # (before training: the write-out of a memory snapshot, no retention
                self._rotate_due = True    # with a fresh TrainerState)
        elif event.kind == "failed" or (event.kind == "skipped" and event.tier == StorageType.DISK):
            if self._saved_states.pop(event.step, None) is not None and event.kind == "skipped":
                log.warning("checkpoint-%d was not saved (%s): on_save does not fire for it", event.step,
                            event.reason)

    def _deliver(self) -> None:
        """Fire the ``on_save`` of every committed step whose older saves have all ended, in step order (the
        Trainer's order; commits may end out of order), each right after retention as
        ``Trainer._save_checkpoint`` runs it; then the retention a commit without ``on_save`` (no Trainer
        found) asked for.
        Called on the training thread at step boundaries, outside the Checkpointer's calls.

        Raises:
            whatever a callback's ``on_save`` raises (as the Trainer's own save would let it).
        """
        while self._saved_states and min(self._saved_states) in self._committed_steps:
            step = min(self._saved_states)
            self._committed_steps.discard(step)
            saved = self._saved_states.pop(step)
            self._rotate(newest=step, state=saved[1])
            self._fire_on_save(step, saved)
        self._committed_steps = {s for s in self._committed_steps if s in self._saved_states}
        if self._rotate_due:
            self._rotate_due = False
            self._rotate()

    def _fire_on_save(self, step: int, saved: Any) -> None:
        """The Trainer's ``on_save`` for the committed step ``step``, with the ``(args, state)`` of that step
        (after :meth:`attach`)."""
        trainer = self._on_save_trainer()
        if trainer is None:
            return
        args, state = saved
        control = trainer.control
        handler = trainer.callback_handler
        should_save = control.should_save  # CallbackHandler.on_save clears it: a save requested now stays
        self._firing = True
        try:
            handler.on_save(args, state, control)  # updates the same control object
        finally:
            self._firing = False
        control.should_save = should_save

    def _log_metrics(self) -> None:
        """Send the metrics not yet logged through ``Trainer.log`` (after :meth:`attach`): records merged
        into as few calls as their names allow (one value per name per call)."""
        if self._trainer is None or self._logging or not self._unlogged:
            return
        batches: List[Dict[str, float]] = [{}]
        for m in self._unlogged:
            if batches[-1].keys() & m.keys():
                batches.append({})
            batches[-1].update(m)
        self._unlogged = []
        control = self._trainer.control
        should_log = control.should_log  # Trainer.log clears it (CallbackHandler.on_log): keep the Trainer's
        self._logging = True
        try:
            for b in batches:
                self._trainer.log(dict(b))
        finally:
            self._logging = False
            control.should_log = should_log

    def _rotate(self, newest: Optional[int] = None, state: Any = None) -> None:
        """Retention (world rank 0, ``save_total_limit``): the rule of transformers' ``rotate_checkpoints``
        (transformers 5.24, ``use_mtime=True`` as the Trainer calls it) over the committed ``checkpoint-*``
        folders except those whose ``on_save`` has not fired (``self._saved_states``): the Trainer never
        deletes a folder before its ``on_save``, and saved none of them yet when it saved step ``newest``.

        Args:
            newest: the step whose ``on_save`` fires next: its folder counts as the newest, as the one the
                Trainer has just written (``None``: the newest by modification time).
            state: the ``TrainerState`` whose ``best_model_checkpoint`` is kept (default: the current one).
        """
        args, state = self._args, (state if state is not None else self._state)
        if args is None or state is None or not state.is_world_process_zero or not args.save_total_limit:
            return
        owed = {_folder(args.output_dir, s) for s in self._saved_states}
        folders = [c for c in sort_checkpoints(args.output_dir, PREFIX, use_mtime=True) if c not in owed]
        if newest is not None:
            mine = _folder(args.output_dir, newest)
            folders = [c for c in folders if c != mine] + ([mine] if os.path.isdir(mine) else [])
        if len(folders) <= args.save_total_limit:
            return
        protected = {folders[-1]}  # what rotate_checkpoints keeps: the newest, for resuming, and the best
        if state.best_model_checkpoint is not None:
            protected.add(str(Path(state.best_model_checkpoint)))
        remaining = len(folders)
        for folder in folders:
            if remaining <= max(args.save_total_limit, len(protected)):
                break
            if folder not in protected:
                shutil.rmtree(folder, ignore_errors=True)
                remaining -= 1


def _folder(output_dir: str, step: int) -> str:
    """``checkpoint-<step>`` under ``output_dir``, spelt as ``sort_checkpoints`` lists it."""
    return str(Path(output_dir) / f"{PREFIX}-{step}")


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


def _distributed(args: Any) -> bool:
    return str(getattr(args.parallel_mode, "value", args.parallel_mode)) == "distributed"
