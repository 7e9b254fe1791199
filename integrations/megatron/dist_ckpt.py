"""Megatron: ``save_checkpoint`` / ``load_checkpoint`` in Megatron's ``torch_dist`` layout through snapckpt.

Public face: :mod:`snapckpt.megatron_dist_ckpt` (the drop-in functions) and :mod:`snapckpt.megatron` (the
``--snapckpt`` flag). Layout (Megatron-LM's, unchanged)::

    <save>/iter_0000100/__{rank}_{n}.distcp, .metadata, common.pt, metadata.json   (+ .snapckpt/manifest.json)
    <save>/latest_checkpointed_iteration.txt        written by the committer after the commit: "100"

A save (collective, every rank):

1. the state dict Megatron-LM builds (``generate_state_dict``: ``model`` / ``model{i}``, ``optimizer``,
   ``opt_param_scheduler``, ``rng_state`` as a ``ShardedObject``, ``iteration``,
   ``num_floating_point_operations_so_far``, ``checkpoint_version``, ``args`` when known), from the
   model's and optimizer's own ``sharded_state_dict()``;
2. megatron-core's ``save_preprocess`` (factories, common part, sharding validation) and, for DISK, its
   DCP planning with :class:`~snapckpt.integrations.megatron.torch_dist.ArenaDistcpWriter`: the ``.distcp``
   files become ``Concat`` specs, rank 0 adds ``.metadata``, ``common.pt`` and ``metadata.json``;
3. a ``MemoryOnly`` record ``snapckpt_memory.pt`` lets every rank reload its own shards from memory
   (the tensors it wrote itself are read back from its ``.distcp`` bytes; the replicas it did not write,
   its sharded objects and the common state are kept in the record);
4. ``Checkpointer.save_files``: the copy into the arena; the persister writes and commits.

A MEMORY save (``storage_type=MEMORY`` or ``non_persistent_ckpt=True``) skips the DCP planning (no
collective): the snapshot is the record of step 3 with every tensor.

A load agrees on the newest step with every rank (``Checkpointer.load_with``): from memory the record is
mapped back onto a fresh sharded state dict (same parallel layout only; any mismatch falls back to disk);
from disk through stock ``megatron.core.dist_checkpointing.load``, which reshards (e.g. DP=2 to TP=2).
snapckpt's directories of another world size are loaded the same way, newest intact first, once every
saving rank's files passed their checksums (megatron-core reads any rank's files and checks nothing). A
directory megatron-core wrote natively (no ``.snapckpt`` sidecar at all: a sidecar without its manifest
is snapckpt's, damaged) is loaded through ``latest_checkpointed_iteration.txt`` and the stock loader; a
tracker naming a directory that does not exist is ignored with a warning.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from snapckpt import Checkpointer, StorageType
from snapckpt import LoadInfo, check_step
from snapckpt.errors import (CheckpointCorruptError, CheckpointNotFoundError, IncompatibleCheckpointError,
                             all_damaged_error)
from snapckpt.formats import Concat, MemoryOnly, RawBytes, TorchSave
from snapckpt.ondisk.manifest import SIDECAR, list_committed

from snapckpt.integrations.megatron.torch_dist import ArenaDistcpWriter
from snapckpt.integrations.megatron.memory import MEMORY_FILE, from_memory, memory_record
from snapckpt.integrations.megatron.state import (CONTENT_METADATA_KEY, apply_state, arg, build_state_dict, megatron_lm_args,
                             megatron_lm_sharded_sd_metadata, restore_counters, restore_rng, same_tp_pp)

__all__ = ["save_checkpoint", "load_checkpoint", "get_checkpointer", "checkpoint_dirname", "TRACKER",
           "MEMORY_FILE", "close_all", "fence"]

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
_checkpointers: Dict[str, Checkpointer] = {}


def checkpoint_dirname(iteration: int, release: bool = False) -> str:
    """Megatron-LM's directory name of an iteration: ``iter_%07d`` (``release`` for a release)."""
    return "release" if release else f"iter_{iteration:07d}"


