"""Checkpoint metrics where Megatron users look: a TensorBoard writer, and Megatron-LM's timers.

Each event of a Checkpointer's rank (:mod:`snapckpt.events`) is mapped through
:func:`snapckpt.metrics.event_metrics` and written as scalars, ``writer.add_scalar(name, value, iteration)``
with ``iteration`` the one saved: ``snapckpt/stall_secs`` and ``snapckpt/bytes`` when the snapshot is
taken, ``snapckpt/durable_secs`` and ``snapckpt/persist_gbps`` when the commit is learnt,
``snapckpt/skipped`` for a skipped snapshot (the names the Trainer and DeepSpeed integrations use).

On the ``--snapckpt`` flag path the writer is Megatron-LM's own (:func:`megatron_lm_writer`, looked up at
each event: ``None`` on every rank but the last, where nothing is written), and the memory snapshots the
``train_step`` wrapper takes are timed with Megatron-LM's timers under :data:`NON_PERSISTENT_TIMER`, the
name its loop gives its own non-persistent saves (:func:`megatron_lm_timed`). Its disk saves (and
``--non-persistent-save-interval`` ones) need nothing here: Megatron-LM's ``save_checkpoint_and_time``
already times the call with ``save-checkpoint`` (``save-checkpoint-non-persistent``).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional, Union

from snapckpt import Checkpointer
from snapckpt.events import Event
from snapckpt.metrics import event_metrics

__all__ = ["report_to", "check_writer", "megatron_lm_writer", "megatron_lm_timed", "NON_PERSISTENT_TIMER"]

#: Megatron-LM's timer of a non-persistent save (its ``save_checkpoint_and_time``); MEMORY snapshots here.
NON_PERSISTENT_TIMER = "save-checkpoint-non-persistent"

Writer = Union[Any, Callable[[], Any]]  # an object with add_scalar(tag, value, global_step), or a getter


class _Report:
    """A Checkpointer listener: the event's metrics to the writer (or to what the getter returns now)."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer

    def __call__(self, event: Event) -> None:
        values = event_metrics(event)
        if not values:
            return
        writer = self.writer() if _is_getter(self.writer) else self.writer
        if writer is None:
            return
        for name, value in values.items():
            writer.add_scalar(name, value, event.step)
        if event.kind == "committed" and hasattr(writer, "flush"):
            writer.flush()  # the last commits are learnt at close, after Megatron-LM's final flush


_reports: "weakref.WeakKeyDictionary[Checkpointer, _Report]" = weakref.WeakKeyDictionary()


def _is_getter(writer: Writer) -> bool:
    return callable(writer) and not hasattr(writer, "add_scalar")


def check_writer(writer: Writer, where: str) -> None:
    """Refuse what cannot be a writer, before a save touches anything.

    Args:
        writer: ``None``, a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar(tag,
            value, global_step)``), or a function of no argument returning one or ``None``.
        where: the argument's name, for the message.

    Raises:
        TypeError: anything else; the message names the type and what is accepted.
    """
    if writer is not None and not hasattr(writer, "add_scalar") and not callable(writer):
        raise TypeError(f"{where} must be a TensorBoard SummaryWriter (anything with add_scalar(tag, value, "
                        f"global_step)), a function returning one or None, or None; got {type(writer).__name__}")


def report_to(checkpointer: Checkpointer, writer: Writer) -> None:
    """Write every later event's metrics of ``checkpointer`` to ``writer`` (see the module docstring).

    One listener per Checkpointer: a second call replaces its writer. Values are this rank's.

    Args:
        checkpointer: the Checkpointer whose events are reported.
        writer: a ``SummaryWriter`` (anything with ``add_scalar(tag, value, global_step)``), or a function of
            no argument returning one or ``None``, called at each event (``None``: nothing written then).

    Raises:
        TypeError: ``writer`` is neither (:func:`check_writer`).
    """
    check_writer(writer, "writer")
    report = _reports.get(checkpointer)
    if report is None:
        report = _reports[checkpointer] = _Report(writer)
        checkpointer.add_listener(report)
    else:
        report.writer = writer


def megatron_lm_writer() -> Optional[Any]:
    """Megatron-LM's TensorBoard writer (``megatron.training.global_vars.get_tensorboard_writer()``): a
    ``SummaryWriter`` on the last rank with ``--tensorboard-dir``, else (or without Megatron-LM) ``None``."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer  # type: ignore[import-not-found]
    except ImportError:
        return None
    return get_tensorboard_writer()


def _megatron_lm_timers() -> Optional[Any]:
    """Megatron-LM's ``Timers`` (a ``megatron.core.timers.Timers``), or ``None`` before it is initialized
    (its ``get_timers`` asserts then) or without Megatron-LM."""
    try:
        from megatron.training.global_vars import get_timers  # type: ignore[import-not-found]

        return get_timers()
    except (ImportError, AssertionError):
        return None


@contextlib.contextmanager
def megatron_lm_timed(name: str) -> Iterator[None]:
    """Time the block with Megatron-LM's timer ``name`` (log level 0), then log it as Megatron-LM's
    ``save_checkpoint_and_time`` does: ``timers.log([name])``, min and max across ranks on the last rank's
    log. That log is a collective, so every rank must run the block; it is skipped when the block raises.
    Without Megatron-LM's timers the block just runs."""
    timers = _megatron_lm_timers()
    if timers is None:
        yield
        return
    timers(name, log_level=0).start(barrier=False)
    try:
        yield
    finally:
        timers(name).stop(barrier=False)
    timers.log([name])
