"""DeepSpeed integration: snapckpt behind DeepSpeed's checkpoint-engine seam, in DeepSpeed's native layout.

Two ways in (DESIGN section 1):

- by hand: ``DeepSpeedCheckpointer(engine, checkpoint_dir)`` then ``save_checkpoint(dir, tag=...,
  storage_type=StorageType.MEMORY or DISK)`` / ``load_checkpoint(dir)``;
- the config entry: :func:`initialize` (``deepspeed.initialize``'s signature) reads a ``"snapckpt"`` section
  of the DeepSpeed config (:class:`DeepSpeedSnapckptConfig`) and attaches a ``DeepSpeedCheckpointer`` to the
  engine: snapshots at step boundaries by policy, ``engine.save_checkpoint`` / ``engine.load_checkpoint``
  through snapckpt.

How it plugs in. ``engine.checkpoint_engine`` is replaced by :class:`SnapckptCheckpointEngine`, an
implementation of DeepSpeed's ``CheckpointEngine`` interface
(``deepspeed/runtime/checkpoint_engine/checkpoint_engine.py``, DeepSpeed 0.19.8). DeepSpeed's own
``engine.save_checkpoint`` still builds every state dict and names every file; the engine's ``save(state_dict,
path)`` only records them, and once this rank's files of the save are all there (one model-states file and,
under ZeRO, one optimizer-states file: DeepSpeed writes no other file through the engine for a dense model)
they are snapshotted into shared memory in one go, before ``save_checkpoint`` returns. The node persister
writes them under ``<dir>/<tag>/`` with the names DeepSpeed gave them, commits, and only then replaces
``<dir>/latest`` (the engine is *decoupled*: DeepSpeed never writes ``latest`` itself; ``get_commit_info``,
which ``engine.step()`` calls before every optimizer step, is where the fence runs).

Memory tier. ``engine.load_checkpoint`` reads ``mp_rank_00_model_states.pt`` on every data-parallel rank,
although only data-parallel rank 0 writes it; every rank therefore snapshots it (ranks other than DeepSpeed's
writer as :class:`~snapckpt.formats.MemoryOnly`), so that a restart can load from memory on every rank. A
memory-tier load hands DeepSpeed empty placeholder files in a scratch directory (its loader globs and checks
paths) and serves the objects from the snapshot through the engine's ``load``.

Also saved, in the sidecar ``<tag>/.snapckpt/deepspeed_rank_XXXXX.pt`` (ignored by DeepSpeed's loaders): the
tag and this rank's RNG states (python, numpy, torch, CUDA), restored on load so that dropout continues
identically (DESIGN contract 8).

Trust. DeepSpeed's files hold config objects and optimizer classes, and DeepSpeed itself loads them with
``weights_only=False``; this integration does the same by default (``weights_only=False``): point it only at
checkpoint directories you trust.

Not supported (a clear error at construction): pipeline engines (``PipelineEngine`` writes per-layer files
itself), MoE models, ZeRO-Infinity NVMe offload of the optimizer.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from snapckpt import rng
from snapckpt import Checkpointer, LoadCandidate, LoadInfo
from snapckpt.errors import CheckpointNotFoundError, IncompatibleCheckpointError, SnapckptError, UnsafeCheckpointError
from snapckpt.events import StorageType
from snapckpt.formats import MemoryOnly, TorchSave
from snapckpt.ondisk.manifest import SIDECAR, validate_dirname
from snapckpt.options import CheckpointOptions

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("snapckpt.deepspeed needs DeepSpeed: pip install 'snapckpt[deepspeed]'") from e

__all__ = ["DeepSpeedCheckpointer", "SnapckptCheckpointEngine", "DeepSpeedSnapckptConfig", "initialize",
           "StorageType", "UNIVERSAL_CHECKPOINT_ADVICE"]

log = logging.getLogger(__name__)

TRACKER = "latest"  # DeepSpeed's tracker file (engine.save_checkpoint / engine.load_checkpoint)
UNIVERSAL_CHECKPOINT_ADVICE = (
    "DeepSpeed ZeRO checkpoints cannot be loaded at another data-parallel size; convert the checkpoint with "
    "DeepSpeed's universal checkpoint tool (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
    "<dir>/<tag> --output_folder <dir>/<tag>_universal) and load it with "
    "\"checkpoint\": {\"load_universal\": true} in the DeepSpeed config")


def _sidecar_name(rank: int) -> str:
    return f"{SIDECAR}/deepspeed_rank_{rank:05d}.pt"


class _PendingSave:
    """The files DeepSpeed handed the engine during one ``save_checkpoint`` call on this rank."""

    def __init__(self, save_dir: str, tag: str, save_latest: bool, expected: int, passthrough: bool) -> None:
        self.save_dir, self.tag, self.save_latest, self.expected = save_dir, tag, save_latest, expected
        self.passthrough = passthrough  # another directory: DeepSpeed's own engine writes it
        self.passed = 0  # files of a passthrough save written so far
        self.files: Dict[str, Any] = {}

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)


class SnapckptCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` that snapshots into snapckpt instead of calling ``torch.save``.

    Installed as ``engine.checkpoint_engine`` by :class:`DeepSpeedCheckpointer`; not used on its own.
    ``is_decoupled()`` is true, so DeepSpeed defers the commit (and ``latest``) to the engine; the commit
    runs in the node persister, and ``latest`` is written there after it.
    """

    def __init__(self, owner: "DeepSpeedCheckpointer") -> None:
        super().__init__()
        self.name = "snapckpt"
        self._owner = owner
        self._pending: Optional[_PendingSave] = None
        self._serving: Optional[Dict[str, Any]] = None  # memory-tier load: {basename: object}

    # -- save ------------------------------------------------------------------------------------
    def create(self, info) -> None:
        """Start collecting the files of ``info.tag`` (DeepSpeed's ``CheckpointCommitInfo``).

        A save into another directory than the checkpointer's (``engine.save_checkpoint(other_dir)``,
        ``engine.save_16bit_model``) is passed through to DeepSpeed's own checkpoint engine: written
        synchronously, as without snapckpt.

        Raises:
            ValueError: a tag DeepSpeed could not load back (see :func:`_check_tag`).
        """
        if self._pending is not None and self._pending.files and not self._pending.passthrough:
            self._owner._snapshot(self._pending)  # a save that never completed its expected files
        passthrough = not self._owner._is_own_dir(info.save_dir)
        if not passthrough:
            _check_tag(str(info.tag))
        self._pending = _PendingSave(os.path.abspath(info.save_dir), str(info.tag), bool(info.save_latest),
                                     self._owner._expected_files(), passthrough=passthrough)

    def makedirs(self, path, exist_ok: bool = False) -> None:
        """Create ``path``, except the tag directory of the save in progress: a checkpoint directory
        appears only when its commit renames it into place."""
        p = self._pending
        if p is not None and not p.passthrough and os.path.abspath(path) == p.tag_dir:
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        """Record ``state_dict`` as the file ``path``; snapshot once every expected file is recorded.
        A file outside the tag directory of a save into the checkpointer's directory (DeepSpeed's
        ``save_16bit_model``) or of a save elsewhere is written at once by DeepSpeed's own engine."""
        p = self._pending
        if p is None or p.passthrough or os.path.dirname(os.path.abspath(path)) != p.tag_dir:
            self._owner._original_engine.save(state_dict, path)
            if p is not None and p.passthrough and os.path.dirname(os.path.abspath(path)) == p.tag_dir:
                p.passed += 1
                if p.passed >= p.expected and p.save_latest and self._owner._checkpointer.rank == 0:
                    with open(os.path.join(p.save_dir, TRACKER), "w") as f:  # as DeepSpeed would
                        f.write(p.tag)
            return
        name = os.path.basename(path)
        if name in p.files:
            raise SnapckptError(f"DeepSpeed saved {name!r} twice in one checkpoint")
        p.files[name] = self._owner._wrap(name, state_dict)
        if len(p.files) >= p.expected:
            self._pending = None
            self._owner._snapshot(p)

    def commit(self, info) -> bool:
        """Snapshot anything still collected (DeepSpeed calls this only for non-decoupled engines)."""
        self.flush()
        return True

    def flush(self) -> None:
        """Snapshot a save whose files are recorded but not yet snapshotted (there is normally none)."""
        p, self._pending = self._pending, None
        if p is not None and p.files and not p.passthrough:
            self._owner._snapshot(p)

    def is_decoupled(self) -> bool:
        return True

    def get_commit_info(self):
        """Called by ``engine.step()`` before each optimizer step: the fence (the snapshot copy is complete
        before the weights change) and a poll of outstanding saves. Returns ``None``: snapckpt commits and
        writes ``latest`` itself, DeepSpeed does neither."""
        self.flush()
        self._owner._checkpointer.fence()
        self._owner._checkpointer.poll()
        return None

    def cleanup(self) -> None:
        """``engine.destroy()``: close the checkpointer (the last policy save, every commit waited for, the
        engine's own checkpoint engine given back)."""
        self._owner.close()

    def preserves_storage_sharing(self) -> bool:
        # False tells DeepSpeed not to clone tensors before save(): snapckpt writes only the bytes each view
        # uses (case D3), so the clone (a full extra copy on the training critical path) is not needed.
        return False

    # -- load ------------------------------------------------------------------------------------
    def load(self, path: str, map_location=None):
        """Return the object of file ``path``: from the memory snapshot during a memory-tier load, else
        ``torch.load(path, weights_only=<option>)`` (DeepSpeed's own loader trusts its files fully)."""
        if self._serving is not None:
            name = os.path.basename(path)
            if name not in self._serving:
                raise CheckpointNotFoundError(
                    f"the memory snapshot of this rank has no {name!r} (an elastic ZeRO load reads every rank's "
                    "file); falling back to disk")
            return self._serving[name]
        return torch.load(path, map_location=map_location, weights_only=self._owner._checkpointer.options.weights_only)


