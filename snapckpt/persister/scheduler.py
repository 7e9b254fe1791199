"""Persist scheduling: from a READY slot to a committed step on disk.

Data path: once a rank's slot of step ``N`` is READY and the rank asked for a DISK save
(:mod:`snapckpt.persister.server`), :meth:`Scheduler.persist` marks the slot PERSISTING and runs, on
thread pools of this process:

- one writer task per local rank (:func:`snapckpt.persister.writer.write_part_data`): the rank's native
  files into the step's partial directory; then the :class:`~snapckpt.persister.part_sync.PartSyncer`
  fsyncs them with the other parts written meanwhile and writes the part markers; the slot is released
  (READY again) as soon as its bytes are durable, before its marker;
- one commit task per step and directory: the commit protocol (:func:`snapckpt.persister.commit.commit`
  on the committer node, :func:`~snapckpt.persister.commit.watch_commit` elsewhere), behind a tracker
  gate so that the tracker file only moves forward in request order.

Each save's outcome is a :class:`Result`, read by the ``status`` requests of the ranks; a failed part is
recorded in memory before its failure marker, so the commit of that step fails at once with its cause. The
records are indexed by the saves in flight (:mod:`snapckpt.persister.save_records`: what the per-save waits
read) and pruned once nothing here can still ask about them (:meth:`Scheduler._needed`, :meth:`Scheduler._prune`).
A part that can never come (its rank died before handing it over, or its node is lost) ends the commit
in seconds too, through the run's :class:`~snapckpt.persister.peers.PeerWatch`.

Across nodes the commit path is event-driven (:mod:`snapckpt.persister.commit_notices`): once every part
this node accepted for a save has ended, it sends ``part_done`` to the committer's node; the committer
sends ``commit_ended`` to every other node once the commit ended. A notice received sets the save's wake
event (:attr:`Result.part_ended`), on which the commit task waits (:meth:`Scheduler.on_notice`).

A step may be saved again under the same directory in a run (a retry once its save failed, a crash flush):
each save of ``(run id, step, dirname)`` has a generation (:attr:`Result.gen`), carried by its notices, so
that a notice about an earlier save of it never lands on the later one's record; a key's records are held
together, by generation (``Scheduler.results``).

Locking: :meth:`Scheduler.persist`, :meth:`Scheduler.fail_part`, :meth:`Scheduler.result` and
:meth:`Scheduler.forget` run with the server's lock held; the tasks take it.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from snapckpt._internal import faultpoints as faults
from snapckpt.persister.slot_index import read_index, read_index_at
from snapckpt.errors import CommitError, PersisterError, SaveSkippedError
from snapckpt.ondisk.manifest import (CHECKSUM, SIDECAR, fail_marker_name, part_marker_name, partial_dirname,
                                     validate_file_name)
from snapckpt.persister import protocol as P
from snapckpt.persister.arena import SlotState, map_slot
from snapckpt.persister.commit import BACKSTOP_SECS, CommitRequest, commit, retire_after_answer, watch_commit
from snapckpt.persister.commit_notices import CommitNotices
from snapckpt.persister.peers import PeerWatch, lease_name
from snapckpt.persister.remote_only import commit_remote, store_for, write_part_remote
from snapckpt.persister.save_records import SaveRecords
from snapckpt.persister.slots import HELD, RankEntry, Run, Slot, SlotTable
from snapckpt.persister.uploader import Uploader, UploadJob
from snapckpt.persister.part_sync import PartSyncer
from snapckpt.persister.stream import Stream
from snapckpt.persister.writer import write_failure_marker, write_part_data
from snapckpt.storage.factory import open_storage

log = logging.getLogger("snapckpt.persister")

__all__ = ["Result", "Scheduler"]

SaveKey = Tuple[str, int, str]  # (run id, step, dirname): one save

# records of a run kept once their saves ended, the newest ones (Scheduler._prune): a late part, a late
# notice or a crash flush of a recent step finds its save's record; older ones go once no rank still waits
# to be told how they ended
KEEP_ENDED = 64
# saves whose committer's abort notices are kept before this node has their record (Scheduler.aborts_ahead), the
# newest ones: a save whose local ranks never come (the run ended) is forgotten after as many others
AHEAD_KEPT = 4 * KEEP_ENDED
# saves whose newest generation is remembered once their records were pruned (Scheduler.pruned_gens), the newest ones:
# a save of such a step again counts on from it, as a node that still holds the record does
PRUNED_GENS_KEPT = 16384


class _CommitOver(CommitError):
    """A part of a save whose commit is known here to have failed already (``Scheduler._commit_over``): not
    written, no failure marker, and not recorded as the rank's error (its rank gets the commit's)."""


@dataclass
class Result:
    """The outcome of one save on this node."""

    # which save of (run id, step, dirname) this is: 1, then one more for each save of it again on this node
    # (Scheduler._replace, forget). Every node of the run counts alike (each save of it is asked of every
    # node by its ranks, or crash-flushed on each), so the peer notices name the save by it. 0: no save, the
    # failed record of a rank's snapshot whose save could not start (Scheduler._persist_deferred), or the
    # stand-in of one whose save has not started yet (waiting)
    gen: int = 1
    state: str = "pending"  # pending | committed | failed
    error: Optional[Dict[str, Any]] = None
    part_errors: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    parts_done: Set[int] = field(default_factory=set)
    # rank -> {file: (nbytes, checksum)} of the parts this node wrote (a watcher tells this save's manifest
    # from an earlier save's of the same step by them: _own_parts)
    part_files: Dict[int, Dict[str, Tuple[int, str]]] = field(default_factory=dict)
    rank_seq: Dict[int, int] = field(default_factory=dict)  # slot seq each local rank's part comes from
    told: Set[int] = field(default_factory=set)  # local ranks told how it ended (a status reply; fail_part)
    writers: int = 0  # this node's writer tasks of the step still running
    part_ended: threading.Event = field(default_factory=threading.Event)  # wakes the commit's wait (commit.py)
    notices: int = 0  # peer notices received for this save (commit_notices.py)
    aborted_at: Optional[float] = None  # monotonic time the committer's node said its commit failed
    committed_at: Optional[float] = None  # monotonic time the committer's node said its commit ended committed
    streams: Dict[int, Stream] = field(default_factory=dict)  # rank -> its streamed part (persister/stream.py)
    # another node: set when the committer's node said it deleted this failed save's partial directory
    removed: threading.Event = field(default_factory=threading.Event)
    # ranks whose save of this step and directory again waits for this save to be over here (persist: deferred)
    deferred: Set[int] = field(default_factory=set)
    deferred_seqs: Set[int] = field(default_factory=set)  # their snapshots (slot seqs), each started in turn
    # another node: the wait for the committer's deletion of this failed save's partial directory runs
    awaiting_removal: bool = False  # (Scheduler._await_removal_task; its removed notice must find this record)
    # another node: the committer's error record sent with its abort notice (a skipped save's: SaveSkippedError)
    abort_error: Optional[Dict[str, Any]] = None
    late: Set[int] = field(default_factory=set)  # local ranks whose snapshot came once it was over: not written
    flush: bool = False  # a crash flush's save (Scheduler.forget): its parts are the persister's, no rank is behind
    # a crash flush's: the generations of the earlier saves of its step that failed here, whose records it dropped
    # (Scheduler.forget); their part markers are stale for its commit (Scheduler._failed_gens)
    failed_before: Set[int] = field(default_factory=set)
    # a stand-in, never among the records: the save of a rank's snapshot that waits for the save of its step and
    # directory before it to be over here (Scheduler.result; the rank is in that save's `deferred`): pending
    waiting: bool = False

    def participants(self) -> Set[int]:
        """The local ranks that took part in this save: handed their snapshot over (or streamed it), or failed
        or skipped the save before the persister (``Scheduler.fail_part``)."""
        return set(self.rank_seq) | set(self.part_errors) | set(self.parts_done) | set(self.streams)


class Scheduler:
    """Writer and commit tasks of every save on this node, and their results.

    Args:
        slots: the slot table (its slots are marked PERSISTING and released here).
        lock: the server's lock (see the module docstring).
    """

    def __init__(self, slots: SlotTable, lock: threading.RLock) -> None:
        self.slots = slots
        self.lock = lock
        # every save's records, by key in creation order, each key's by generation (the newest last), indexed
        # by run and by the saves that may be in flight (save_records.py); the earlier generations are kept while
        # _needed (or the last one replaced: _replace), the keys pruned by _prune. The records of the saves in
        # flight are the `live` ones whose _in_flight holds
        self.results: SaveRecords = SaveRecords()
        self.prune_at: Dict[str, int] = {}  # run id -> its record count that starts the next _prune
        self.commits_started: Set[SaveKey] = set()
        self.commit_seq = 0  # order of persist requests, for the tracker gate
        self.tracker_seq: Dict[Tuple[str, str], int] = {}
        self.tracker_lock = threading.Lock()
        # checkpoint dir -> {dirname: commits of it not yet reported}: retention protects them (contract 5). A
        # commit that ends after a later one's is renamed into place while still in flight; the later one's
        # retention (keep_last) retired it before its answer, and the other nodes' watchers, reading its
        # manifest after that, took the commit for aborted (its own lock: commit threads read it in retention)
        self.committing: Dict[str, Dict[str, int]] = {}
        self.committing_lock = threading.Lock()
        # checkpoint dir -> the latest request order (commit_seq) of this persister committed there: a commit
        # behind it ended behind a later save's commit (its retention then retires it: retire_after_answer)
        self.committed_seq: Dict[str, int] = {}
        self.pending = 0  # writer and commit tasks not finished
        self.failed = False  # a part or a commit failed: the persister keeps its log
        self.watches: Dict[str, PeerWatch] = {}  # run id -> its dead-peer view (persister/peers.py)
        self.pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapckpt-writer")
        self.syncer = PartSyncer()  # fsyncs and markers of the parts written, in batches
        self.commit_pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapckpt-commit")
        self.uploader = Uploader(self._upload_done)  # the remote tier (runs with a remote_dir only)
        # remote-only: URL -> prefixes of failed saves the store was too sick to delete (retried after a commit)
        self.undiscarded: Dict[str, Set[str]] = {}
        # (checkpoint dir or URL, dirname) -> set once the deletion of a failed save's partial directory (or, in
        # remote-only mode, its prefix) has ended, off the lock; on another node than the committer's: once the
        # committer's deletion is known to have ended (_await_removal_task). A later save of it waits for that
        self.discarding: Dict[Tuple[str, str], threading.Event] = {}
        # another node than the committer's: save -> {generation: (error record, removed)} of the committer's abort
        # notices about a generation of it this node has no record of yet (its local ranks come later: another rank
        # skipped the save, and the committer ended it at once). Its record takes them when made (_aborted_ahead)
        self.aborts_ahead: Dict[SaveKey, Dict[int, Tuple[Optional[Dict[str, Any]], bool]]] = {}
        # save -> the generation of its newest record when _prune dropped it (the newest PRUNED_GENS_KEPT): a save of
        # it again is the next generation here too, as on a node that still holds the record (the part markers and
        # notices name the save by it: a node that started again at 1 made them disagree)
        self.pruned_gens: Dict[SaveKey, int] = {}
        # notified (with the lock) when a save ended or its last writer did, or a deletion above ended:
        # wakes _wait_for_directory (_notify_ended)
        self.ended = threading.Condition(lock)
        # writer tasks whose directory is busy (_directory_busy), in request order: submitted once it is free
        # (_notify_ended), not waiting on a writer thread, where they held up the writers of the saves they wait for
        self.parked: List[Tuple[Run, SaveKey, Tuple[Any, ...]]] = []
        # save -> what runs once it is over on this node (when_over: a crash flush of its step, flush.py)
        self.over_calls: Dict[SaveKey, List[Callable[[], None]]] = {}
        # deletions of failed partial directories, one at a time (not on commit_pool: commits wait for them)
        self.remove_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-remove")
        self.notices: Optional[CommitNotices] = None  # set by the server (the peer channel's notices)
        # called (any thread, without the lock) when a save ended or a rank's part failed: the server answers
        # the ranks' held await requests (server.py)
        self.on_change: Callable[[], None] = lambda: None
        # set when this persister takes no more requests (SIGTERM, stop_accepting): a part not handed over by now
        # can never come to this node
        self.stopping = threading.Event()

    def stop_accepting(self) -> None:
        """This persister takes no more requests (it was sent SIGTERM; call without the lock). A commit of this
        node waiting for the part of a local rank that has not handed it over fails now, not at
        ``commit_timeout_secs``: nothing can bring that part any more, and a job's stop must not wait up to 600 s
        (a pod's grace is typically 30 s). Parts already handed over are still written and committed; waits on
        other nodes' parts go on (their ranks may live)."""
        self.stopping.set()
        with self.lock:
            for key in list(self.results):
                for res in self.results.records(key):
                    res.part_ended.set()  # the waits look again (CommitRequest.wake)

    def shutdown(self) -> None:
        """Wait for every writer, commit and upload task (at exit)."""
        self.pool.shutdown(wait=True)
        self.syncer.shutdown()
        self.commit_pool.shutdown(wait=True)
        self.remove_pool.shutdown(wait=True)
        self.uploader.shutdown()

    def _upload_done(self) -> None:
        with self.lock:
            self.pending -= 1

    def clean_remote(self, run: Run) -> None:
        """Queue the clean-up of interrupted uploads under ``run.remote_dir``, then the upload of the local
        checkpoints it lacks (called with the lock)."""
        self.pending += 1
        self.uploader.submit(UploadJob(run.run_id, run.remote_dir, "", "", None, run.keep_last,
                                       checkpoint_dir=run.checkpoint_dir, before_unix=time.time()))

    def result(self, key: SaveKey, rank: int = -1, seq: int = -1) -> Optional[Result]:
        """The result of the save ``key``, or ``None`` if this node was never asked to persist it. With ``rank``
        and ``seq`` (the rank's snapshot that save handed over): the save that ``seq`` of ``rank`` was written
        by, where saves of the same step and directory again replaced it (else the newest save of ``key``:
        one that replaced a snapshot never written, or not yet). A rank not (yet) in the newest save is looked up
        in the earlier ones held too (newest first): its snapshot may have been written by one of them. A snapshot
        in none of them whose save of the step again waits for the newest one to be over (the rank is in its
        :attr:`Result.deferred`: :meth:`persist`) has no record yet: its save reads as pending, a fresh
        :attr:`Result.waiting` stand-in (not the earlier save's outcome)."""
        recs = self.results.records(key)
        if seq >= 0:
            for res in reversed(recs):
                if res.rank_seq.get(rank) == seq:
                    return res
        if recs and rank in recs[-1].deferred and recs[-1].rank_seq.get(rank) != seq:
            return Result(gen=0, waiting=True)  # (seq -1, not known: a rank that defers a save hears pending)
        return recs[-1] if recs else None

    def when_over(self, key: SaveKey, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once save ``key`` is over on this node: its commit ended and its last writer too (called
        with the lock; ``fn`` runs with it, on the task that ended the save; the tasks' ``pending`` count holds
        the persister until then)."""
        self.over_calls.setdefault(key, []).append(fn)

    def _run_over_calls(self, key: SaveKey, res: Result) -> None:
        """Run :meth:`when_over`'s calls of ``key`` if its save ``res`` is over (called with the lock); a save no
        longer in flight leaves the in-flight index (every end of a writer or a commit comes here)."""
        if self.results.get(key) is res and not self._in_flight(key, res):
            self.results.settle(key)
        if res.state == "pending" or res.writers > 0 or self.results.get(key) is not res:
            return
        for fn in self.over_calls.pop(key, []):
            try:
                fn()
            except Exception:
                log.exception("step %d (%s): a call after the save's end failed", key[1], key[2])

    def forget(self, key: SaveKey) -> None:
        """Drop the record of the save ``key`` (it is about to be persisted again, by the crash flush): a fresh
        record of the next generation takes its place. The earlier records go (the ranks' handles of the step
        hear the flush's outcome), but one whose wait for its deletion still runs (its removed notice)."""
        old = self.results.get(key)
        self.commits_started.discard(key)
        if old is not None:
            failed = {g for r in self.results.records(key) for g in self._failed_of(r)}
            self.results.push(key, Result(gen=old.gen + 1, flush=True, failed_before=failed))
            self.results.keep_older(key, lambda r: r.awaiting_removal)
        else:  # (its markers say "flush": no commit takes them for a failed save's, whatever its generation)
            self._record(key).flush = True

    def _in_flight(self, key: SaveKey, res: Result) -> bool:
        """Whether save ``key`` (record ``res``) is in flight here: a writer of it runs, or its commit started
        and has not ended (called with the lock)."""
        return res.writers > 0 or (res.state == "pending" and key in self.commits_started)

    @staticmethod
    def _untold(res: Result, run: Run) -> bool:
        """Whether a connected local rank of ``run`` took part in save ``res`` and was not yet told its end."""
        return bool((res.participants() - res.told) & run.connected)

    def _needed(self, res: Result, run: Run) -> bool:
        """Whether record ``res`` of ``run`` must be held whatever its age (called with the lock): a rank's save
        of its step again waits for it (:attr:`Result.deferred`), the wait for its partial directory's deletion
        runs (:attr:`Result.awaiting_removal`: :meth:`on_notice` finds it by its generation), or a connected
        local rank that took part was not told its end (:meth:`_untold`: its handle asks by its ``seq``,
        :meth:`result`)."""
        return bool(res.deferred) or res.awaiting_removal or self._untold(res, run)

    def _behind(self, key: SaveKey, rank: int) -> Optional[Result]:
        """The oldest save of ``key`` replaced here that local rank ``rank`` took no part in, or ``None`` (called
        with the lock). A rank's k-th save of a step and directory is the k-th save of it on every rank: a part of
        ``rank`` that comes once another rank's later save has replaced that save (that rank skipped it, and it
        ended at once) is ``rank``'s part of it, not of the newest save, where it would be paired with the other
        ranks' next snapshots. That save ended without it: the part is not written (:meth:`_late_part`)."""
        recs = self.results.records(key)
        if not recs or recs[-1].flush:  # (a crash flush writes every local rank's newest snapshot)
            return None
        for old in recs[:-1]:
            if old.gen > 0 and rank not in old.participants():  # (generation 0: _persist_deferred's stand-in)
                return old
        return None

    def _late_part(self, run: Run, key: SaveKey, res: Result, rank: int, seq: int) -> None:
        """Rank ``rank``'s snapshot ``seq`` of save ``res``, which is over here (failed, or its commit aborted by
        the committer's node): not written, but recorded, so that the rank's status finds that save by its seq and
        its next save of ``key`` is a new save (called with the lock). A record no commit ran for (the committer's
        abort came before this node's first part: :meth:`_aborted_ahead`) ends here, failed with the committer's
        error (a skipped save's :class:`SaveSkippedError`)."""
        res.rank_seq[rank] = seq
        res.late.add(rank)
        if res.state != "pending" or key in self.commits_started or self.results.get(key) is not res:
            return
        res.state = "failed"
        res.error = res.abort_error or P.error_record(CommitError(
            f"step {key[1]}: the committer's node reports that the commit of {key[2]} failed (see rank 0's error)"))
        log.warning("step %d: rank %d's part of %s is not written: the committer's node ended that save (%d) "
                    "before this node's first part of it came: %s", key[1], rank, key[2], res.gen,
                    res.error.get("message"))
        self._remove_failed_partial(run, res, key)  # (another node: waits for the committer's deletion)
        self._run_over_calls(key, res)
        self._notify_ended()

    def _record(self, key: SaveKey) -> Result:
        """The record of save ``key``, made if there is none (called with the lock): generation 1, or the one after
        its pruned records' (:attr:`pruned_gens`)."""
        res = self.results.get(key)
        if res is None:
            res = self.results[key] = self._aborted_ahead(key, Result(gen=self.pruned_gens.pop(key, 0) + 1))
        return res

    def _abort_ahead(self, key: SaveKey, gen: int, error: Optional[Dict[str, Any]], removed: bool) -> None:
        """Keep the committer's abort notice of generation ``gen`` of save ``key``, which this node has no record
        of yet (called with the lock; :attr:`aborts_ahead`)."""
        mine = self.aborts_ahead.setdefault(key, {})
        was_error, was_removed = mine.get(gen, (None, False))
        mine[gen] = (error or was_error, removed or was_removed)
        while len(self.aborts_ahead) > AHEAD_KEPT:
            del self.aborts_ahead[next(iter(self.aborts_ahead))]

    def _aborted_ahead(self, key: SaveKey, res: Result) -> Result:
        """``res``, the new record of ``key``, with the committer's abort notices of its generation that came before
        it (called with the lock): the commit is known failed here (:meth:`_commit_over`), so no part of it is
        written, and the committer's deletion of its partial directory, if said, is known ended."""
        ahead = self.aborts_ahead.get(key)
        if ahead:
            got = ahead.pop(res.gen, None)
            for g in [g for g in ahead if g < res.gen]:
                del ahead[g]
            if not ahead:
                del self.aborts_ahead[key]
            if got is not None:
                res.aborted_at = time.monotonic()
                res.abort_error = got[0]
                if got[1]:
                    res.removed.set()
        return res

    def _prune(self, run: Run) -> None:
        """Drop ``run``'s records that nothing here can still need (called with the lock, as a save's commit
        starts or a part fails before the persister): all but its newest :data:`KEEP_ENDED` keys, except a save
        still in flight or with a call after its end (:meth:`when_over`), one any record of which (its earlier
        generations too) is :meth:`_needed` (an untold rank's handle asks again: a missing record would answer
        ``held`` or ``unknown``), and on another node than the committer's, a failed one whose abort notice has
        not come (its notice names the save's generation). A pruned save is then as one never asked for: a late
        peer notice about it is dropped (:meth:`on_notice`), and a save of its step again is a new save, of the
        generation after the pruned one's (:attr:`pruned_gens`), as on a node that still holds its record: the nodes'
        notices and part markers about it name it alike (a node that started again at 1 made the notices miss, so
        that its commit path waited on its filesystem reads, and its part markers looked like an earlier save's).
        Runs every ``KEEP_ENDED`` records or more (the next run waits until as many new ones came as were kept),
        so its cost per record stays O(1) amortized; a run holds at most ``2 * KEEP_ENDED`` records plus those kept
        above."""
        mine = self.results.by_run.get(run.run_id)
        if mine is None or len(mine) < self.prune_at.get(run.run_id, 2 * KEEP_ENDED):
            return
        keys = list(mine)
        for key in keys[:-KEEP_ENDED]:
            res = self.results[key]
            if self._in_flight(key, res) or key in self.over_calls:
                continue
            if not run.committer and not run.remote_only and res.state == "failed" and res.aborted_at is None:
                continue
            if any(self._needed(r, run) for r in self.results.records(key)):
                continue
            self.pruned_gens[key] = res.gen
            del self.results[key]
            self.commits_started.discard(key)
        while len(self.pruned_gens) > PRUNED_GENS_KEPT:
            del self.pruned_gens[next(iter(self.pruned_gens))]
        self.prune_at[run.run_id] = max(2 * KEEP_ENDED, len(mine) + KEEP_ENDED)

    # ------------------------------------------------------------------------------------ requests
    def persist(self, entry: RankEntry, step: int, run: Run, slot: Optional[Slot] = None) -> None:
        """Write rank ``entry``'s newest snapshot of ``step`` (``slot``: that snapshot, a deferred save's) to
        disk and commit the step (once per save).

        A save of a step and directory again by a rank whose earlier save of them is not over on this node (still
        persisted, or failed while its writers or commit go on) starts when that save is over here (its writers
        ended, its partial directory deleted, if it failed): the rank's status of the step says ``pending`` until
        then (its earlier save's status, asked with its ``seq``, is that save's own: :meth:`result`). A rank whose
        save came once it was over starts the new save at once: every rank of the step joins that one save, none
        is refused. A rank that saves the step again several times meanwhile has each snapshot saved in turn, so
        that its k-th save of the step joins the other ranks' k-th.

        Raises:
            PersisterError: the rank holds no snapshot of ``step``.
        """
        s = self.slots.newest_held(entry, step) if slot is None else slot
        if s is None or s.step != step or s.state not in HELD:
            raise PersisterError(f"rank {entry.rank} holds no snapshot of step {step} to persist")
        key = (run.run_id, step, s.dirname)
        res = self.results.get(key)
        st = res.streams.get(entry.rank) if res is not None else None
        if st is not None and st.seq is None and st.error is None and entry.rank not in res.rank_seq:
            # the ready of a streamed part: its writer (and the commit) started at "stream" (a cancelled stream's
            # slot never becomes READY: this is then another save)
            res.rank_seq[entry.rank] = s.seq
            if s.stream is st:  # still writing: it reads the slot until its bytes are durable
                self.slots.start_persist(s)
            st.set_ready(s.seq)  # (a writer that failed before has recorded the part's error: the commit fails)
            return
        if res is not None and entry.rank not in res.participants():
            if any(entry.rank in old.late and old.rank_seq[entry.rank] == s.seq
                   for old in self.results.records(key)[:-1]):
                return  # this snapshot was an earlier save's late part already (a persist of it again)
            old = self._behind(key, entry.rank)
            if old is not None:  # its part of an earlier save of key that ended without it: not written
                self._late_part(run, key, old, entry.rank, s.seq)
                return
        if res is not None and (res.rank_seq.get(entry.rank, s.seq) != s.seq
                                or (entry.rank in res.part_errors and entry.rank not in res.rank_seq)):
            # this rank saved the same step under the same directory again (its earlier save reached this
            # persister, or failed before it did, fail_part: a retry once the disk has room must not fail on
            # that stale error; a one-rank run's fail_part starts no commit, so that save is over already)
            if self._in_flight(key, res):
                # the earlier save is not over here: its writers and commit end on its record (and a failed one's
                # partial directory is deleted once they have). This save starts then, as it does for a rank
                # whose save comes later; refused, this rank's part would never come to the others' save
                # each snapshot in turn: one that took the rank's newest snapshot when the earlier save was over
                # put a rank two saves ahead into the next save with its third snapshot, beside the other ranks'
                # second ones, and the third save waited for its part until the commit timeout
                if s.seq not in res.deferred_seqs:
                    res.deferred.add(entry.rank)
                    res.deferred_seqs.add(s.seq)
                    s.pins += 1  # never handed out meanwhile (the rank's next snapshots go on)
                    self.when_over(key, lambda: self._persist_deferred(entry, step, run, res, s))
                return
            res = self._replace(run, key)  # the earlier save ended: this one is a new save that replaces it
        if res is None:
            res = self._record(key)
        if s.state == SlotState.PERSISTING or entry.rank in res.parts_done:
            return
        if self._commit_over(run, key):
            # a late part of a failed save (its rank gets the commit's error): no writer. One would wait in the
            # pool behind a next save's writers that wait for this save to be over, and its end, this save's
            # last writer again, would delete the partial directory again, with the next save's parts in it
            self._late_part(run, key, res, entry.rank, s.seq)
            return
        res.rank_seq[entry.rank] = s.seq
        self.slots.start_persist(s)
        res.writers += 1
        self.results.track(key)
        self.pending += 1
        self._submit_writer(run, key, (entry.rank, s, run, step, time.monotonic()))
        if key not in self.commits_started:
            self.commit_seq += 1
            self._start_commit(key, run, res, s.tracker_name, s.tracker_content,
                               self._tracker_gate(run.checkpoint_dir, s.tracker_name, self.commit_seq))

    def _submit_writer(self, run: Run, key: SaveKey, args: Tuple[Any, ...]) -> None:
        """Queue the writer task of a part of save ``key`` (``args``: :meth:`_write_part_task`'s), or park it
        while its directory is busy here (:meth:`_directory_busy`; called with the lock). A writer that waited on
        a writer thread held it: with a tag saved again before the ranks' parts of its previous save were all
        queued (the ranks hand their parts over at different times), the writers of the next save took every
        thread, and the parts they waited for never ran."""
        busy = self._directory_busy(run, key)
        if busy is None:
            self.pool.submit(self._write_part_task, *args)
            return
        log.info("step %d: rank %d's part waits for %s of %s to end", key[1], args[0], busy, key[2])
        self.parked.append((run, key, args))

    def _notify_ended(self) -> None:
        """A save, its last writer or a deletion of a failed save's partial directory ended (called with the
        lock): wake the waits for a directory and queue the parked writers whose directory is free now."""
        self.ended.notify_all()
        parked, self.parked = self.parked, []
        for run, key, args in parked:
            if self._directory_busy(run, key) is None:
                self.pool.submit(self._write_part_task, *args)
            else:
                self.parked.append((run, key, args))

    def _replace(self, run: Run, key: SaveKey) -> Result:
        """The record of a new save ``key`` that replaces the ended one, of the next generation (called with
        the lock): the peer notices still to come about the ended one (on another node than the committer's,
        its abort, when this node ended it on its own part's failure first) name the ended one's generation,
        and find its record (:meth:`on_notice`) while it is held: the earlier records are kept while
        :meth:`_needed`, and the one replaced now always (a rank that reconnects may still ask for it)."""
        old = self.results[key]
        res = self._aborted_ahead(key, Result(gen=old.gen + 1))
        self.results.push(key, res)
        # kept while a rank's handle may still ask for it (by its seq): a step saved three times answered the
        # first save's handle with the third save's outcome when only the last replaced save was kept
        # (and while a connected local rank took no part in it: its part may still come, _behind)
        self.results.keep_older(key, lambda r: r is old or self._needed(r, run) or (
            r.gen > 0 and bool(run.connected - r.participants())))
        self.commits_started.discard(key)
        return res

    def _persist_deferred(self, entry: RankEntry, step: int, run: Run, old: Result, s: Slot) -> None:
        """:meth:`persist` of a save that waited for the save ``old`` of its step and directory to be over
        (called with the lock, by :meth:`when_over`; ``s``: the rank's slot it saves, pinned meanwhile); if it
        cannot start, the rank hears ``old``'s failure, or (``old`` committed) why it could not start, from a
        failed record of its own snapshot (generation 0) kept with the earlier records of the key (:meth:`result`;
        ``old``'s handles still hear ``old``'s outcome)."""
        s.pins -= 1
        try:
            self.persist(entry, step, run, slot=s)
        except Exception as e:
            log.error("rank %d step %d: the save of it again could not start: %s", entry.rank, step, e)
            if old.state != "failed":  # its own record, found by its snapshot (result): the earlier save stands
                key = (run.run_id, step, s.dirname)
                rec = P.error_record(e)
                self.results.add_older(key, Result(gen=0, state="failed", error=rec, part_errors={entry.rank: rec},
                                                   rank_seq={entry.rank: s.seq}))
            old.deferred.discard(entry.rank)
            self.on_change()  # its waiting status request is answered with the failure
        else:
            old.deferred.discard(entry.rank)

    def stream(self, entry: RankEntry, s: Slot, run: Run, step: int, dirname: str, tracker_name: str,
               tracker_content: str, index_offset: int, index_nbytes: int, data_end: int) -> bool:
        """Start writing rank ``entry``'s part of ``step`` from slot ``s`` while the rank still copies into it
        (a streamed save, :mod:`snapckpt.persister.stream`), and the step's commit; its ``ready`` comes through
        :meth:`persist`. Returns ``False`` (nothing started) where the part cannot stream: a remote-only run, a
        slot that is not WRITING(``step``), an index outside the slot, a save of the same step and directory
        by this rank not yet over here (``ready`` then persists it as any save, or defers or refuses it), or a
        save whose commit is known here to have failed already (no part of it is written)."""
        if (run.remote_only or s.state != SlotState.WRITING or s.step != step or s.stream is not None
                or not 0 < data_end <= index_offset or index_offset + index_nbytes > s.nbytes):
            return False
        key = (run.run_id, step, dirname)
        res = self.results.get(key)
        if res is not None and entry.rank in res.participants():
            if res.state == "pending" or res.writers > 0:  # this rank's earlier save of the same step and
                # directory is not over here (its ready persists this one as any save, or defers or refuses it)
                return False
            res = self._replace(run, key)  # it ended: this one is a new save that replaces it (as persist())
        elif res is not None and self._behind(key, entry.rank) is not None:
            return False  # its part of an earlier save that ended without it (ready: persist() records it)
        if res is None:
            res = self._record(key)
        if self._commit_over(run, key):  # a late part of a failed save: none written (see persist())
            return False
        st = Stream(entry.rank, step, data_end)
        s.stream = st
        res.streams[entry.rank] = st
        res.writers += 1
        self.results.track(key)
        self.pending += 1
        self._submit_writer(run, key, (entry.rank, s, run, step, time.monotonic(), (st, dirname, index_offset,
                                                                                    index_nbytes)))
        if key not in self.commits_started:
            self.commit_seq += 1
            self._start_commit(key, run, res, tracker_name, tracker_content,
                               self._tracker_gate(run.checkpoint_dir, tracker_name, self.commit_seq))
        return True

    def fail_part(self, rank: int, run: Run, step: int, dirname: str, rec: Dict[str, Any]) -> None:
        """Rank ``rank``'s DISK save of ``(step, dirname)`` failed before it reached the persister (error
        record ``rec``), or the rank skipped it (no free slot: a :class:`SaveSkippedError` record): record it and
        drop a failure marker, so that the commit fails at once on every node with the cause instead of waiting
        for this rank's part until the timeout (a skip: every rank's save of it ends skipped).

        It is the rank's next save of them, as a part handed over would be (:meth:`persist`): a rank that took
        part in the newest save of them here fails the save after it (once that one is over here, if it is not
        yet); a rank behind (:meth:`_behind`) fails its part of the earlier save that already ended without it.
        So a rank that skips a save of a step saved again counts that save like every other rank. A rank whose
        snapshot copy failed (:meth:`~snapckpt.engine.saver.Saver._save_failed`) after it started streaming its part
        of the newest save here is that save's failure already (its cancelled stream fails the part): nothing more."""
        key = (run.run_id, step, dirname)
        with self.lock:
            self._prune(run)  # (before: never this save's own record, which its commit below needs)
            res = self.results.get(key)
            st = res.streams.get(rank) if res is not None else None
            if st is not None and st.seq is None and rank not in res.rank_seq:
                # its streamed part of that save, whose copy failed (Saver._save_failed): the abort cancelled the
                # stream, and its writer fails the part (a marker, the commit ends): this is that save's failure
                res.told.add(rank)
                return
            if res is not None and rank in res.participants():  # its save of them again
                if self._in_flight(key, res):  # starts once that save is over here (as persist() defers)
                    self.when_over(key, lambda: self.fail_part(rank, run, step, dirname, rec))
                    return
                res = self._replace(run, key)
            elif res is not None:
                old = self._behind(key, rank)
                if old is not None:  # that save ended without this rank's part: nobody waits for it
                    old.part_errors[rank] = rec
                    old.told.add(rank)
                    return
            res = self._record(key)
            res.part_errors[rank] = rec
            res.told.add(rank)  # its rank raised the error itself (or skipped): it never asks for this save
        res.part_ended.set()  # the commit's wait sees the failure now, not at its next peer check
        if run.world_size == 1:
            return  # nobody else waits for this save
        if len(run.local_ranks) < run.world_size and not self._commit_over(run, key):
            # ranks on other nodes learn it from a failure marker (none once the commit is over: see _commit_over)
            partial = os.path.join(run.checkpoint_dir, partial_dirname(dirname, run.run_id))
            write_failure_marker(open_storage(fsync=run.fsync), partial, rank=rank, run_id=run.run_id,
                                 step=step, exc=P.error_from_record(rec), gen=res.gen)
            self.part_done(run.run_id, step, dirname, [rank], res.gen)
        if key not in self.commits_started:
            self._start_commit(key, run, res, "", "", None)

    def _commit_over(self, run: Run, key: SaveKey) -> bool:
        """Whether the commit of save ``key`` is known here to have failed (called with the lock): it ended
        failed on this node (the commit, or this node's watch of it), or, on another node than the
        committer's, the committer's abort notice came. The committer then deletes, or has deleted, the
        partial directory: a part or failure marker written into it now would re-create it, nobody would
        delete it again (the committer's node only deletes after its own writers), and a later save of the
        same step in this run (a crash flush, a retried save) would count that stale part, or fail at once
        on that stale failure marker. Remote-only runs: never (their prefix is discarded on its own terms)."""
        if run.remote_only:
            return False
        res = self.results.get(key)
        return res is not None and (res.state == "failed" or (not run.committer and res.aborted_at is not None))

    def _start_commit(self, key: SaveKey, run: Run, res: Result, tracker_name: str, tracker_content: str,
                      tracker_gate: Optional[Callable[[Callable[[], None]], bool]]) -> None:
        """Queue the commit task of save ``key`` (once per save; called with the lock). ``tracker_name`` and
        ``tracker_content``: the tracker file it writes (``""``: none); ``tracker_gate``: see
        :meth:`_tracker_gate`."""
        self.commits_started.add(key)
        self.results.track(key)
        self._prune(run)
        _, step, dirname = key
        with self.committing_lock:
            mine = self.committing.setdefault(run.checkpoint_dir, {})
            mine[dirname] = mine.get(dirname, 0) + 1
        req = CommitRequest(checkpoint_dir=run.checkpoint_dir, dirname=dirname, step=step, run_id=run.run_id,
                            world_size=run.world_size, timeout_secs=run.commit_timeout_secs,
                            keep_last=run.keep_last, tracker_name=tracker_name, tracker_content=tracker_content,
                            tracker_gate=tracker_gate, local_failure=self._local_failure(key, run),
                            peer_check=self._peer_check(run), peer_tick_secs=self.watches[run.run_id].tick_secs,
                            wake=res.part_ended, in_flight=lambda: self._committing(run.checkpoint_dir),
                            committed_notice=self._committed_notice(key) if self.notices is not None else None,
                            own_parts=None if run.committer else self._own_parts(res),
                            gen=res.gen, failed_gens=None if run.remote_only else self._failed_gens(key))
        self.pending += 1
        self.commit_pool.submit(self._commit_task, req, run, self.commit_seq)

    def _committing(self, checkpoint_dir: str) -> List[str]:
        """The directory names of ``checkpoint_dir`` whose commits of this persister are not yet reported."""
        with self.committing_lock:
            return sorted(self.committing.get(checkpoint_dir, {}))

    def _committed(self, checkpoint_dir: str, dirname: str) -> None:
        """The commit of ``dirname`` in ``checkpoint_dir`` was reported (committed or failed)."""
        with self.committing_lock:
            mine = self.committing.get(checkpoint_dir, {})
            mine[dirname] = mine.get(dirname, 1) - 1
            if mine[dirname] <= 0:
                del mine[dirname]
            if not mine:
                self.committing.pop(checkpoint_dir, None)

    def part_done(self, run_id: str, step: int, dirname: str, ranks: List[int], gen: Optional[int] = None) -> None:
        """Parts of ``ranks`` of the save ended on this node (durable, or failed with their marker): the
        committer's node is told at once (a notice; never blocks). ``gen``: the save's generation (``None``:
        that of its record here, 1 without one)."""
        if self.notices is None:
            return
        if gen is None:
            with self.lock:
                res = self.results.get((run_id, step, dirname))
                gen = res.gen if res is not None else 1
        self.notices.part_done(run_id, step, dirname, gen, ranks)

    def on_notice(self, run_id: str, step: int, dirname: str, gen: int, aborted: bool = False,
                  committed: bool = False, removed: bool = False, error: Optional[Dict[str, Any]] = None) -> None:
        """A peer's notice about generation ``gen`` of save ``(run_id, step, dirname)``: wake its commit task,
        which reads the filesystem again. The notice goes to the record of that generation if it is held (the
        save's, or an earlier one still needed: a wait for its deletion runs, :meth:`_needed`); a notice about
        another save of the step (an earlier one no longer held; a later one this node has not started: its
        commit task reads the filesystem first when it starts) is dropped. ``aborted``: the committer's commit of it
        failed, which ends this node's watch of that commit even if a late part re-created the partial
        directory. ``committed``: the committer's commit of it ended committed (the watch ends committed even
        when retention has retired the directory before the watch read its manifest). ``removed``: the
        committer's deletion of its partial directory ended (:meth:`_await_removal_task`). ``error``: the failed
        commit's error record (a skipped save's), which this node's commit then ends with. An abort of a
        generation this node has no record of yet is kept for that record (:attr:`aborts_ahead`)."""
        with self.lock:
            key = (run_id, step, dirname)
            res = self.results.find(key, gen)
            newest = getattr(self.results.get(key), "gen", self.pruned_gens.get(key, 0))  # (0: none yet)
            if res is None and aborted and newest < gen:
                self._abort_ahead(key, gen, error, removed)  # a save this node's ranks have not handed over yet
            if res is not None:
                res.notices += 1
                if error is not None:
                    res.abort_error = error
                if aborted:
                    res.aborted_at = time.monotonic()
                if removed:
                    res.removed.set()
                if committed:
                    res.committed_at = time.monotonic()
                res.part_ended.set()

    def wake_run(self, run_id: str) -> None:
        """Wake every pending commit of ``run_id`` (a local rank died: its peer check answers at once)."""
        for key in self.results.live_of_run(run_id):  # (a save not in that index is not in flight)
            res = self.results[key]
            if res.state == "pending":
                res.part_ended.set()

    def release_if_over(self, run: Run) -> None:
        """Close ``run``'s commit-notice links (a thread and a socket per other node) once the run is over on
        this node: none of its local ranks is connected and none of its saves here is pending or still
        writing (called with the lock: when a rank leaves, when a commit or a part ends)."""
        if self.notices is None or run.connected:
            return
        for key in self.results.live_of_run(run.run_id):
            r = self.results[key]
            if r.state == "pending" or r.writers > 0:
                return
        self.notices.forget(run.run_id)

    def _peer_check(self, run: Run) -> Callable[..., None]:
        """The dead-peer check of ``run``'s commits (one :class:`PeerWatch` per run; called with the lock)."""
        watch = self.watches.get(run.run_id)
        if watch is None:
            def local_gone() -> Dict[int, Dict[str, Any]]:
                with self.lock:
                    return dict(run.gone)

            watch = PeerWatch(open_storage(), run.checkpoint_dir, run.run_id, run.peer_timeout_secs,
                              local_gone=local_gone,
                              own_lease=lease_name(min(run.local_ranks)) if run.local_ranks else None)
            self.watches[run.run_id] = watch
        return watch.check

    def pending_parts(self, run: Run, rank: int) -> Set[Tuple[int, str]]:
        """The saves ``(step, dirname)`` of ``run`` whose part of ``rank`` this node has accepted to write
        (its writer is queued, running or done; called with the lock)."""
        found = set()
        for key in self.results.of_run(run.run_id):  # (records pruned, _prune, are of saves long over)
            res = self.results[key]
            if (rank in res.rank_seq and rank not in res.late) or rank in res.parts_done or rank in res.part_errors:
                found.add(key[1:])
        return found

    def _local_failure(self, key: SaveKey, run: Optional[Run] = None) -> Callable[[], Optional[BaseException]]:
        """For the commit of ``key`` (its newest save's, now): the error of a local rank whose part of that save
        failed, or the committer's abort of it, if any (a save of the step again is another generation); on the
        committer's node of ``run``, once this persister stops accepting requests (:meth:`stop_accepting`), a
        :class:`CommitError` naming the local ranks that never handed their part over."""
        gen = getattr(self.results.get(key), "gen", 1)  # (none held: its first save's)

        def failure() -> Optional[BaseException]:
            with self.lock:
                res = self.results.find(key, gen)
                if res is None:
                    return None
                if self.stopping.is_set() and run is not None and run.committer and not res.part_errors:
                    never = sorted(r for r in run.local_ranks if r not in res.rank_seq)
                    if never:
                        return CommitError(
                            f"step {key[1]}: the persister was stopped (SIGTERM) before ranks {never} of this node "
                            f"handed over their part of {key[2]}; nothing of this save is committed and the "
                            "previous checkpoint stays loadable")
                if not res.part_errors:
                    if res.aborted_at is not None:
                        if res.abort_error is not None:  # a skipped save: every rank's ends skipped
                            exc = P.error_from_record(res.abort_error)
                            if isinstance(exc, SaveSkippedError):
                                return exc
                        return CommitError(f"step {key[1]}: the committer's node reports that the commit of "
                                           f"{key[2]} failed (see rank 0's error)")
                    return None
                errors = sorted(res.part_errors.items())  # a failure is said before a skip
                rank, rec = next(((r, e) for r, e in errors if e.get("type") != SaveSkippedError.__name__), errors[0])
            exc = P.error_from_record(rec)
            exc.snapckpt_rank = rank  # read by the commit's message
            return exc

        return failure

    def _failed_gens(self, key: SaveKey) -> Callable[[], Set[int]]:
        """For the commit of ``key`` (its newest save's, now): the generations of the earlier saves of ``key`` held
        here that failed (a part marker of one of them is stale: :func:`~snapckpt.persister.commit.collect_parts`)."""

        def failed() -> Set[int]:
            with self.lock:
                return {g for r in self.results.records(key) for g in self._failed_of(r)}

        return failed

    @staticmethod
    def _failed_of(res: Result) -> Set[int]:
        """The generations known failed by record ``res``: its own, if it failed, and those it dropped."""
        return res.failed_before | ({res.gen} if res.gen > 0 and res.state == "failed" else set())

    def _own_parts(self, res: Result) -> Callable[[], Optional[Dict[int, Dict[str, Tuple[int, str]]]]]:
        """For the watch of ``res``'s commit: the files of the parts this node wrote for it, ``None`` while a
        local rank's part of it has not ended (its commit cannot have happened yet). A manifest of the same run
        and step that does not list them is an earlier save's of the step (:func:`watch_commit`)."""

        def own() -> Optional[Dict[int, Dict[str, Tuple[int, str]]]]:
            with self.lock:
                if not set(res.rank_seq) <= set(res.part_files) | set(res.part_errors):
                    return None
                return dict(res.part_files)

        return own

    def _committed_notice(self, key: SaveKey) -> Callable[[], bool]:
        """For the watch of ``key``'s commit (its newest save's, now): whether the committer's node said it
        ended committed."""
        gen = getattr(self.results.get(key), "gen", 1)  # (none held: its first save's)

        def committed() -> bool:
            with self.lock:
                res = self.results.find(key, gen)
                return res is not None and res.committed_at is not None

        return committed

    def _tracker_gate(self, checkpoint_dir: str, tracker_name: str, seq: int):
        """A gate that lets the commit of request ``seq`` write its tracker only if no later request of the
        same tracker file has written it already (commits run in parallel and may finish out of order). The
        gate returns whether it wrote (``False``: the save is behind a later one)."""
        key = (checkpoint_dir, tracker_name)

        def gate(write) -> bool:
            with self.tracker_lock:
                if self.tracker_seq.get(key, 0) > seq:
                    log.info("%s not moved back to an older save (request %d)", tracker_name, seq)
                    return False
                write()
                self.tracker_seq[key] = seq
                return True

        return gate

    # --------------------------------------------------------------------------------------- tasks
    def _write_part_task(self, rank: int, s: Slot, run: Run, step: int, queued: float,
                         streamed: Optional[Tuple[Stream, str, int, int]] = None) -> None:
        """Write rank ``rank``'s part of ``step`` from slot ``s`` (READY, or WRITING for a part ``streamed``:
        ``(its stream, dirname, index offset, index bytes)``), then hand it to the part syncer."""
        storage = None if run.remote_only else open_storage(fsync=run.fsync, part=(rank, step))
        # once on_data_read released the slot, the rank may fill it with a newer snapshot: never read the
        # slot's fields after that (they describe the new one)
        stream = streamed[0] if streamed is not None else None
        dirname = streamed[1] if streamed is not None else s.dirname
        key, seq = (run.run_id, step, dirname), [s.seq if stream is None else None]  # a stream's: at its ready
        partial = _partial(run, dirname)
        t0 = time.monotonic()
        log.debug("rank %d step %d: writing the part (queued %.3f s%s)", rank, step, t0 - queued,
                  ", streamed" if stream is not None else "")
        stages = {"queued": t0 - queued}

        def ended(files: Optional[Dict[str, Any]], exc: Optional[BaseException]) -> None:
            self._part_ended(key, rank, s, seq[0], run, step, storage, partial, t0, files, exc, stages, stream)

        def data_read() -> None:
            with self.lock:
                if stream is not None and s.stream is stream:
                    s.stream = None
                self.slots.release(s)

        try:
            buf = _slot_map(s)
            try:
                if stream is None:
                    index = read_index(buf, s.path)
                else:
                    index = read_index_at(buf, streamed[2], streamed[3], step, s.path)
                    stream.attach(buf)
                if index["step"] != step:
                    raise PersisterError(f"slot {s.index} of rank {rank} holds step {index['step']}, not {step}")
                self._wait_for_directory(run, key, f"rank {rank}'s part")
                with self.lock:
                    over = self._commit_over(run, key)
                    mine = self.results.get(key)  # (this part's record: a save in flight is never replaced)
                    gen, flush = (mine.gen, mine.flush) if mine is not None else (None, False)
                if over:  # never re-create the partial directory the committer deleted (or is deleting)
                    raise _CommitOver(f"step {step}: the commit of {dirname} already failed (see rank 0's error); "
                                      f"rank {rank}'s part of it is not written")
                if run.remote_only:  # straight from the slot to the object store
                    files = write_part_remote(store_for(run.checkpoint_dir), buf, index, s.dirname, rank=rank,
                                              run_id=run.run_id, step=step, on_data_read=lambda: self.slots.release(s))
                else:
                    written = write_part_data(storage, buf, index, partial, rank=rank, run_id=run.run_id,
                                              step=step, on_data_read=data_read,
                                              gate=stream.wait if stream is not None else None, gen=gen, flush=flush)
                stages["data"] = time.monotonic() - t0
            finally:
                if stream is not None:
                    stream.detach()
                del buf
            if stream is not None:  # no fsync and no marker before the rank handed the slot over
                try:
                    seq[0] = stream.wait_ready()
                except BaseException:
                    written.close()
                    raise
                stages["ready"] = time.monotonic() - t0
            if not run.remote_only:  # fsyncs and marker with the other parts ready on this node (part_sync.py)
                synced = self.syncer.submit(written)
        except BaseException as e:
            ended(None, e)
            return
        if run.remote_only:
            ended(files, None)
            return

        def done(f: cf.Future) -> None:
            exc = f.exception()
            ended(None if exc is not None else f.result(), exc)

        synced.add_done_callback(done)

    def _part_ended(self, key: SaveKey, rank: int, s: Slot, seq: Optional[int], run: Run, step: int, storage,
                    partial: str, t0: float, files: Optional[Dict[str, Any]], exc: Optional[BaseException],
                    stages: Optional[Dict[str, float]] = None, stream: Optional[Stream] = None) -> None:
        """Record the end of rank ``rank``'s part of ``step``: its files and marker durable (``files``), or
        its error ``exc`` (recorded in memory, then as a failure marker). ``stages``: seconds the part was
        queued before its writer started and spent writing its data (for the log). ``seq``: the slot's
        snapshot the part came from (``None``: a streamed part whose copy never completed); ``stream``: the
        part's stream, no longer reading the slot now."""
        try:
            if exc is None:
                total, st = time.monotonic() - t0, stages or {}
                nbytes = sum(f["nbytes"] for f in files.values())
                data = st.get("data", total)
                log.info("rank %d step %d: part written, %d bytes in %.3f s (queued %.3f s before; data %.3f s, "
                         "%.2f GB/s%s; fsyncs and marker %.3f s)", rank, step, nbytes, total, st.get("queued", 0.0),
                         data, nbytes / data / 1e9 if data > 0 else 0.0,
                         f", streamed, copy done at {st['ready']:.3f} s" if "ready" in st else "",
                         total - st.get("ready", data))
                with self.lock:
                    res = self.results[key]
                    res.parts_done.add(rank)
                    res.part_files[rank] = {n: (int(f["nbytes"]), str(f[CHECKSUM])) for n, f in files.items()}
            elif isinstance(exc, _CommitOver):  # not a failure of its own: the rank gets the commit's error
                log.info("rank %d step %d: %s", rank, step, exc)
            else:
                log.error("rank %d step %d: writing the part failed: %s", rank, step, exc)
                self.failed = True
                with self.lock:  # recorded before the marker: the commit it ends must not win the race
                    mine = self.results[key]
                    mine.part_errors[rank] = P.error_record(exc)
                    over = self._commit_over(run, key)
                if storage is not None and not over:  # remote-only: one node, its commit reads part_errors
                    write_failure_marker(storage, partial, rank=rank, run_id=run.run_id, step=step, exc=exc,
                                         gen=mine.gen)
        finally:
            with self.lock:
                if stream is not None:
                    if s.stream is stream:
                        s.stream = None  # its writer no longer reads the slot: it may be handed out again
                    if seq is None:  # failed before it waited for ready: ready may still have made it PERSISTING
                        seq = stream.seq
                if seq is not None:
                    self.slots.finish_persist(s, seq)
                res = self.results.get(key)
                if res is not None:
                    res.writers -= 1
                    res.part_ended.set()
                    if res.writers == 0 and not run.committer and not run.remote_only:
                        self.part_done(run.run_id, step, key[2], sorted(set(res.parts_done) | set(res.part_errors)),
                                       res.gen)
                    self._remove_failed_partial(run, res, key)
                    self._run_over_calls(key, res)
                self._notify_ended()
                self.pending -= 1
                self.release_if_over(run)
            if exc is not None:
                self.on_change()

    def _commit_task(self, req: CommitRequest, run: Run, seq: int) -> None:
        """Commit ``req`` (``seq``: its request order, :meth:`_tracker_gate`'s), then queue its upload."""
        if not run.remote_only:  # an earlier save's partial directory: its markers and files are not ours
            self._wait_for_directory(run, (req.run_id, req.step, req.dirname), "its commit")
        storage = open_storage(fsync=run.fsync, part=(None, req.step))
        retired: List[str] = []
        late: List[str] = []  # this checkpoint, if its retention kept it only while its commit was in flight
        t0 = time.monotonic()
        try:
            if run.remote_only:  # one node: its persister is the committer
                commit_remote(store_for(run.checkpoint_dir), req)
            elif run.committer:
                manifest = commit(storage, storage, req, remove_partial_on_failure=False, defer_deletion=retired,
                                  late=late)
                if run.remote_dir:  # in the background: neither the commit's answer nor training waits
                    with self.lock:
                        self.pending += 1
                    self.uploader.submit(UploadJob(run.run_id, run.remote_dir, req.final_dir, req.dirname,
                                                   manifest, req.keep_last, req.tracker_name,
                                                   req.tracker_content, order=seq))
            else:
                watch_commit(storage, req)
            state, err = "committed", None
        except SaveSkippedError as e:  # a rank had no free slot: nothing committed, every rank hears "skipped"
            log.warning("step %d: save of %s skipped: %s", req.step, req.dirname, e)
            state, err = "failed", P.error_record(e)
        except BaseException as e:
            log.error("step %d: commit failed: %s", req.step, e)
            self.failed = True
            state, err = "failed", P.error_record(e)
        delivery: Optional[_Delivery] = None
        with self.lock:
            res = self.results[(req.run_id, req.step, req.dirname)]
            res.state, res.error = state, err
            notices = res.notices
            # retired once reported only when a later save of this run committed before it: a commit that merely
            # sorts behind an earlier run's checkpoint in save order (a clock ahead) is the newest save
            behind = bool(late) and self.committed_seq.get(run.checkpoint_dir, 0) > seq
            if state == "committed":
                self.committed_seq[run.checkpoint_dir] = max(seq, self.committed_seq.get(run.checkpoint_dir, 0))
            if behind and run.multi_node:  # the other nodes' watches may not have read its manifest yet
                delivery = _Delivery()
            if run.committer and self.notices is not None:
                more: Dict[str, Any] = {"delivered": delivery.report} if delivery is not None else {}
                if err is not None and err["type"] == SaveSkippedError.__name__:  # the other nodes' ranks: skipped
                    more["error"] = {"type": err["type"], "message": err["message"]}
                self.notices.commit_ended(req.run_id, req.step, req.dirname, res.gen, state, **more)
            elif delivery is not None:
                delivery.report(False)
            self._remove_failed_partial(run, res, (req.run_id, req.step, req.dirname))
            self._run_over_calls((req.run_id, req.step, req.dirname), res)
            self._notify_ended()
        self._committed(run.checkpoint_dir, req.dirname)
        self.on_change()
        if run.multi_node:  # what the commit path cost: read by tests/test_multinode.py (no fast polling)
            log.info("step %d: commit %s after %.3f s (%s): %d filesystem checks, %d wakes, %d peer notices",
                     req.step, state, time.monotonic() - t0, "committer, checks: listings of the partial "
                     "directory" if run.committer else "watcher, checks: manifest reads", req.stats["listings"],
                     req.stats["wakes"], notices)
        if behind and delivery is not None and not delivery.wait(NOTICE_DELIVERY_SECS):
            # a watcher without the notice ends only on its manifest: left for the next commit's retention
            log.info("step %d (%s): kept past keep_last=%s until a next commit: its committed notice did not "
                     "reach every other node", req.step, req.dirname, run.keep_last)
        elif behind:  # it ended behind later saves' commits: in place until its answer (contract 5), not after
            try:
                retire_after_answer(storage, storage, req, defer_deletion=retired)
            except OSError as e:
                log.warning("retention after step %d's late commit failed: %s", req.step, e)
        for path in retired:  # after the commit is reported: deleting GiBs takes a while
            try:
                storage.remove_tree(path)
            except OSError as e:
                log.warning("retention: could not delete %s: %s", path, e)
        if run.remote_only and state == "committed":  # the store answers again: what failed saves left
            with self.lock:
                for dirname in sorted(self.undiscarded.get(run.checkpoint_dir, set())):
                    self._discard_remote(run.checkpoint_dir, dirname)
        with self.lock:
            self.pending -= 1
            self.release_if_over(run)

    def _remove_failed_partial(self, run: Run, res: Result, key: SaveKey) -> None:
        """On the committer, once a step's commit failed and this node's writers of it are done, delete
        its partial directory, then tell the other nodes (called with the lock; the deletion runs without
        it: a slow filesystem must not hold every rank's request and the lease heartbeat). On another node,
        at that moment, start waiting for the committer's deletion (:meth:`_await_removal_task`): its ranks
        share the directory. A writer or commit of a later save of the same directory waits until the
        deletion has ended (:meth:`_wait_for_directory`)."""
        if res.state != "failed" or res.writers > 0:
            return
        partial = _partial(run, key[2])
        if run.remote_only:  # the prefix in the store, unless a manifest made it a checkpoint
            self._discard_remote(run.checkpoint_dir, os.path.basename(partial))
            return
        done = self.discarding[(run.checkpoint_dir, key[2])] = threading.Event()  # the newest is waited for
        self.pending += 1
        if run.committer:
            self.remove_pool.submit(self._remove_partial_task, run, key, res.gen, partial, done)
        else:  # (a thread: it may wait a commit timeout for a committer that never says it, and must not
            # hold up the next directory's wait behind it)
            res.awaiting_removal = True
            threading.Thread(target=self._await_removal_task, args=(run, res, key, partial, done), daemon=True,
                             name="snapckpt-await-removal").start()

    def _remove_partial_task(self, run: Run, key: SaveKey, gen: int, partial: str, done: threading.Event) -> None:
        try:
            faults.point("commit.remove_failed_partial", step=key[1], rank=None)
            open_storage().remove_tree(partial)
        except Exception as e:
            log.warning("could not remove %s after a failed commit: %s: %s", partial, type(e).__name__, e)
        finally:
            # the watchers see the abort at once, and the other nodes' next saves of this directory, which
            # wait for this deletion, go on (as this node's do, even when it failed)
            if self.notices is not None:
                self.notices.commit_ended(run.run_id, key[1], key[2], gen, "removed")
            self._deletion_ended(run, key, done)

    def _await_removal_task(self, run: Run, res: Result, key: SaveKey, partial: str, done: threading.Event) -> None:
        """Another node than the committer's, once save ``key`` failed here and this node's writers of it
        ended: wait until the committer's node has deleted its partial directory, which this node's ranks
        share. This node's ranks may hear of the failure first (a failure marker, the committer's abort
        notice, their own part), and a next save of the directory that wrote meanwhile lost its files to
        that deletion. It ends on the committer's ``removed`` notice of that save's generation (``res.removed``;
        ``res`` may be an earlier record of ``key`` by then, held while it waits: :meth:`on_notice`); a lost
        notice: on the directory seen gone, or holding a marker of another save of the run (another step's, or a
        later generation's of this step: a later save, which waited for the deletion, re-created it; a directory
        being deleted may show no marker, never another save's), read every
        :data:`~snapckpt.persister.commit.BACKSTOP_SECS`; at the latest after ``run.commit_timeout_secs`` (a
        committer that never deletes it: its node was lost). Then this node's own parts of that save written after
        the deletion go (:meth:`_remove_stale_parts`)."""
        deadline = time.monotonic() + run.commit_timeout_secs
        reader = open_storage()
        try:
            while not res.removed.is_set():
                saves = _marker_saves(reader, partial, run.run_id)
                if saves is None or any(step != key[1] or (gen or 0) > res.gen for step, gen in saves):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("step %d: %s is still there %g s after its commit failed; later saves of %s go on",
                                key[1], partial, run.commit_timeout_secs, key[2])
                    break
                res.removed.wait(min(BACKSTOP_SECS, left))
            self._remove_stale_parts(reader, res, key, partial)
        finally:
            with self.lock:
                res.awaiting_removal = False
            self._deletion_ended(run, key, done)

    def _remove_stale_parts(self, reader, res: Result, key: SaveKey, partial: str) -> None:
        """Another node than the committer's, once the committer's deletion of failed save ``res``'s partial
        directory is known ended (or given up on, :meth:`_await_removal_task`): delete what this node's parts of that
        save wrote there after it (a
        writer that started before this node heard of the abort re-created the directory: its files and marker would
        stay until the job's next start). Only the files that this node's own markers of that save (its generation)
        list, then those markers: a later save of the directory may have re-created it meanwhile (its markers name
        another generation; this node's own next parts wait for this task: ``discarding``). The emptied directories
        stay: removing one could pull it from under another node's writer between its ``makedirs`` and its files.
        Never raises (what cannot be deleted stays until the next start, :func:`recover_interrupted_commits`)."""
        with self.lock:
            ranks = sorted(set(res.parts_done) | set(res.part_errors))
        gone = []
        for rank in ranks:
            for marker in (part_marker_name(rank), fail_marker_name(rank)):
                path = os.path.join(partial, marker)
                try:
                    rec = json.loads(reader.read_bytes(path))
                except (OSError, ValueError):
                    continue  # none (the usual case: written before the deletion, deleted with it)
                if not (isinstance(rec, dict) and rec.get("run_id") == key[0] and rec.get("step") == key[1]
                        and rec.get("gen") == res.gen):
                    continue
                files = rec.get("files") if isinstance(rec.get("files"), dict) else {}
                for name in [*files, marker]:
                    try:
                        os.unlink(os.path.join(partial, validate_file_name(name) if name != marker else name))
                        gone.append(name)
                    except (OSError, ValueError):
                        pass
        if gone:
            log.info("step %d: removed %s from %s: parts of the failed save %d written after the committer deleted "
                     "its partial directory", key[1], ", ".join(gone), partial, res.gen)

    def _deletion_ended(self, run: Run, key: SaveKey, done: threading.Event) -> None:
        """The deletion ``done`` of save ``key``'s partial directory ended (or, on another node, is known to
        have ended): the later saves of that directory go on."""
        with self.lock:
            if self.discarding.get((run.checkpoint_dir, key[2])) is done:
                del self.discarding[(run.checkpoint_dir, key[2])]
            done.set()
            self._notify_ended()
            self.pending -= 1
            self.release_if_over(run)

    def _wait_for_directory(self, run: Run, key: SaveKey, who: str) -> None:
        """Wait until save ``key`` may use its directory's partial directory on this node (``who``: the
        writer or commit task, for the log): no other save of that directory in this run is in flight here
        (its commit not ended, or a writer of it still running), and no deletion of a failed save's partial
        directory is under way (``discarding``).

        Why: a rank may hear that its save failed before that save is over on its node (its own part failed
        while the commit or another rank's writer goes on; a failure the client raised itself,
        :meth:`fail_part`), and the failed save's partial directory is deleted only once it is over
        (:meth:`_remove_failed_partial`). A next save of the same directory (a fixed tag, a retried step)
        that wrote meanwhile lost its files to that deletion. A crash flush under a tag whose DISK save is
        still in flight would share its partial directory the same way. Only the saves recorded before
        ``key``'s (``results`` keeps that order: creation numbers) are waited for: the waits cannot form a
        cycle. Reads only the in-flight index of the directory, not every record held."""
        told = False
        with self.lock:
            while True:
                busy = self._directory_busy(run, key)
                if busy is None:
                    return
                if not told:
                    told = True
                    log.info("step %d: %s waits for %s of %s to end", key[1], who, busy, key[2])
                self.ended.wait(BACKSTOP_SECS)  # (notified; the timeout only re-checks)

    def _earlier(self, key: SaveKey) -> List[int]:
        """The steps of the saves of ``key``'s run and directory in flight here and recorded before ``key``'s
        (all held if ``key`` has no record), oldest first: what :meth:`_wait_for_directory` waits for (called
        with the lock). Reads the in-flight index of that directory only."""
        mine = self.results.order(key)
        return [k[1] for n, k in self.results.live_of(key[0], key[2])
                if k != key and (mine is None or n < mine) and self._in_flight(k, self.results[k])]

    def _directory_busy(self, run: Run, key: SaveKey) -> Optional[str]:
        """What save ``key`` waits for before it may use its partial directory on this node (see
        :meth:`_wait_for_directory`; called with the lock): ``"the save of step N"``, ``"the deletion of a failed
        save"``, or ``None``: nothing."""
        earlier = self._earlier(key)
        if earlier:
            return f"the save of step {earlier[0]}"
        if (run.checkpoint_dir, key[2]) in self.discarding:
            return "the deletion of a failed save"
        return None

    def _discard_remote(self, url: str, dirname: str) -> None:
        """Remote-only: delete the prefix ``dirname`` of a failed save and abort its multipart uploads, in the
        background (called with the lock; the store calls run without it: a sick store retries for minutes,
        and the lock serves every rank's requests). When the store fails (it may be why the save failed), the
        prefix is remembered and tried again after the next commit; a save of the same prefix that starts
        meanwhile writes only once the discard has ended."""
        if (url, dirname) in self.discarding:
            return
        self.discarding[(url, dirname)] = threading.Event()
        self.pending += 1
        self.commit_pool.submit(self._discard_task, url, dirname)

    def _discard_task(self, url: str, dirname: str) -> None:
        with self.lock:  # a save of this prefix already under way: its own commit or failure decides
            busy = any(self.results[k].state == "pending" or self.results[k].writers > 0
                       for k in self.results.live_of_dir(dirname))
        err: Optional[BaseException] = None
        if not busy:
            try:
                store_for(url).discard_uncommitted(dirname)
            except Exception as e:
                err = e
        with self.lock:
            if err is not None or busy:
                self.undiscarded.setdefault(url, set()).add(dirname)
            else:
                self.undiscarded.get(url, set()).discard(dirname)
            self.discarding.pop((url, dirname)).set()
            self._notify_ended()
            self.pending -= 1
        if err is not None:
            log.warning("could not remove %s/%s after a failed save: %s: %s; tried again after the next commit",
                        url, dirname, type(err).__name__, str(err)[:300])


# How long a late commit's task waits for its committed notice to be sent to every other node before it
# retires the commit (seconds; a link's connect and send time out at 5 s each, tried twice): past it the
# commit is left for the next commit's retention
NOTICE_DELIVERY_SECS = 10.0


class _Delivery:
    """Whether a commit's committed notice was sent to every other node (``CommitNotices.commit_ended``'s
    ``delivered``): :meth:`wait` returns ``True`` only then."""

    def __init__(self) -> None:
        self.event, self.sent = threading.Event(), False

    def report(self, sent: bool) -> None:
        self.sent = sent
        self.event.set()

    def wait(self, secs: float) -> bool:
        return self.event.wait(secs) and self.sent


def _partial(run: Run, dirname: str) -> str:
    """Where the parts of ``dirname`` are written before the commit: the hidden partial directory, or in
    remote-only mode the final prefix itself (``<url>/<dirname>``: no rename in an object store)."""
    if run.remote_only:
        return f"{run.checkpoint_dir}/{dirname}"
    return os.path.join(run.checkpoint_dir, partial_dirname(dirname, run.run_id))


def _marker_saves(reader, partial: str, run_id: str) -> Optional[Set[Tuple[int, Optional[int]]]]:
    """``(step, generation)`` of the saves of run ``run_id`` whose part or failure markers the partial directory
    ``partial`` holds (generation ``None``: the marker names none; ``None``: the directory is gone; what cannot be
    read counts as nothing)."""
    side = os.path.join(partial, SIDECAR)
    try:
        if not reader.isdir(partial):
            return None
        names = [n for n in reader.listdir(side) if n.endswith(".json") and n.startswith(("part_", "fail_"))]
    except OSError:
        return set()
    saves: Set[Tuple[int, Optional[int]]] = set()
    for name in names:
        try:
            rec = json.loads(reader.read_bytes(os.path.join(side, name)))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("run_id") == run_id and isinstance(rec.get("step"), int):
            gen = rec.get("gen")
            saves.add((rec["step"], gen if isinstance(gen, int) else None))
    return saves


def _slot_map(s: Slot):
    """The writers' mapping of slot ``s``, made once per slot size and kept: mapping it afresh for every
    persist costs a page fault per 4 KiB page read (about 0.3-0.7 s per GiB on this VM). Only the writer
    of ``s`` calls this (one at a time: the slot is PERSISTING)."""
    if s.mapping is None or len(s.mapping) != s.nbytes:
        if s.mapping is not None:
            try:
                s.mapping.close()
            except BufferError:  # a view is still alive; it goes with its last reference
                pass
        s.mapping = map_slot(s.path, s.nbytes)
    return s.mapping
