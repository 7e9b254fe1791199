"""The Checkpointers of this process, one per Megatron checkpoint directory.

Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` are plain functions called again at every save,
so the :class:`~snapckpt.Checkpointer` (and with it the arena and the persister connection) lives here
between calls: created on the first call for a directory (:func:`get_checkpointer`), found again through
Megatron-LM's ``checkpointing_context`` or this registry, fenced by :func:`fence` before an optimizer step,
polled by :func:`poll` once per iteration and closed by :func:`close_all` at the end of the job. Sits at
the start of the data path: every save and load of :mod:`~snapckpt.integrations.megatron.save` and
:mod:`~snapckpt.integrations.megatron.load` gets its Checkpointer from here.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any, Dict, Optional

from snapckpt import Checkpointer, CheckpointOptions
from snapckpt.storage.factory import check_location

__all__ = ["get_checkpointer", "fence", "poll", "close_all", "context_checkpointer", "split_options"]

log = logging.getLogger(__name__)

_checkpointers: Dict[str, Checkpointer] = {}


def get_checkpointer(checkpoint_dir: str, **options: Any) -> Checkpointer:
    """The process's :class:`~snapckpt.Checkpointer` of ``checkpoint_dir`` (created on first use; collective).

    ``weights_only`` defaults to False: Megatron checkpoints hold ``argparse.Namespace`` args, numpy RNG
    states and pickled sharded objects, and megatron-core itself loads them with ``weights_only=False``;
    only load directories you trust.

    Args:
        checkpoint_dir: the checkpoint directory (Megatron-LM's ``--save`` / ``--load``).
        **options: :class:`~snapckpt.CheckpointOptions` fields, used only when the Checkpointer is created.
    """
    key = os.path.abspath(check_location(checkpoint_dir))  # a URL is refused before abspath hides it
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


def poll() -> None:
    """Learn of the commits every Checkpointer of this module finished, without waiting: their ``committed``
    events (``snapckpt/durable_secs``...) fire now, on this thread. Call it once per iteration; otherwise a
    commit is learnt at the next save, and its durable time counts the iterations in between.

    Raises:
        the first background failure not raised yet (:meth:`snapckpt.Checkpointer.poll`).
    """
    for ck in list(_checkpointers.values()):
        if not ck.closed:
            ck.poll()


def close_all(clean: Optional[bool] = None) -> None:
    """Close every Checkpointer this module opened (``clean``: see :meth:`snapckpt.Checkpointer.close`)."""
    while _checkpointers:
        _, ck = _checkpointers.popitem()
        ck.close(clean=clean)


def close_all_at_exit() -> None:
    """The ``atexit`` handler: a program that ended by an uncaught exception (``sys.last_value`` is set
    then) did not end cleanly, so its memory snapshots are kept and flushed (contract 11)."""
    close_all(clean=getattr(sys, "last_value", None) is None)


#: Keywords that Megatron-LM versions other than the one this signature follows pass to ``save_checkpoint``
#: / ``load_checkpoint`` (fault-tolerance client, explicit process groups); the torch_dist path here does
#: not need them, so they are accepted and ignored.
OTHER_VERSION_KEYWORDS = frozenset({"ft_client", "tp_group", "pp_group", "dp_group", "cp_group", "dp_cp_group",
                                    "ep_group", "model_parallel_group", "content_metadata"})


def split_options(kwargs: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Checkpointer options out of ``kwargs``; keywords of other Megatron-LM versions
    (:data:`OTHER_VERSION_KEYWORDS`), which the torch_dist path does not use, are logged and ignored.

    Args:
        kwargs: the extra keywords of a ``save_checkpoint`` / ``load_checkpoint`` call.
        where: ``"save"`` or ``"load"``, for the messages.

    Raises:
        TypeError: any other keyword (a typo of an option, as the replaced function would raise).
    """
    names = {f.name for f in dataclasses.fields(CheckpointOptions)}
    unknown = sorted(k for k in kwargs if k not in names and k not in OTHER_VERSION_KEYWORDS)
    if unknown:
        raise TypeError(f"{where}_checkpoint() got unexpected keyword arguments {unknown}: neither Megatron-LM "
                        f"arguments nor snapckpt options (CheckpointOptions: {sorted(names)})")
    ignored = sorted(k for k in kwargs if k in OTHER_VERSION_KEYWORDS)
    if ignored:
        log.debug("%s: ignoring Megatron-LM arguments %s", where, ignored)
    return {k: v for k, v in kwargs.items() if k in names}


def context_checkpointer(context: Optional[dict], directory: str, options: Dict[str, Any]) -> Checkpointer:
    """The Checkpointer of ``directory``: the one cached in Megatron-LM's ``checkpointing_context`` (key
    ``"snapckpt"``) when it is open and of this directory, else :func:`get_checkpointer`'s, then cached
    there."""
    if context is not None:
        ck = context.get("snapckpt")
        if ck is not None and not ck.closed and ck.checkpoint_dir == os.path.abspath(directory):
            return ck
    ck = get_checkpointer(directory, **options)
    if context is not None:
        context["snapckpt"] = ck
    return ck
