"""Typed records of what happened to each snapshot: events for callbacks, statistics for logs.

"Snapshot taken" (the state is safe in the arena; training may go on) and "committed" (the checkpoint is
durable and the tracker names it) are different events (case B6): only the latter moves the tracker.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["StorageType", "Event", "SaveStats", "EVENT_KINDS"]


class StorageType(str, enum.Enum):
    """Tier of a save: ``MEMORY`` (kept in the node's shared memory) or ``DISK`` (also written and committed)."""

    MEMORY = "memory"
    DISK = "disk"

    def __str__(self) -> str:  # f"{tier}" prints "memory" / "disk"
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> "StorageType":
        raise ValueError(f"storage_type must be StorageType.MEMORY or StorageType.DISK (or the strings 'memory', "
                         f"'disk'), got {value!r}")


@dataclass(frozen=True)
class SaveStats:
    """Costs of one snapshot on the training thread.

    Attributes:
        step: the step saved.
        tier: ``StorageType``.
        tensor_nbytes: bytes of tensor data copied (bytes).
        slot_nbytes: bytes used in the arena slot, pickles and index included (bytes).
        prepare_secs: walking the state, planning, pickling the skeleton (seconds).
        wait_slot_secs: waiting for a free slot (seconds).
        copy_secs: copying into the slot (seconds).
        blocking_secs: total time ``save`` blocked the caller (seconds).
        durable_secs: ``committed`` events only: seconds from the ``save`` call to this rank learning that
            the step is committed (durable on storage, tracker replaced); ``None`` on other events. An upper
            bound: a rank learns of a commit at its next ``poll``, ``save`` or ``wait`` (``HookRegistry`` and
            the integrations poll at every step).
        persist_gbps: ``committed`` events only: ``slot_nbytes / durable_secs / 1e9`` (GB/s, decimal) for
            this rank's part; ``None`` on other events.
    """

    step: int
    tier: "StorageType"
    tensor_nbytes: int
    slot_nbytes: int
    prepare_secs: float
    wait_slot_secs: float
    copy_secs: float
    blocking_secs: float
    durable_secs: Optional[float] = None
    persist_gbps: Optional[float] = None


#: Every :attr:`Event.kind` a Checkpointer emits (its listeners and :meth:`HookRegistry.on
#: <snapckpt.engine.hooks.HookRegistry.on>` take each).
EVENT_KINDS = ("snapshot_taken", "committed", "skipped", "slot_wait", "failed", "upload_skipped", "upload_failed",
               "replicated", "replica_lagging", "steps_lost", "world_size_changed")


@dataclass(frozen=True)
class Event:
    """One event: ``kind`` is ``snapshot_taken``, ``committed``, ``skipped``, ``slot_wait``, ``failed``,
    ``upload_skipped``, ``upload_failed``, ``replicated``, ``replica_lagging``, ``steps_lost`` or
    ``world_size_changed``.

    ``skipped`` means no snapshot was taken for the step (``on_slot_busy="skip"``), or, for a DISK save, that
    another rank took none, so the save was skipped on every rank (``reason`` names that rank; emitted once the
    handle learns it: ``done``, ``wait``, ``poll``, the next ``save``); ``slot_wait`` means the save is waiting for a
    free arena slot (``on_slot_busy="wait"``) and its snapshot is still to come. ``upload_skipped`` /
    ``upload_failed`` (remote tier, on the committer node's ranks): a committed step was not uploaded to
    ``remote_dir`` (the upload queue was full, or the store kept failing); the local copy is intact.
    ``replicated`` / ``replica_lagging`` (peer-memory tier, several nodes): the rank's memory snapshot of
    ``step`` is held complete by another node's persister (``reason`` names the node and the seconds), or
    was never sent because a newer one replaced it while the previous send was still in flight; reported
    at the rank's next snapshot. ``steps_lost`` (rank 0, at the load agreement of a restart): memory holds a
    newer step than the newest step complete in any tier, but not for every rank (a node lost with no
    surviving replica, two nodes lost, a replica behind); ``step`` is the newest such step and ``reason`` the
    warning's text (the ranks holding it and where, the ranks no node holds it for, the step and tier resumed
    from). ``world_size_changed`` (rank 0): at the first save, the checkpoint directory holds committed
    checkpoints written by another world size (``reason`` names them); or a DISK save replaces one of them.

    Attributes:
        kind: what happened.
        step: the step concerned.
        tier: the requested ``StorageType``.
        rank: global rank that observed it.
        stats: for ``snapshot_taken``; for ``committed`` too, with ``durable_secs`` and ``persist_gbps`` set.
        reason: for ``skipped``, ``slot_wait``, ``upload_skipped``, ``upload_failed``, ``replicated``,
            ``replica_lagging``, ``steps_lost`` and ``world_size_changed``.
        error: for ``failed``.
    """

    kind: str
    step: int
    tier: "StorageType"
    rank: int
    stats: Optional[SaveStats] = None
    reason: Optional[str] = None
    error: Optional[BaseException] = None
