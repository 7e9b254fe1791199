"""The load agreement's decision, as pure functions of what the ranks reported (:meth:`Loader.candidates`).

Each rank reports (one all-gather) ``{"mem": [[step, run_id], ...], "holds": [[rank, step, run_id, kind],
...], "node": i}``: ``mem`` are the complete snapshots in its own arena slots, ``holds`` (the first rank of each
node, peer replicas on) every snapshot its node's persister can serve, ``kind`` ``"own"`` (a slot of a rank
of that node) or ``"replica"`` (a peer node's snapshot it holds a copy of), and ``node`` its node index.

- :func:`memory_tier`: which memory steps are complete (every rank's part held by some node) and where each
  part is held (for the fetch of a part the rank's own node does not hold).
- :func:`ranked`: the candidates, newest first, memory before disk at the same step: the newest complete tier
  wins.
- :func:`lost_steps`: the warning a restart owes when memory holds a newer step than the one it resumes from
  (a node lost with no surviving replica, two nodes lost, a replica behind): which steps are lost, which
  ranks still hold them and where, which ranks hold no copy (and their newest one), and the step and tier the
  restart resumes from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["MemoryTier", "memory_tier", "ranked", "lost_steps"]

Key = Tuple[int, str]  # (step, run_id) of a memory snapshot
Source = Tuple[int, str]  # (node index, "own" | "replica")


@dataclass
class MemoryTier:
    """The memory tier as the ranks reported it.

    Attributes:
        complete: the ``(step, run_id)`` whose every rank's part is held by some node.
        have: per rank, the ``(step, run_id)`` of its parts held anywhere (its own slots, any node's holdings).
        sources: ``(step, run_id) -> rank -> [(node, kind)]`` from the nodes' holdings (where a part can be
            fetched from); a rank's own slots reported in ``mem`` only are not listed.
        where: ``step -> rank -> [(node, kind)]``: every copy of a rank's part, own slots included (for
            messages).
    """

    complete: Set[Key] = field(default_factory=set)
    have: List[Set[Key]] = field(default_factory=list)
    sources: Dict[Key, Dict[int, List[Source]]] = field(default_factory=dict)
    where: Dict[int, Dict[int, List[Source]]] = field(default_factory=dict)


def memory_tier(reports: Sequence[Dict[str, Any]], world_size: int) -> MemoryTier:
    """Combine the ranks' reports (``reports[r]`` from rank ``r``; see the module docstring).

    Args:
        reports: one dict per rank, ``len(reports) == world_size``; ``holds`` and ``node`` may be absent.
        world_size: the job's world size (holdings of other ranks are ignored).

    Returns:
        a :class:`MemoryTier`.
    """
    t = MemoryTier(have=[{(int(s), str(rid)) for s, rid in p.get("mem") or []} for p in reports])
    for r, p in enumerate(reports):
        for s, _ in p.get("mem") or []:
            _add(t.where, int(s), r, (int(p.get("node", -1)), "own"))
    for p in reports:
        for r, s, rid, kind in p.get("holds") or []:
            if 0 <= r < world_size:
                key = (int(s), str(rid))
                t.have[r].add(key)
                t.sources.setdefault(key, {}).setdefault(r, []).append((int(p.get("node", -1)), str(kind)))
                _add(t.where, int(s), r, (int(p.get("node", -1)), str(kind)))
    common: Optional[Set[Key]] = None
    for steps in t.have:
        common = set(steps) if common is None else common & steps
    t.complete = common or set()
    return t


def ranked(tier: MemoryTier, disk: Sequence[Sequence[Any]]) -> List[Tuple[int, str, Optional[str]]]:
    """The load candidates ``[(step, "memory", run_id) | (step, "disk", dirname)]``, newest first; at the same
    step memory comes first (no read of the shared filesystem).

    Args:
        tier: :func:`memory_tier` of the reports (its complete steps are the memory candidates).
        disk: the committed steps of this world size, ``[step, dirname, ...]`` each.
    """
    cands: List[Tuple[int, str, Optional[str]]] = [(s, "memory", rid) for s, rid in tier.complete]
    cands += [(int(d[0]), "disk", str(d[1])) for d in disk]
    cands.sort(key=lambda c: (c[0], c[1] == "memory"), reverse=True)
    return cands


def _add(where: Dict[int, Dict[int, List[Source]]], step: int, rank: int, src: Source) -> None:
    lst = where.setdefault(step, {}).setdefault(rank, [])
    if src not in lst:
        lst.append(src)


def _copy(src: Source) -> str:
    node, kind = src
    return f"own slot on node {node}" if kind == "own" else f"replica on node {node}"


def lost_steps(reports: Sequence[Dict[str, Any]], tier: MemoryTier,
               best: Optional[Tuple[int, str, Optional[str]]]) -> Optional[str]:
    """The warning a restart owes when some rank's part of a memory step newer than ``best`` is held but the
    step is not complete on every rank; ``None`` when nothing newer than ``best`` is held.

    Args:
        reports: the ranks' reports (``node`` of each rank names where it runs now).
        tier: :func:`memory_tier` of ``reports``.
        best: the candidate the restart resumes from, ``(step, "memory" | "disk", dirname or run_id)``, or
            ``None`` (a fresh start).

    Returns:
        one line naming the newest step held, the ranks that hold it and where (own slot or replica, node),
        the ranks no node holds it for (their node now, their newest copy anywhere), every held step that is
        lost, and the step and tier resumed from.
    """
    floor = best[0] if best is not None else -1
    lost = sorted(s for s in tier.where if s > floor)
    if not lost:
        return None
    newest = lost[-1]
    held = tier.where[newest]
    # a step number held by every rank is still incomplete when the parts come from different runs: the run
    # most ranks hold it from names the holders, the ranks that hold it from another run are missing
    runs = sorted({rid for have in tier.have for s, rid in have if s == newest})
    run = max(runs, key=lambda rid: sum((newest, rid) in have for have in tier.have)) if runs else None
    holders = sorted(r for r in held if run is None or (newest, run) in tier.have[r])
    missing = [r for r in range(len(reports)) if r not in holders]
    at = "; ".join(f"rank {r}: " + ", ".join(_copy(s) for s in held[r]) for r in holders)
    copies = []
    for r in missing:
        older = [s for s in tier.where if r in tier.where[s]]
        other = sorted(rid for s, rid in tier.have[r] if s == newest and rid != run) if r < len(tier.have) else []
        if other:
            copies.append(f"rank {r} (node {reports[r].get('node', '?')}): step {newest} of another run "
                          f"({', '.join(other)}, not {run})")
        elif older:
            s = max(older)
            copies.append(f"rank {r} (node {reports[r].get('node', '?')}): step {s} ("
                          + ", ".join(_copy(c) for c in tier.where[s][r]) + ")")
        else:
            copies.append(f"rank {r} (node {reports[r].get('node', '?')}): none")
    if best is None:
        resume = "none (a fresh start)"
    elif best[1] == "memory":
        fetch = [r for r in range(len(reports)) if (reports[r].get("node", -1), "own") not in
                 tier.where.get(best[0], {}).get(r, [])]
        fetched = f"; ranks {fetch} fetch their parts from where they are held" if fetch else ""
        resume = f"{best[0]} (memory{fetched})"
    else:
        resume = f"{best[0]} (disk, {best[2]})"
    also = f" (memory steps lost: {lost})" if len(lost) > 1 else ""
    return (f"step {newest} is held in memory by ranks {holders} but not by ranks {missing} on any node "
            f"(held as {at}); no node holds a copy of it for ranks {missing}: their node was lost or restarted "
            "without its memory (or they died before their snapshot of it), and no peer replica of it survives "
            f"(the replica was behind, or lost with its holder); their newest copies: {'; '.join(copies)}. The "
            "newest step complete on every rank across own memory, peer replicas and disk is "
            f"{resume}: the steps after it are lost on this restart{also}")
