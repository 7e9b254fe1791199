"""The checkpoint metrics every integration reports, under one set of names.

Each integration (the Trainer callback, DeepSpeed's monitor, ...) maps the :class:`~snapckpt.events.Event`
records of its rank through :func:`event_metrics` and hands the ``{name: value}`` result to the
framework's own logger, so a dashboard shows the same names whichever framework trains:

| name | unit | meaning (event) |
|---|---|---|
| ``snapckpt/stall_secs`` | seconds | time ``save`` blocked training (``snapshot_taken``) |
| ``snapckpt/bytes`` | bytes | this rank's snapshot: tensor data and pickled objects (``snapshot_taken``) |
| ``snapckpt/durable_secs`` | seconds | from the ``save`` call to this rank learning of the commit (``committed``) |
| ``snapckpt/persist_gbps`` | GB/s | ``bytes / durable_secs / 1e9`` (``committed``) |
| ``snapckpt/skipped`` | count | 1 for a step whose snapshot was skipped: no free slot (``skipped``) |
| ``snapckpt/replicated`` | count | 1 for a memory snapshot held complete by a peer node (``replicated``) |
| ``snapckpt/replica_lagging`` | count | 1 for a memory snapshot never replicated: the previous send was in flight (``replica_lagging``) |

Each value is reported once per checkpoint, when it becomes known: stall and bytes when the snapshot is
taken, durable time and throughput when the commit is learnt (a step or more later). Values are this
rank's (integrations report rank 0's). :func:`summary_line` is the one INFO line per checkpoint that
global rank 0 logs on the ``snapckpt.metrics`` logger.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from snapckpt.events import Event, StorageType

__all__ = ["STALL_SECS", "BYTES", "DURABLE_SECS", "PERSIST_GBPS", "SKIPPED", "REPLICATED", "REPLICA_LAGGING", "METRICS", "event_metrics",
           "human_bytes", "summary_line"]

STALL_SECS = "snapckpt/stall_secs"
BYTES = "snapckpt/bytes"
DURABLE_SECS = "snapckpt/durable_secs"
PERSIST_GBPS = "snapckpt/persist_gbps"
SKIPPED = "snapckpt/skipped"
REPLICATED = "snapckpt/replicated"
REPLICA_LAGGING = "snapckpt/replica_lagging"

#: ``(name, unit, meaning)`` of every metric, in the order of the docs' table.
METRICS: Tuple[Tuple[str, str, str], ...] = (
    (STALL_SECS, "seconds", "time save blocked training"),
    (BYTES, "bytes", "this rank's snapshot: tensor data and pickled objects"),
    (DURABLE_SECS, "seconds", "from the save call to this rank learning of the commit"),
    (PERSIST_GBPS, "GB/s", "bytes / durable_secs / 1e9"),
    (SKIPPED, "count", "1 for a step whose snapshot was skipped (no free arena slot)"),
    (REPLICATED, "count", "1 for a memory snapshot held complete by a peer node"),
    (REPLICA_LAGGING, "count", "1 for a memory snapshot never replicated (the previous send was in flight)"),
)


def event_metrics(event: Event) -> Dict[str, float]:
    """The metrics an event carries, ``{name: value}`` (floats; names above).

    Args:
        event: any :class:`~snapckpt.events.Event`.

    Returns:
        Dict[str, float]: ``snapshot_taken``: stall (seconds) and bytes; ``committed``: durable time (seconds) and
            throughput (GB/s); ``skipped``: ``{SKIPPED: 1.0}``; ``replicated`` / ``replica_lagging``:
            ``{REPLICATED: 1.0}`` / ``{REPLICA_LAGGING: 1.0}``; any other event (``slot_wait``, ``failed``),
            or one without the statistics: ``{}``.
    """
    st = event.stats
    if event.kind == "skipped":
        return {SKIPPED: 1.0}
    if event.kind == "replicated":
        return {REPLICATED: 1.0}
    if event.kind == "replica_lagging":
        return {REPLICA_LAGGING: 1.0}
    if st is None:
        return {}
    if event.kind == "snapshot_taken":
        return {STALL_SECS: float(st.blocking_secs), BYTES: float(st.slot_nbytes)}
    if event.kind == "committed" and st.durable_secs is not None:
        out = {DURABLE_SECS: float(st.durable_secs)}
        if st.persist_gbps is not None:
            out[PERSIST_GBPS] = float(st.persist_gbps)
        return out
    return {}


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: Optional[int]) -> str:
    """``n`` bytes for a person: ``"512 B"``, ``"1.2 GiB"`` (powers of 1024, one decimal); ``"-"`` for ``None``.

    Here rather than in the CLI: :func:`summary_line` runs on rank 0's first save, and importing
    ``snapckpt.cli`` there (every subcommand's module) cost that save a few milliseconds (issue 18)."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), 0
    while unit < len(_UNITS) - 1 and round(value, 1) >= 1024:
        value /= 1024
        unit += 1
    return f"{value:.1f} {_UNITS[unit]}"


def summary_line(event: Event) -> Optional[str]:
    """The one-line summary of a checkpoint, or ``None`` for an event that ends none.

    A DISK checkpoint is summarised at its ``committed`` event, a MEMORY one at its ``snapshot_taken``::

        step 200 (disk): 1.2 GiB, stall 0.031 s, durable 2.40 s, 0.54 GB/s
        step 210 (memory): 1.2 GiB, stall 0.029 s
    """
    st = event.stats
    if st is None:
        return None
    if event.kind == "committed" and st.durable_secs is not None:
        gbps = "" if st.persist_gbps is None else f", {st.persist_gbps:.2f} GB/s"
        return (f"step {event.step} ({event.tier}): {human_bytes(st.slot_nbytes)}, stall {st.blocking_secs:.3f} s, "
                f"durable {st.durable_secs:.2f} s{gbps}")
    if event.kind == "snapshot_taken" and event.tier == StorageType.MEMORY:
        return f"step {event.step} ({event.tier}): {human_bytes(st.slot_nbytes)}, stall {st.blocking_secs:.3f} s"
    return None
