"""The crash flush: write the last snapshot held in memory when the training processes die (case B8).

Data path: when the last connected rank of a run has left and at least one of them left without
``bye`` (a crash, ``kill -9``), the server (:mod:`snapckpt.persister.server`) calls
:func:`flush_crashed_run` if the run asked for ``flush_on_crash``. The newest step that every local rank
of the run holds in a READY (or PERSISTING) slot is handed to the scheduler
(:mod:`snapckpt.persister.scheduler`) as a DISK save, unless that save is already pending or committed,
or the checkpoint directory already holds a committed step at least as new. Memory-only snapshots
(``persistable`` False) are never flushed.

With peer replicas, the newest step's parts of other nodes' ranks that this persister holds as replicas
are written too, should their own node be lost (:mod:`snapckpt.persister.replica_flush`): the crash flush
no longer needs every node alive.

The same flush runs for every run when an operator stops the persister (``snapckpt stop DIR``, the
``stop`` request of :mod:`snapckpt.persister.server`): :func:`flush_newest`.

What no flush wrote (memory-only snapshots such as Megatron's memory record, or ``flush_on_crash=False``)
lives only as long as the persister: :func:`unwritten_steps` names it when the persister exits, so that the
loss is said, not silent (contract 7).
"""
from __future__ import annotations

import logging
from typing import List, Optional, Set

from snapckpt.errors import PersisterError
from snapckpt.ondisk.manifest import list_committed
from snapckpt.persister.replica_flush import stand_in
from snapckpt.persister.replication import Replicator
from snapckpt.persister.slots import HELD, Run, SlotTable
from snapckpt.persister.scheduler import Scheduler
from snapckpt.storage.factory import open_storage

log = logging.getLogger("snapckpt.persister")

__all__ = ["flush_crashed_run", "flush_newest", "unwritten_steps"]


def flush_crashed_run(run: Run, slots: SlotTable, scheduler: Scheduler,
                      replicator: Optional[Replicator] = None, host: str = "") -> None:
    """Write the newest step held by every local rank of the crashed ``run`` (called with the server's
    lock). A rank whose part cannot be scheduled is logged, not raised: the others are still written."""
    flush_newest(run, slots, scheduler, "crashed", replicator, host)


def flush_newest(run: Run, slots: SlotTable, scheduler: Scheduler, why: str,
                 replicator: Optional[Replicator] = None, host: str = "") -> Optional[int]:
    """Write the newest step held by every local rank of ``run`` if it is newer than the newest committed
    step of its checkpoint directory (called with the server's lock; ``why`` goes into the log: "crashed",
    "stop requested"); with ``replicator``, stand in for the peer ranks whose replica of that step it holds
    (``host``: this node's name, for the records). Returns the step handed to the writers (or to be, once
    a failed save of it has ended here), or ``None`` when there is nothing newer than disk (or its save is
    already pending or committed)."""
    steps: Optional[Set[int]] = None
    for r in run.local_ranks:
        entry = slots.ranks.get(r)
        held = {s.step for s in entry.slots if s.state in HELD
                and s.run_id == run.run_id and s.persistable} if entry else set()
        steps = held if steps is None else steps & held
    if not steps:
        log.info("run %s %s; no step is held by every local rank, nothing to flush", run.run_id, why)
        return None
    step = max(steps)
    newest = max((s for s in slots.ranks[run.local_ranks[0]].slots if s.step == step and s.persistable
                  and s.state in HELD), key=lambda s: s.seq)
    key = (run.run_id, step, newest.dirname)
    res = scheduler.result(key)
    # (a pending record with no commit and no writer: a one-rank run's save refused before it reached the
    # persister, fail_part, which is over and is flushed as a failed one)
    if res is not None and res.state != "failed" and (
            res.state != "pending" or key in scheduler.commits_started or res.writers > 0):
        return None
    if res is not None and res.writers > 0:
        # that failed save is not over here: its writers still write into the partial directory deleted once
        # they end, and they end on its record (a flush now replaced it: they ended on the flush's record and
        # failed it, and the deletion never came). Flush once it is over (its deletion registered)
        log.warning("run %s %s; step %d is flushed once the failed save of it has ended", run.run_id, why, step)
        scheduler.when_over(key, lambda: flush_newest(run, slots, scheduler, why, replicator, host))
        return step
    try:
        newest_on_disk = _newest_committed(run)
    except Exception as e:  # cannot tell: flush anyway (a duplicate commit is harmless, a lost step is not)
        log.warning("run %s: cannot list the committed checkpoints of %s (%s: %s); flushing anyway", run.run_id,
                    run.checkpoint_dir, type(e).__name__, str(e)[:300])
        newest_on_disk = None
    if newest_on_disk is not None and newest_on_disk >= step:
        return None
    log.warning("run %s %s; flushing step %d from memory to disk", run.run_id, why, step)
    if replicator is not None and run.multi_node:  # claimed before the commit starts waiting for them
        for rep in replicator.replicas_of_step(run.run_id, step, newest.dirname):
            stand_in(run, rep, step, newest.dirname, scheduler, host)
    scheduler.forget(key)
    for r in run.local_ranks:
        try:
            scheduler.persist(slots.ranks[r], step, run)
        except PersisterError as e:
            log.error("flush of step %d failed for rank %d: %s", step, r, e)
    return step


def unwritten_steps(run: Run, slots: SlotTable) -> List[int]:
    """The steps of the crashed ``run`` held in memory by every local rank and newer than the newest step
    committed in its checkpoint directory, newest first: what the memory tier holds and the disk does not,
    lost when this persister exits (called with the server's lock, at exit). ``[]`` for a run that did not
    crash or whose directory cannot be listed."""
    if not run.crashed:
        return []
    steps: Optional[Set[int]] = None
    for r in run.local_ranks:
        entry = slots.ranks.get(r)
        held = {s.step for s in entry.slots if s.state in HELD and s.run_id == run.run_id} if entry else set()
        steps = held if steps is None else steps & held
    if not steps:
        return []
    try:
        newest = _newest_committed(run)
    except Exception:  # OSError; in remote-only mode any error of the store
        return []
    newest = -1 if newest is None else newest
    return sorted((s for s in steps if s > newest), reverse=True)


def _newest_committed(run: Run) -> Optional[int]:
    """The step of the newest checkpoint committed in ``run``'s checkpoint directory (in remote-only mode,
    in the store: :mod:`snapckpt.persister.remote_only`), ``None`` when there is none.

    Raises:
        OSError / the store's errors: it cannot be listed.
    """
    if run.remote_only:
        from snapckpt.persister.remote_only import newest_committed_step
        return newest_committed_step(run.checkpoint_dir)
    committed = list_committed(open_storage(), run.checkpoint_dir)
    return committed[-1].step if committed else None
