"""HookRegistry: step-boundary events, the snapshot policy and user callbacks.

Integrations (and hand-written loops) call three methods and nothing else::

    hooks.before_optimizer_step()   # fence: the snapshot copy must be done before weights change
    optimizer.step()
    hooks.step_end(step)            # the policy decides: memory snapshot, disk snapshot, or nothing
    ...
    hooks.train_end()               # wait for every commit

Callbacks registered with :meth:`HookRegistry.on` receive :class:`~snapckpt.events.Event` records of one kind of
:data:`~snapckpt.events.EVENT_KINDS` (the remote and peer tiers' too: ``upload_failed``, ``replica_lagging``...).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from snapckpt.events import EVENT_KINDS, Event, StorageType

__all__ = ["SnapshotPolicy", "HookRegistry"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotPolicy:
    """When to snapshot. A step that is due for both tiers gets one DISK save (it is in memory too).

    Attributes:
        memory_interval_steps: memory snapshot every N steps (``None``: never by steps).
        disk_interval_steps: disk snapshot every M steps (``None``: never by steps).
        memory_interval_secs: memory snapshot when this many seconds passed since the last snapshot.
        disk_interval_secs: disk snapshot when this many seconds passed since the last disk save.
        save_on_train_end: a final DISK save at :meth:`HookRegistry.train_end` if the last step is not on disk.

    With a time-based interval and several ranks, :class:`HookRegistry` follows rank 0's clock: rank 0
    decides at every step and broadcasts the decision through the coordinator (one store round per step,
    rank 0 never waits for it), so that every rank snapshots the same steps.
    """

    memory_interval_steps: Optional[int] = None
    disk_interval_steps: Optional[int] = None
    memory_interval_secs: Optional[float] = None
    disk_interval_secs: Optional[float] = None
    save_on_train_end: bool = False

    def __post_init__(self) -> None:
        for name in ("memory_interval_steps", "disk_interval_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        for name in ("memory_interval_secs", "disk_interval_secs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {v!r}")

    @property
    def saves(self) -> bool:
        """Whether this policy ever snapshots (an interval or ``save_on_train_end`` set)."""
        return bool(self.memory_interval_steps or self.disk_interval_steps or self.memory_interval_secs
                    or self.disk_interval_secs or self.save_on_train_end)

    def decide(self, step: int, secs_since_snapshot: float, secs_since_disk: float) -> Optional[StorageType]:
        """The tier due at ``step`` (``None``: nothing due)."""
        if (self.disk_interval_steps and step % self.disk_interval_steps == 0) or (
                self.disk_interval_secs and secs_since_disk >= self.disk_interval_secs):
            return StorageType.DISK
        if (self.memory_interval_steps and step % self.memory_interval_steps == 0) or (
                self.memory_interval_secs and secs_since_snapshot >= self.memory_interval_secs):
            return StorageType.MEMORY
        return None


class HookRegistry:
    """Drives a :class:`~snapckpt.Checkpointer` from step-boundary events.

    Args:
        checkpointer: the Checkpointer to save with.
        state_fn: returns the state to save (called only when a snapshot is due).
        policy: a :class:`SnapshotPolicy`.
    """

    def __init__(self, checkpointer, state_fn: Callable[[], Any], policy: SnapshotPolicy) -> None:
        self.checkpointer = checkpointer
        self.state_fn = state_fn
        self.policy = policy
        self._callbacks: Dict[str, List[Callable[[Event], None]]] = {k: [] for k in EVENT_KINDS}
        now = time.monotonic()
        self._last_snapshot = now
        self._last_disk = now
        self._last_step: Optional[int] = None
        self._last_disk_step: Optional[int] = None
        self._last_disk_handle = None  # the handle of that DISK save
        checkpointer.add_listener(self._dispatch)
        timed = policy.memory_interval_secs is not None or policy.disk_interval_secs is not None
        # one store round per step, only with a time-based interval and several ranks
        self._shared_clock = timed and checkpointer.coordinator.world_size > 1

    def on(self, kind: str, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Register ``callback(event)`` for ``kind`` (one of :data:`~snapckpt.events.EVENT_KINDS`); return a function
        that removes it.

        Raises:
            ValueError: ``kind`` is not an event kind (the message lists them).
        """
        if kind not in self._callbacks:
            raise ValueError(f"unknown event {kind!r}; one of {EVENT_KINDS}")
        self._callbacks[kind].append(callback)
        return lambda: self._callbacks[kind].remove(callback)

    def _dispatch(self, event: Event) -> None:
        for cb in list(self._callbacks.get(event.kind, ())):
            cb(event)

    def before_optimizer_step(self) -> None:
        """Call right before ``optimizer.step()``: waits for an in-flight snapshot copy."""
        self.checkpointer.fence()

    def step_end(self, step: int) -> None:
        """Call after step ``step`` completed: snapshots if the policy says so, and reports commits of
        earlier saves (their ``committed``/``failed`` events fire here, on the training thread). ``state_fn`` is
        called for a snapshot, and once more at the first call when that one does not snapshot and the policy
        ever does: the arena is then reserved for its size (:meth:`Checkpointer.expect`)."""
        now = time.monotonic()
        tier = self.policy.decide(step, now - self._last_snapshot, now - self._last_disk)
        if self._shared_clock:
            # a time-based decision is rank 0's, so that every rank saves the same steps (ranks start
            # and run on clocks that differ by more than a step)
            decided = self.checkpointer.coordinator.broadcast("policy", tier.name if tier else None)
            tier = StorageType[decided] if decided else None
        if self._last_step is None and tier is None and self.policy.saves:
            # the first step made the optimizer's state: reserve the arena for it, so that the first save does
            # not allocate its shared memory on the training thread (Checkpointer.expect; a step that saves
            # sizes its slot itself)
            self.checkpointer.expect(self.state_fn())
        self._last_step = step
        if tier is None:
            self.checkpointer.poll()  # (save polls by itself)
            return
        handle = self.checkpointer.save(self.state_fn(), step, storage_type=tier)
        if handle.snapshot_taken:
            self._last_snapshot = now
            if tier == StorageType.DISK:
                self._last_disk = now
                self._last_disk_step = step
                self._last_disk_handle = handle

    def train_end(self) -> None:
        """Call once after the last step: optional final DISK save, then wait for every commit.

        The earlier commits are waited for before that save: a slot still being written would otherwise make it
        wait for the persister anyway, with a ``slot_wait`` warning that reads as a misconfigured interval. They
        are waited for before the decision too: a DISK save of the last step that another rank skipped
        (``on_slot_busy="skip"``) reads skipped on this rank only once it ended, and every rank must decide alike
        (a final save by the skipping rank alone waited for the others' parts until the commit timeout)."""
        if self.policy.save_on_train_end and self._last_step is not None:
            self.checkpointer.wait()
            if self._last_disk_step == self._last_step and not getattr(self._last_disk_handle, "skipped", False):
                return  # the last step is on disk (and every earlier save was waited for)
            self.checkpointer.save(self.state_fn(), self._last_step, storage_type=StorageType.DISK)
        self.checkpointer.wait()