def get_checkpointer(checkpoint_dir: str, **options: Any) -> Checkpointer:
    """The process's :class:`~snapckpt.Checkpointer` of ``checkpoint_dir`` (created on first use; collective).

    ``weights_only`` defaults to False: Megatron checkpoints hold ``argparse.Namespace`` args, numpy RNG
    states and pickled sharded objects, and megatron-core itself loads them with ``weights_only=False``;
    only load directories you trust.
    """
    key = os.path.abspath(checkpoint_dir)
    ck = _checkpointers.get(key)
    if ck is None or ck.closed:
        options.setdefault("weights_only", False)
        ck = _checkpointers[key] = Checkpointer(key, **options)
    return ck


def fence() -> None:
    """Wait for the in-flight snapshot copies of every Checkpointer of this module: call it before
    ``optimizer.step()`` when the Checkpointer runs with ``overlap=True`` (a no-op otherwise)."""
    for ck in list(_checkpointers.values()):
        if not ck.closed:
            ck.fence()


def close_all() -> None:
    """Wait for outstanding commits and close every Checkpointer this module opened."""
    while _checkpointers:
        _, ck = _checkpointers.popitem()
        ck.close()


class _PlanCache:
    """megatron-core's cached save structure (``--ckpt-assume-constant-structure``): the local and central
    DCP plans and the coordinator's global metadata of the previous save, reused once two saves planned the
    same (the logic of ``TorchDistSaveShardedStrategy.async_save`` with ``cached_metadata=True``)."""

    def __init__(self) -> None:
        self.central: Any = None
        self.local: Any = None
        self.validated = False
        self.metadata: Any = None
        self.sharding_validated = False


_plan_caches: Dict[str, _PlanCache] = {}


