"""Host-memory budget of a node's arena: how many slots per rank a budget allows, and which setting fits.

Arithmetic only (no I/O), shared by the training side's preflight (:mod:`snapckpt.engine.preflight`) and
the persister's reservation (:meth:`snapckpt.persister.slots.SlotTable.acquire`).

A node's arena holds, for each of its ``local_ranks`` ranks, ``slots`` slots of ``slot_nbytes`` bytes, and
with peer replicas one replica slot per rank of each of the ``replicas`` nodes it holds copies for. The
replicas are counted here as one slot of the same size per local rank and replica: the ranks of a
data-parallel job hold states of about one size (pipeline stages may differ; the estimate is then off).
Shared memory is RAM: every byte counted here is host memory held for the whole job.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

__all__ = ["arena_nbytes", "fitting_node_setting", "fitting_setting", "fmt_nbytes", "slots_within", "OtherRanks"]


def fmt_nbytes(n: int) -> str:
    """``n`` bytes for a message: ``"1.50 GiB (1610612736 bytes)"`` (MiB below 1 GiB)."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB ({n} bytes)"
    return f"{n / (1 << 20):.1f} MiB ({n} bytes)"


def arena_nbytes(slot_nbytes: int, slots: int, local_ranks: int, replicas: int) -> int:
    """Bytes of a node's arena: ``slot_nbytes * (slots + replicas) * local_ranks``."""
    return slot_nbytes * (slots + replicas) * local_ranks


def slots_within(budget_nbytes: int, slot_nbytes: int, local_ranks: int, replicas: int, slots_per_rank: int) -> int:
    """The most slots per rank (at most ``slots_per_rank``) whose arena fits ``budget_nbytes`` (bytes of the
    whole node, replica slots included); 0 when not even one slot per rank fits."""
    if slot_nbytes <= 0:
        return slots_per_rank
    k = budget_nbytes // (slot_nbytes * max(1, local_ranks)) - replicas
    return max(0, min(slots_per_rank, k))


def fitting_setting(slot_nbytes: int, slots: int, local_ranks: int, replicas: int, available: int) -> str:
    """One sentence for an error or warning: the largest ``slots_per_rank`` below ``slots`` whose arena fits
    ``available`` bytes ("slots_per_rank=1 fits: needs X of Y available"), or, when none does, what one slot
    per rank needs and the largest state per rank that would fit."""
    for k in range(slots - 1, 0, -1):
        need = arena_nbytes(slot_nbytes, k, local_ranks, replicas)
        if need <= available:
            return (f"slots_per_rank={k} fits: needs {fmt_nbytes(need)} of {fmt_nbytes(available)} available "
                    f"(host_memory_budget_nbytes={need} picks it too; with one slot, no complete snapshot is in "
                    "memory while the next one is copied, and a save waits for the slot's disk write: see "
                    "docs/performance.md)")
    one = arena_nbytes(slot_nbytes, 1, local_ranks, replicas)
    per_rank = available // max(1, (1 + replicas) * local_ranks)
    peers = " or fewer peer replicas (replicas=0)" if replicas else ""
    return (f"no slot count fits: even slots_per_rank=1 needs {fmt_nbytes(one)} of {fmt_nbytes(available)} "
            f"available; use a larger tmpfs (shm_dir= or SNAPCKPT_SHM_DIR), free host memory{peers}, or save "
            f"at most {fmt_nbytes(per_rank)} per rank (more ranks or nodes, sharded optimizer state)")


def fitting_node_setting(ranks: List[Tuple[int, int]], available: int) -> str:
    """:func:`fitting_setting` for the local ranks of a node whose sizes the persister knows: ``ranks`` holds
    ``(slot_nbytes, slots)`` per rank (bytes of one slot, slots it uses). Ranks of one size and slot count get
    :func:`fitting_setting`'s sentence, the one the node check (:func:`snapckpt.engine.preflight.host_memory_shortfall`)
    writes; ranks of different sizes (pipeline stages) count each rank at its own size."""
    sizes = {n for n, _ in ranks}
    counts = {k for _, k in ranks}
    if len(sizes) == 1 and len(counts) == 1:
        return fitting_setting(sizes.pop(), counts.pop(), len(ranks), 0, available)
    for k in range(max(counts) - 1, 0, -1):
        need = sum(n * min(k, c) for n, c in ranks)
        if need <= available:
            return (f"slots_per_rank={k} fits: needs {fmt_nbytes(need)} of {fmt_nbytes(available)} available for "
                    f"the slots of this node's {len(ranks)} local ranks, each at its own size (with one slot, no "
                    "complete snapshot is in memory while the next one is copied, and a save waits for the slot's "
                    "disk write: see docs/performance.md)")
    one = sum(n for n, _ in ranks)
    return (f"no slot count fits: even slots_per_rank=1 needs {fmt_nbytes(one)} of {fmt_nbytes(available)} available "
            f"for the slots of this node's {len(ranks)} local ranks; use a larger tmpfs (shm_dir= or "
            "SNAPCKPT_SHM_DIR), free host memory, or save less state per rank (more ranks or nodes, sharded "
            "optimizer state)")


@dataclass
class OtherRanks:
    """What the node's other local ranks add to a rank's capacity check (:meth:`SlotFiles.ensure_size
    <snapckpt.persister.arena.SlotFiles.ensure_size>`): ``nbytes``, the bytes their slots have yet to reserve to
    hold their ranks' last asked size; ``held``, the bytes those slots hold already (up to that size); ``ranks``,
    ``(rank, slot_nbytes, slots)`` of each of them, for the message and the advice."""

    nbytes: int = 0
    held: int = 0
    ranks: List[Tuple[int, int, int]] = field(default_factory=list)