class DeepSpeedCheckpointer:
    """snapckpt for one DeepSpeed engine: native layout, memory and disk tiers, crash-safe ``latest``.

    Args:
        engine: a ``DeepSpeedEngine`` from ``deepspeed.initialize`` (dense model, ZeRO stage 0-3).
        checkpoint_dir: the directory ``save_checkpoint``/``load_checkpoint`` use (DeepSpeed's ``save_dir``).
        **options: :class:`snapckpt.CheckpointOptions` fields (``keep_last``, timeouts...). ``weights_only``
            defaults to ``False`` here, as DeepSpeed's loader (see the module docstring).

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
        self._tier = StorageType.DISK
        self._original_engine = engine.checkpoint_engine
        # DeepSpeed decided at init which rank writes mp_rank_XX_model_states.pt; every rank now builds it
        # (for its memory snapshot) and only the original writers persist it.
        self._writes_model_states = bool(engine.save_non_zero_checkpoint)
        engine.save_non_zero_checkpoint = True
        self._ckpt_engine = SnapckptCheckpointEngine(self)
        engine.checkpoint_engine = self._ckpt_engine
        self.last_handle = None
        self._closed = False
        self._hook = None
        self._policy: Optional[Tuple[Optional[int], Optional[int]]] = None
        self._last_policy_step: Optional[int] = None

    # -------------------------------------------------------------------------------- properties
    @property
    def checkpointer(self) -> Checkpointer:
        """The underlying :class:`snapckpt.Checkpointer` (events, ``last_load``, ``last_stats``)."""
        return self._checkpointer

    def _expected_files(self) -> int:
        e = self.engine
        return 1 + (1 if e.save_zero_checkpoint else 0)

    def _wrap(self, name: str, state_dict: Any) -> Any:
        if name.endswith("_model_states.pt") and not name.startswith("zero_pp_rank_") \
                and not self._writes_model_states:
            return MemoryOnly(TorchSave(state_dict))
        return TorchSave(state_dict)

    def _is_own_dir(self, path) -> bool:
        return os.path.realpath(path) == os.path.realpath(self.checkpoint_dir)

    def _check_dir(self, path, what: str) -> None:
        if os.path.realpath(path) != os.path.realpath(self.checkpoint_dir):
            raise SnapckptError(f"{what}({os.fspath(path)!r}) but this DeepSpeedCheckpointer uses "
                                f"{self.checkpoint_dir!r}; use one DeepSpeedCheckpointer per checkpoint directory")

    def _snapshot(self, p: _PendingSave) -> None:
        files = dict(p.files)
        files[_sidecar_name(self._checkpointer.rank)] = TorchSave({"tag": p.tag, "rng": rng.capture()})
        tier = self._tier
        # a MEMORY snapshot carries the tracker too: it is only ever applied if the persister flushes the
        # snapshot to disk after a crash, and then `latest` must name it for stock DeepSpeed to find it
        tracker = TRACKER if p.save_latest else None
        self.last_handle = self._checkpointer.save_files(
            files, int(self.engine.global_steps), tier, dirname=p.tag, tracker_name=tracker, tracker_content=p.tag)

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
        self._tier = StorageType(storage_type)
        try:
            self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                        save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
            self._ckpt_engine.flush()
        finally:
            self._tier = StorageType.DISK
        return True

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every DISK save of this rank is committed (``latest`` names the newest); raises the
        first failure (full disk, missing rank, persister death) not raised before."""
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
            IncompatibleCheckpointError: the checkpoint was written at another data-parallel size (the message
                names DeepSpeed's universal checkpoint route).
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
        result = self._load(load_dir, tag, kwargs)
        if result[0] is not None:
            # the loaded step is saved already: the policy saves again at its next interval after it, never
            # the loaded tag itself (whose re-commit would replace it, or be refused in a moved directory)
            self._last_policy_step = int(self.engine.global_steps)
        return result

    def _load(self, load_dir, tag, kwargs) -> Tuple[Any, Any]:
        if not self._is_own_dir(load_dir):  # e.g. a pretrained checkpoint: DeepSpeed's own load, no tiers
            return self._native_load(os.fspath(load_dir), None if tag is None else str(tag), kwargs)
        try:
            if tag is not None:
                tag = validate_dirname(str(tag))  # a tag of this directory: never a path out of it
                if not os.path.isdir(os.path.join(self.checkpoint_dir, tag)):
                    raise CheckpointNotFoundError(f"no tag {tag!r} in {self.checkpoint_dir} (memory snapshots "
                                                  "are loaded with tag=None)")
                if not os.path.exists(os.path.join(self.checkpoint_dir, tag, SIDECAR, "manifest.json")):
                    return self._native_load(self.checkpoint_dir, tag, kwargs)  # DeepSpeed wrote it itself
                result, _ = self._checkpointer.load_with(lambda c: self._load_disk(c, kwargs), dirname=tag,
                                                          check=self._check_candidate)
                return result
            result, _ = self._checkpointer.load_with(lambda c: self._load_candidate(c, kwargs),
                                                      check=self._check_candidate)
            self._warn_missing_tracker_tag()  # once something else was loaded: "instead" is then true
            return result
        except IncompatibleCheckpointError as e:
            raise IncompatibleCheckpointError(f"{e}. {UNIVERSAL_CHECKPOINT_ADVICE}") from e
        except CheckpointNotFoundError:
            if tag is None and os.path.isfile(os.path.join(self.checkpoint_dir, TRACKER)):
                named = self._tracker_tag()
                if not named:
                    raise CheckpointNotFoundError(
                        f"{os.path.join(self.checkpoint_dir, TRACKER)} is empty or unreadable and no snapckpt "
                        f"checkpoint is in {self.checkpoint_dir}, so no tag is known to load: write the tag to "
                        f"load into {TRACKER} (or pass tag=...), or delete {TRACKER} to start from scratch") from None
                if not os.path.isdir(os.path.join(self.checkpoint_dir, named)):
                    raise CheckpointNotFoundError(
                        f"{os.path.join(self.checkpoint_dir, TRACKER)} names tag {named!r}, which is not in "
                        f"{self.checkpoint_dir}, and no other checkpoint is there: restore that tag, or delete "
                        f"{TRACKER} to start from scratch") from None
                log.info("no snapckpt commit in %s; loading the checkpoint DeepSpeed wrote natively",
                         self.checkpoint_dir)
                return self._native_load(self.checkpoint_dir, None, kwargs)
            if tag is not None:
                raise
            log.info("nothing to load in %s yet (no memory snapshot, no committed tag)", self.checkpoint_dir)
            return None, None

    def _tracker_tag(self) -> Optional[str]:
        """The tag ``latest`` names (stripped), or ``None`` when it cannot be read."""
        try:
            with open(os.path.join(self.checkpoint_dir, TRACKER), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def _warn_missing_tracker_tag(self) -> None:
        """Rank 0 warns when ``latest`` is empty or unreadable, or names a tag that is not in the directory
        (edited by hand, truncated, or its tag deleted): snapckpt resumes from the newest intact checkpoint,
        stock DeepSpeed would fail."""
        if self._checkpointer.rank != 0:
            return
        path = os.path.join(self.checkpoint_dir, TRACKER)
        if not os.path.lexists(path):
            return
        if os.path.isdir(path) and not os.path.islink(path):
            log.warning("%s is a directory, not DeepSpeed's tracker file; resuming from the newest intact "
                        "checkpoint in %s instead. Remove it: a DISK save refuses to start while it is there",
                        path, self.checkpoint_dir)
        elif not (named := self._tracker_tag()):
            log.warning("%s is empty or unreadable (stock DeepSpeed could not load from it); resuming from the "
                        "newest intact checkpoint in %s instead (the next commit rewrites it)", path,
                        self.checkpoint_dir)
        elif not os.path.isdir(os.path.join(self.checkpoint_dir, named)):
            log.warning("%s names tag %r, which is not in %s; resuming from the newest intact checkpoint "
                        "instead (the next commit rewrites it)", path, named, self.checkpoint_dir)

    def _check_candidate(self, cand: LoadCandidate) -> None:
        """Before any rank calls DeepSpeed's loader (which runs collectives under ZeRO-3): this rank's files
        are intact (DISK: sizes and checksums) or readable with their sidecar (MEMORY)."""
        if cand.tier == StorageType.DISK:
            cand.verify()
        elif _sidecar_name(self._checkpointer.rank) not in cand.files():
            raise CheckpointNotFoundError("the memory snapshot has no snapckpt sidecar (not a DeepSpeed save)")

    def _load_candidate(self, cand: LoadCandidate, kwargs) -> Tuple[Any, Any]:
        if cand.tier == StorageType.DISK:
            return self._load_disk(cand, kwargs)
        sidecar = _sidecar_name(self._checkpointer.rank)
        side = cand.files()[sidecar]
        files = {k: v for k, v in cand.files().items() if k != sidecar}
        tag = side["tag"]
        scratch = tempfile.mkdtemp(prefix="snapckpt-ds-load-")
        try:
            os.makedirs(os.path.join(scratch, tag))
            for name in files:
                open(os.path.join(scratch, tag, name), "wb").close()  # DeepSpeed globs/stat()s these paths
            self._ckpt_engine._serving = files
            try:
                load_path, client_state = self._engine_load(scratch, tag, kwargs)
            finally:
                self._ckpt_engine._serving = None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if load_path is None:
            raise CheckpointNotFoundError(f"DeepSpeed found no model-states file in the memory snapshot of {tag!r}")
        rng.restore(side["rng"])
        return os.path.join(self.checkpoint_dir, tag, os.path.basename(load_path)), client_state

    def _load_disk(self, cand: LoadCandidate, kwargs) -> Tuple[Any, Any]:
        cand.verify()
        load_path, client_state = self._engine_load(self.checkpoint_dir, cand.dirname, kwargs)
        if load_path is None:
            raise CheckpointNotFoundError(f"DeepSpeed found no model-states file in {cand.path}")
        side = os.path.join(cand.path, _sidecar_name(self._checkpointer.rank))
        if os.path.exists(side):
            rng.restore(_load_sidecar(side)["rng"])
        return load_path, client_state

    def _native_load(self, load_dir: str, tag: Optional[str], kwargs) -> Tuple[Any, Any]:
        """DeepSpeed's own load of a directory snapckpt did not commit (no tiers, no manifest check)."""
        t0 = time.perf_counter()
        load_path, client_state = self._engine_load(load_dir, tag, kwargs)
        if load_path is not None:
            self._checkpointer.last_load = LoadInfo(int(self.engine.global_steps), StorageType.DISK,
                                                    time.perf_counter() - t0)
        return load_path, client_state

    def _engine_load(self, load_dir: str, tag: Optional[str], kwargs) -> Tuple[Any, Any]:
        try:
            return type(self.engine).load_checkpoint(self.engine, load_dir, tag=tag, **kwargs)
        except Exception as e:
            if "world size" in str(e) and "not currently supported" in str(e):
                raise IncompatibleCheckpointError(f"{e} {UNIVERSAL_CHECKPOINT_ADVICE}") from e
            raise

    # -------------------------------------------------------------------------------- policy, close
    def attach(self, memory_interval_steps: Optional[int], disk_interval_steps: Optional[int],
               bind_engine_methods: bool = True) -> None:
        """Take snapshots by policy at step boundaries and route ``engine.save_checkpoint`` /
        ``engine.load_checkpoint`` through this checkpointer (what the config entry does).

        The policy runs in a forward pre-hook of the engine (the first forward after the optimizer step
        that completed step ``N``, before DeepSpeed gathers any ZeRO-3 parameter): at ``N % disk == 0`` a
        DISK save, else at ``N % memory == 0`` a MEMORY save, of tag ``global_step<N>``. Step 0 is never
        saved by policy; the last step of a run is saved by :meth:`close` when the disk policy asks for it
        (no forward follows it; a memory snapshot then would be dropped with the persister). Nor is the
        step a :meth:`load_checkpoint` resumed at: after a resume at step ``N`` the first policy save is
        at the first interval after ``N``.
        """
        self._policy = (memory_interval_steps, disk_interval_steps)
        self._last_policy_step = int(self.engine.global_steps)
        self._hook = self.engine.register_forward_pre_hook(self._on_forward)
        if bind_engine_methods:
            self.engine.load_checkpoint = self.load_checkpoint  # instance attribute; removed by close()

    def _on_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._policy_tick()

    def _policy_tick(self, disk_only: bool = False) -> None:
        step = int(self.engine.global_steps)
        if self._policy is None or step == self._last_policy_step or step == 0:
            return
        self._last_policy_step = step
        mem, disk = self._policy
        if disk and step % disk == 0:
            self.save_checkpoint(self.checkpoint_dir, tag=f"global_step{step}", storage_type=StorageType.DISK)
        elif mem and step % mem == 0 and not disk_only:
            self.save_checkpoint(self.checkpoint_dir, tag=f"global_step{step}", storage_type=StorageType.MEMORY)

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
            if self._hook is not None:
                self._hook.remove()
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


_RESERVED_TAGS = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")


def _load_sidecar(path: str) -> Dict[str, Any]:
    """Load snapckpt's own sidecar ``{"tag", "rng"}`` with ``weights_only=True`` whatever the trust option:
    it holds only tensors, ints, floats and strings (:mod:`snapckpt.rng`), so a pickle planted there is never
    run.

    Raises:
        UnsafeCheckpointError: the file holds other objects (names the file).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{path} is snapckpt's RNG sidecar but holds objects other than tensors and "
                                    f"plain values, which are never unpickled: the file was replaced ({e})") from e


def _check_tag(tag: str) -> None:
    """A tag DeepSpeed can load back: one path component (``validate_dirname``), none of ``*?[`` (DeepSpeed's
    loader finds a tag's files with ``glob``), no leading or trailing whitespace (DeepSpeed strips what it
    reads from ``latest``), and not a name DeepSpeed uses in the save directory itself.

    Raises:
        ValueError: naming the problem.
    """
    validate_dirname(tag)
    bad = sorted(set(tag) & set("*?["))
    if bad:
        raise ValueError(f"DeepSpeed tag {tag!r} contains {bad}: DeepSpeed's load_checkpoint finds a tag's files "
                         "with glob, which treats these as patterns, so the checkpoint could not be loaded; "
                         "choose a tag without them")
    if tag != tag.strip():
        raise ValueError(f"DeepSpeed tag {tag!r} starts or ends with whitespace, which DeepSpeed strips when it "
                         "reads `latest`; choose a tag without it")
    if tag in _RESERVED_TAGS:
        raise ValueError(f"DeepSpeed tag {tag!r} is the name of a file DeepSpeed keeps in the checkpoint directory "
                         f"({', '.join(_RESERVED_TAGS)}); choose another tag")


def _check_engine(engine) -> None:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        raise NotImplementedError("snapckpt does not support DeepSpeed's PipelineEngine yet (it writes per-layer "
                                  "files itself); use engine.save_checkpoint with the stock checkpoint engine")
    if getattr(engine, "has_moe_layers", False):
        raise NotImplementedError("snapckpt does not support DeepSpeed MoE checkpoints yet (expert files)")
    if engine.zero_nvme_offload_optimizer():
        raise NotImplementedError("snapckpt does not support ZeRO-Infinity NVMe optimizer offload (its swap files "
                                  "are copied outside the checkpoint engine)")


# ------------------------------------------------------------------------------------ config entry
@dataclass(frozen=True)
class DeepSpeedSnapckptConfig:
    """The ``"snapckpt"`` section of a DeepSpeed config.

    Attributes:
        enabled: attach snapckpt (``false`` leaves the engine untouched).
        checkpoint_dir: where DISK saves go (DeepSpeed's ``save_dir``); required when enabled.
        memory_interval_steps: MEMORY snapshot every N optimizer steps (``None``: none).
        disk_interval_steps: DISK save every N optimizer steps (``None``: only explicit saves).
        keep_last: retention: keep the N most recently saved tags (``None``: all).
        options: further :class:`snapckpt.CheckpointOptions` fields (``shm_dir``, timeouts...).
    """

    enabled: bool = True
    checkpoint_dir: Optional[str] = None
    memory_interval_steps: Optional[int] = None
    disk_interval_steps: Optional[int] = None
    keep_last: Optional[int] = None
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
        if cfg.options is not None:
            if not isinstance(cfg.options, Mapping):
                raise ValueError('"snapckpt.options" must be an object of snapckpt CheckpointOptions fields')
            for key in ("checkpoint_dir", "keep_last"):
                if key in cfg.options:
                    raise ValueError(f'"snapckpt.options.{key}" is not an option: set "snapckpt.{key}" instead')
            try:
                CheckpointOptions.from_kwargs(**cfg.options)
            except (TypeError, ValueError) as e:
                raise ValueError(f'"snapckpt.options": {e}') from e
        return cfg


def _split_config(config) -> Tuple[Any, Optional[DeepSpeedSnapckptConfig]]:
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
        ck = DeepSpeedCheckpointer(engine, section.checkpoint_dir, **options)
        ck.attach(section.memory_interval_steps, section.disk_interval_steps)
        engine.snapckpt = ck
        log.info("snapckpt attached to the DeepSpeed engine: %s (memory every %s steps, disk every %s)",
                 ck.checkpoint_dir, section.memory_interval_steps, section.disk_interval_steps)
    elif section is not None:
        log.info('snapckpt is disabled by the config ("snapckpt": {"enabled": false})')
    return out