def _step_files(sharded_sd: Dict[str, Any], path: str, storage_type: StorageType, rank: int,
                validate: bool, preprocess_common_fn: Optional[Callable], thread_count: int,
                cache: Optional[_PlanCache] = None) -> Dict[str, Any]:
    """This rank's files of one save (see the module docstring, steps 2-3). With ``cache`` (constant
    structure assumed) the sharding is validated once and the DCP plans are reused."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize, save_state_dict_async_plan)
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    memory = storage_type == StorageType.MEMORY
    validate = validate and not memory and not (cache is not None and cache.sharding_validated)
    sharded, common = save_preprocess(sharded_sd, validate, None if memory else preprocess_common_fn)
    if cache is not None and validate:
        cache.sharding_validated = True
    if memory:
        return {MEMORY_FILE: MemoryOnly(memory_record(sharded, common, {}))}  # never flushed to disk
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)
    pyt_sd = mcore_to_pyt_state_dict(flat, False)
    writer = ArenaDistcpWriter(path, thread_count=thread_count)
    cached = None if cache is None else (cache.central, cache.local, cache.validated)
    planned = save_state_dict_async_plan(
        pyt_sd, writer, None, 0, planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        cached_ckpt_structure=cached)
    ret = planned[0]
    if cache is not None:
        _, cache.central, cache.local, cache.validated, _ = planned
        if cache.validated:
            if ret[1] is not None:
                cache.metadata = ret[1]
            elif rank == 0:
                ret = (ret[0], cache.metadata, ret[2])
    save_state_dict_async_finalize(*ret)
    files: Dict[str, Any] = {name: Concat(parts) for name, parts in writer.files.items()}
    written = {(idx.fqn, tuple(idx.offset)): loc for idx, loc in writer.item_locations.items()
               if idx.offset is not None}
    files[MEMORY_FILE] = MemoryOnly(memory_record(sharded, common, written))
    if rank == 0:
        files[".metadata"] = RawBytes(writer.metadata_bytes)
        files["common.pt"] = TorchSave(common)
        files["metadata.json"] = RawBytes(json.dumps(asdict(CheckpointingConfig("torch_dist", 1))).encode())
    return files


# ------------------------------------------------------------------------------------------ save
def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: int, checkpointing_context: Optional[dict] = None,
                    pipeline_rank: Optional[int] = None, expert_rank: Optional[int] = None,
                    tensor_rank: Optional[int] = None, pipeline_parallel: Optional[bool] = None,
                    expert_parallel: Optional[bool] = None, non_persistent_ckpt: bool = False,
                    train_data_iterator: Any = None, preprocess_common_state_dict_fn: Optional[Callable] = None,
                    release: bool = False, *, save_dir: Optional[str] = None,
                    storage_type: StorageType = StorageType.DISK, args: Any = None,
                    validate_access_integrity: bool = True, thread_count: int = 2,
                    assume_constant_structure: Optional[bool] = None,
                    sharded_sd_metadata: Optional[Dict[str, Any]] = None, **checkpointer_options: Any):
    """Megatron-LM's ``save_checkpoint`` (torch_dist format) through snapckpt; collective.

    Args (Megatron-LM's, same order):
        iteration: training iteration, an ``int`` in ``[0, 2**63 - 1]``; names ``iter_%07d`` and is the snapckpt step.
        model: the model chunks (a list, as Megatron-LM passes it) or one module; DDP/Float16 wrappers are
            unwrapped; each chunk provides ``sharded_state_dict()``.
        optimizer: a megatron-core ``MegatronOptimizer`` (``sharded_state_dict``), a plain ``torch.optim``
            optimizer, or None.
        opt_param_scheduler: anything with ``state_dict()``, or None.
        num_floating_point_operations_so_far: returned again by ``load_checkpoint``.
        checkpointing_context: a dict kept across calls (the Checkpointer is cached in it), or None.
        pipeline_rank, expert_rank, tensor_rank, pipeline_parallel, expert_parallel, train_data_iterator:
            accepted for signature compatibility; the torch_dist format does not use them.
        non_persistent_ckpt: Megatron-LM's non-persistent checkpoint: taken to the MEMORY tier.
        preprocess_common_state_dict_fn: passed to megatron-core's common-state consistency check.
        release: save as ``release`` (tracker content ``release``).
    Keyword-only (snapckpt):
        save_dir: checkpoint directory when Megatron-LM's ``args.save`` is not available.
        storage_type: ``StorageType.DISK`` (default: written and committed in the background) or ``MEMORY``.
        args: Megatron-LM-style args (``save``, ``no_save_optim``, ``no_save_rng``,
            ``data_parallel_random_init``, ``snapckpt_keep_last``); read from ``megatron.training`` when
            importable and not given. Saved into ``common.pt`` as Megatron-LM does.
        validate_access_integrity: megatron-core's sharding validation (a collective) on DISK saves.
        thread_count: ``.distcp`` files per rank (megatron-core's default strategy writes 2).
        assume_constant_structure: Megatron-LM's ``--ckpt-assume-constant-structure`` (default: read from
            ``args``, else False): validate the sharding once and reuse the DCP plans of earlier saves.
        sharded_sd_metadata: Megatron-LM's sharded-state-dict metadata (default: built by Megatron-LM from
            ``args`` when it is importable, else None: megatron-core's defaults); saved as the checkpoint's
            ``content_metadata``.
        **checkpointer_options: options for the Checkpointer created on first use (``keep_last``...);
            other keywords (arguments of other Megatron-LM versions, e.g. ``ft_client``) are ignored.

    Returns:
        the :class:`~snapckpt.engine.handle.SaveHandle` (Megatron-LM's returns None): ``wait()`` blocks until
        committed (DISK) or held (MEMORY).

    Raises:
        ValueError: no directory (neither ``args.save`` nor ``save_dir``), or a bad iteration.
        snapckpt errors of :meth:`Checkpointer.save`.
    """
    args = args if args is not None else megatron_lm_args()
    save_dir = save_dir or arg(args, "save", None)
    if not save_dir:
        raise ValueError("save_checkpoint needs a directory: pass save_dir=... (Megatron-LM's args.save is not "
                         "available)")
    check_step(iteration, "iteration")
    storage_type = StorageType.MEMORY if non_persistent_ckpt else StorageType(storage_type)
    keep_last = arg(args, "snapckpt_keep_last", None)
    if keep_last is not None:
        checkpointer_options.setdefault("keep_last", keep_last)
    ck = _context_checkpointer(checkpointing_context, save_dir, _split_options(checkpointer_options, "save"))
    if sharded_sd_metadata is None and args is not None:
        sharded_sd_metadata = megatron_lm_sharded_sd_metadata(args)
    sd = build_state_dict(args, model, optimizer, opt_param_scheduler, iteration,
                          num_floating_point_operations_so_far, is_loading=False,
                          with_optimizer=not arg(args, "no_save_optim", False),
                          with_rng=not arg(args, "no_save_rng", False), metadata=sharded_sd_metadata)
    dirname = checkpoint_dirname(iteration, release)
    if assume_constant_structure is None:
        assume_constant_structure = bool(arg(args, "ckpt_assume_constant_structure", False))
    cache = _plan_caches.setdefault(ck.checkpoint_dir, _PlanCache()) if assume_constant_structure else None
    files = _step_files(sd, os.path.join(ck.checkpoint_dir, dirname), storage_type, ck.rank,
                        validate_access_integrity, preprocess_common_state_dict_fn, thread_count, cache)
    return ck.save_files(files, iteration, storage_type, dirname=dirname, tracker_name=TRACKER,
                          tracker_content="release" if release else str(iteration))


def _split_options(kwargs: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Checkpointer options out of ``kwargs``; other keywords are Megatron-LM arguments of other versions
    (``ft_client``...), which the torch_dist path does not use: logged and ignored."""
    import dataclasses

    from snapckpt.options import CheckpointOptions

    names = {f.name for f in dataclasses.fields(CheckpointOptions)}
    ignored = sorted(k for k in kwargs if k not in names)
    if ignored:
        log.debug("%s: ignoring Megatron-LM arguments %s", where, ignored)
    return {k: v for k, v in kwargs.items() if k in names}


def _context_checkpointer(context: Optional[dict], directory: str, options: Dict[str, Any]) -> Checkpointer:
    if context is not None:
        ck = context.get("snapckpt")
        if ck is not None and not ck.closed and ck.checkpoint_dir == os.path.abspath(directory):
            return ck
    ck = get_checkpointer(directory, **options)
    if context is not None:
        context["snapckpt"] = ck
    return ck


# ------------------------------------------------------------------------------------------ load
def _agree(ck: Checkpointer, name: str, error: Optional[BaseException]) -> None:
    """All ranks learn whether any rank failed before a collective load starts (so none is left in it)."""
    bad = ck.coordinator.agree(name, error)
    if bad:
        if error is not None:
            raise error
        raise CheckpointCorruptError(f"ranks {sorted(bad)} cannot read this checkpoint: {bad}")


def _read_tracker(directory: str) -> Dict[str, Any]:
    """What ``latest_checkpointed_iteration.txt`` names: ``{"dirname", "iteration" (-1 for a release),
    "native"}``; ``dirname`` None if there is no tracker.

    ``native`` is True when megatron-core wrote the directory itself: it has neither a snapckpt manifest
    nor a ``.snapckpt`` sidecar (a sidecar without its manifest is snapckpt's, damaged: never native). A
    tracker naming a directory that does not exist is ignored with a warning naming it; the newest native
    directory found (``iter_*`` with megatron-core's ``.metadata`` and ``metadata.json``, no sidecar) is
    named instead, if any (``"ignored"`` then holds the warning).
    """
    path = os.path.join(directory, TRACKER)
    try:
        with open(path) as f:
            content = f.read().strip()
    except FileNotFoundError:
        return {"dirname": None, "iteration": -1, "native": False}
    if content != "release" and not content.isdigit():
        raise CheckpointCorruptError(f"{path} holds {content!r}, not an iteration; fix or delete it")
    dirname = checkpoint_dirname(int(content), release=content == "release")
    if not os.path.isdir(os.path.join(directory, dirname)):
        natives = sorted((int(n[5:]), n) for n in os.listdir(directory)
                         if _ITER_DIR.fullmatch(n) and _is_native(os.path.join(directory, n)))
        msg = (f"{path} names {dirname}, which does not exist (deleted, or the tracker was edited by hand); "
               "ignoring it: resuming from the newest intact checkpoint there")
        log.warning("%s", msg)
        if not natives:
            return {"dirname": None, "iteration": -1, "native": False, "ignored": msg}
        return {"dirname": natives[-1][1], "iteration": natives[-1][0], "native": True, "ignored": msg}
    native = _is_native(os.path.join(directory, dirname))
    return {"dirname": dirname, "iteration": -1 if content == "release" else int(content), "native": native}


_ITER_DIR = re.compile(r"iter_\d{7,}")


def _is_native(path: str) -> bool:
    """``path`` is a directory megatron-core wrote itself: no snapckpt sidecar (with or without its manifest),
    and megatron-core's own files present."""
    return (not os.path.exists(os.path.join(path, SIDECAR))
            and all(os.path.exists(os.path.join(path, n)) for n in (".metadata", "metadata.json")))


def _agreed_tracker(ck: Checkpointer) -> Dict[str, Any]:
    """Rank 0's reading of the tracker, given to every rank (collective; ranks never disagree about it)."""
    mine: Dict[str, Any] = {}
    if ck.rank == 0:
        try:
            mine = _read_tracker(ck.checkpoint_dir)
        except CheckpointCorruptError as e:
            mine = {"error": str(e)}
    theirs = ck.coordinator.gather("megatron-tracker", mine)[0]
    if "error" in theirs:
        raise CheckpointCorruptError(theirs["error"])
    return theirs


def _other_world_sizes(ck: Checkpointer) -> Dict[str, Any]:
    """Collective: snapckpt's committed directories saved by another number of ranks, newest first
    (``"dirs"``: ``[step, dirname, world_size]``; files present with their sizes, checksums not read yet),
    and its directories skipped as damaged (``"damaged"``: one line each; a ``.snapckpt`` sidecar marks
    them, megatron-core's own directories are not listed), as rank 0 lists them."""
    mine: Dict[str, Any] = {}
    if ck.rank == 0:
        problems: List[str] = []
        dirs = [[c.step, c.dirname, c.manifest["world_size"]]
                for c in list_committed(ck.storage, ck.checkpoint_dir, problems=problems)
                if c.manifest["world_size"] != ck.world_size]
        mine = {"dirs": sorted(dirs, reverse=True), "damaged": problems}
    return ck.coordinator.gather("megatron-other-ws", mine)[0]


def _load_resharded(ck: Checkpointer, fresh: Callable[[Dict[str, Any]], Dict[str, Any]], strictness: str
                    ) -> Optional[Tuple[Dict[str, Any], str]]:
    """Load the newest intact snapckpt directory saved by another number of ranks through megatron-core's
    loader (which reshards); collective. Every rank's files of a directory are verified against its
    manifest's checksums first (the files of saving rank ``r`` by rank ``r % world_size``), because
    megatron-core reads any rank's files and checks nothing. A damaged directory is skipped with a warning
    naming it and the next older one is tried.

    Returns:
        ``(state, source)``, or None when snapckpt has no directory here at all (intact or damaged).

    Raises:
        CheckpointCorruptError: snapckpt's directories exist but none is intact; names each one and why.
    """
    found = _other_world_sizes(ck)
    if not found["dirs"] and not found["damaged"]:
        return None
    t0 = time.perf_counter()
    refused: List[str] = []
    for step, dirname, ws in found["dirs"]:
        path = os.path.join(ck.checkpoint_dir, dirname)
        bad = ck.verify_directory(path, dirname)
        if bad:
            msg = f"iteration {step} ({dirname}, saved by {ws} ranks) is damaged: {bad}"
            log.warning("%s; trying the next older checkpoint", msg)
            refused.append(msg)
            continue
        if refused or found["damaged"]:
            log.warning("loading iteration %d, not the newest: %s", step,
                        " | ".join(refused + [f"{d} (skipped as damaged)" for d in found["damaged"]]))
        state = _stock_load(fresh, path, strictness)
        ck.last_load = LoadInfo(step, StorageType.DISK, time.perf_counter() - t0, tuple(refused))
        return state, f"disk step {step} (saved by {ws} ranks, resharded by megatron-core)"
    raise all_damaged_error(ck.checkpoint_dir, refused, skipped=found["damaged"])


def _newest_snapckpt(ck: Checkpointer) -> Optional[int]:
    """Newest step snapckpt holds here of any world size (None if none, or every one is damaged); collective."""
    try:
        return ck.latest_step()
    except CheckpointCorruptError:  # snapckpt's own are all damaged (logged)
        return None
    except IncompatibleCheckpointError:  # only directories of another world size
        dirs = _other_world_sizes(ck)["dirs"]
        return dirs[0][0] if dirs else None


def load_checkpoint(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, checkpointing_context: Optional[dict] = None,
                    skip_load_to_model_and_opt: bool = False, *, load_dir: Optional[str] = None,
                    args: Any = None, **checkpointer_options: Any) -> Tuple[int, int]:
    """Megatron-LM's ``load_checkpoint`` (torch_dist format) through snapckpt; collective.

    Loads the newest iteration complete on every rank: from memory when every rank holds it and it is at
    least as new as the newest committed directory, else from disk through stock
    ``megatron.core.dist_checkpointing.load`` (which reshards to the current parallel layout). When snapckpt
    has no candidate of this world size, its newest directory of another world size whose files (every
    saving rank's) pass their checksums is loaded that way; damaged ones are named in warnings. The
    directory named by ``latest_checkpointed_iteration.txt`` is loaded with the stock loader instead when
    megatron-core wrote it natively (no ``.snapckpt`` sidecar) and it is newer than anything snapckpt
    holds. A tracker naming a directory that does not exist is ignored with a warning naming it (then the
    newest native ``iter_*`` directory stands for it, if any).

    Args (Megatron-LM's):
        ddp_model: model chunks (list) or one module, as for ``save_checkpoint``.
        optimizer, opt_param_scheduler: restored unless None (or ``args.no_load_optim`` / ``args.finetune``).
        load_arg: name of the args attribute holding the directory (``load``).
        strict: passed to ``model.load_state_dict``.
        checkpointing_context: dict kept across calls, or None.
        skip_load_to_model_and_opt: read the checkpoint but do not load model and optimizer.
    Keyword-only (snapckpt): ``load_dir`` when Megatron-LM's args are not available; ``args`` as for
        ``save_checkpoint``; ``**checkpointer_options`` for the Checkpointer created on first use.

    Returns:
        ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when there is no checkpoint
        (as Megatron-LM). ``Checkpointer.last_load`` tells the tier and iteration (None for a native
        directory).

    Raises:
        ValueError: no directory given. CheckpointCorruptError: every candidate failed on some rank, or
        every directory snapckpt committed is damaged (each named), or the tracker names a directory that
        does not exist and there is no other checkpoint.
    """
    args = args if args is not None else megatron_lm_args()
    load_dir = load_dir or arg(args, load_arg, None)
    if not load_dir:
        raise ValueError(f"load_checkpoint needs a directory: pass load_dir=... (Megatron-LM's args.{load_arg} "
                         "is not available)")
    ck = _context_checkpointer(checkpointing_context, load_dir, _split_options(checkpointer_options, "load"))
    finetune = arg(args, "finetune", False)
    strictness = arg(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    with_opt = not (arg(args, "no_load_optim", False) or finetune)
    with_rng = not (arg(args, "no_load_rng", False) or finetune)

    def fresh(common: Dict[str, Any]) -> Dict[str, Any]:
        rng = with_rng and same_tp_pp(common)
        if with_rng and not rng:
            log.warning("the checkpoint was saved with another (TP, PP) layout: its RNG states are not loaded "
                        "(as Megatron-LM does)")
        return build_state_dict(args, ddp_model, optimizer, opt_param_scheduler, 0, 0, is_loading=True,
                                with_optimizer=with_opt, with_rng=rng, metadata=common.get(CONTENT_METADATA_KEY))

    def from_candidate(cand: Any) -> Dict[str, Any]:
        if cand.tier == StorageType.MEMORY:
            files = cand.files()
            return from_memory(fresh(files.get(MEMORY_FILE, {}).get("common", {})), files)
        err = None
        try:
            cand.verify()
        except CheckpointCorruptError as e:
            err = e
        _agree(ck, "megatron-verify", err)
        return _stock_load(fresh, cand.path, strictness)

    tracker = _agreed_tracker(ck)
    state = None
    e: Optional[Exception] = None
    if tracker["native"] and ((newest := _newest_snapckpt(ck)) is None or tracker["iteration"] > newest):
        source = f"directory {tracker['dirname']} written by megatron-core"
    else:
        try:
            state, cand = ck.load_with(from_candidate)
            source = f"{cand.tier.value} step {cand.step}"
        except (CheckpointNotFoundError, IncompatibleCheckpointError) as missed:
            e = missed  # handled below, outside this block: its traceback would not belong to what follows
        if e is not None:
            # nothing of this world size: snapckpt's directories of another one, verified, then resharded
            try:
                got = _load_resharded(ck, fresh, strictness)
            except CheckpointCorruptError as bad:
                if not tracker["native"]:
                    raise
                log.warning("%s\nloading %s instead, which megatron-core wrote", bad, tracker["dirname"])
                got = None
            if got is not None:
                state, source = got
            elif tracker["dirname"] is None:
                if "ignored" in tracker:
                    raise CheckpointCorruptError(f"{tracker['ignored']}; but there is no other checkpoint in "
                                                 f"{ck.checkpoint_dir}: restore {TRACKER}'s directory, or delete "
                                                 f"{TRACKER} to start afresh")
                log.warning("no checkpoint found in %s (%s); starting from iteration 0", ck.checkpoint_dir, e)
                return 0, 0
            elif not tracker["native"]:
                # the tracker names a directory snapckpt committed, yet it is no candidate: it fails its
                # manifest checks (e names the damage); megatron-core's loader must not read it blindly
                raise e
            else:
                source = f"directory {tracker['dirname']} ({e})"
    if state is None:
        ck.last_load = None
        state = _stock_load(fresh, os.path.join(ck.checkpoint_dir, tracker["dirname"]), strictness)
    log.info("rank %d: loaded iteration %s from %s", ck.rank, state.get("iteration"), source)
    if not skip_load_to_model_and_opt:
        apply_state(state, ddp_model, optimizer, opt_param_scheduler, strict, with_opt)
    if with_rng and "rng_state" in state:
        restore_rng(state["rng_state"], args)
    iteration = 0 if finetune else int(state.get("iteration", 0))
    flops = int(state.get("num_floating_point_operations_so_far", 0))
    if args is not None:
        args.iteration = iteration
        args.num_floating_point_operations_so_far = flops
        if not finetune and state.get("args") is not None:
            restore_counters(args, state["args"])
    return iteration, flops


def _stock_load(fresh: Callable[[Dict[str, Any]], Dict[str, Any]], path: str,
                strictness: str = "assume_ok_unexpected") -> Dict[str, Any]:
    """Stock ``dist_checkpointing.load`` of ``path`` into ``fresh(common state)`` (collective), with
    Megatron-LM's ``--dist-ckpt-strictness``."""
    import argparse

    from megatron.core import dist_checkpointing

    # common.pt holds Megatron-LM's args when they were saved; megatron-core loads it with torch.load's
    # default weights_only=True, so allow the Namespace as Megatron-LM itself does.
    torch.serialization.add_safe_globals([argparse.Namespace])
    common = dist_checkpointing.load_common_state_dict(path)
    state = dist_checkpointing.load(fresh(common), path, strict=strictness)
    return state[0] if isinstance(state, tuple) else state  # strictness modes that also return mismatches
