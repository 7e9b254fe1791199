"""DeepSpeed integration: snapckpt behind DeepSpeed's checkpoint-engine seam, in DeepSpeed's native layout.

Two ways in (docs/index.md):

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
identically (contract 8 (docs/design/contracts.md)).

Trust. DeepSpeed's files hold config objects and optimizer classes, and DeepSpeed itself loads them with
``weights_only=False``; this integration does the same by default (``weights_only=False``): point it only at
checkpoint directories you trust.

Not supported (a clear error at construction): pipeline engines (``PipelineEngine`` writes per-layer files
itself), MoE models, ZeRO-Infinity NVMe offload of the optimizer.

Modules, in data-path order: :mod:`.config` (the ``"snapckpt"`` section, :func:`initialize`),
:mod:`.checkpointer` (the :class:`DeepSpeedCheckpointer` facade and its snapshot policy), :mod:`.engine`
(the framework seam, :class:`SnapckptCheckpointEngine`), :mod:`.save` (the files of one save and their
snapshot), :mod:`.load` (``load_checkpoint`` over the tiers, ``latest``, the native fallback) and
:mod:`.layout` (the names in a DeepSpeed checkpoint directory). :mod:`.capture` serves another framework's
integration (the Hugging Face Trainer's): one ``save_checkpoint`` captured as file specs, to be snapshotted
inside that framework's own folder.
"""
from snapckpt.events import StorageType

# engine first: it imports DeepSpeed and says how to install it when that fails
from snapckpt.integrations.deepspeed.engine import SnapckptCheckpointEngine
from snapckpt.integrations.deepspeed.checkpointer import DeepSpeedCheckpointer
from snapckpt.integrations.deepspeed.config import DeepSpeedSnapckptConfig, initialize
from snapckpt.integrations.deepspeed.load import UNIVERSAL_CHECKPOINT_ADVICE

__all__ = ["DeepSpeedCheckpointer", "SnapckptCheckpointEngine", "DeepSpeedSnapckptConfig", "initialize",
           "StorageType", "UNIVERSAL_CHECKPOINT_ADVICE"]
