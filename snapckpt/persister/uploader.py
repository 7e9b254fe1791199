"""The persister's uploader: committed DISK checkpoints copied to the remote tier in the background.

After the committer's local commit of a step (:mod:`snapckpt.persister.commit`) the scheduler hands the
committed directory to :meth:`Uploader.submit`; one uploader thread per persister uploads one checkpoint
at a time (its files in parallel) with :meth:`snapckpt.storage.remote.RemoteStore.upload`, then runs the
remote retention. Nothing waits for it: not training, not the next DISK save, not the commit's answer.

Uploads go in the order the saves were requested (:attr:`UploadJob.order`), not the order their commits
ended: commits run in parallel and a later one may end first. A checkpoint that arrives after a later one of
the same run is queued before it when that one still waits; when that one was already uploaded, the older
one is uploaded without moving the remote tracker object back (the local tracker's rule: it only moves
forward in request order). The same holds across persisters (the store's rule, by the manifests' save time):
after a restart that put rank 0 on another node the previous committer's persister may still upload its
queue while the new committer uploads. The queue is bounded (:data:`QUEUE_DEPTH` checkpoints waiting): when
a new checkpoint arrives and the queue is full, the oldest one is dropped (a newer one will be uploaded instead). A dropped upload, and an
upload that failed after :data:`RETRIES` retries with backoff, is a warning or error in the persister's
log and a note that the ranks' next status request carries; the Checkpointer turns each note into an
``upload_skipped`` / ``upload_failed`` :class:`~snapckpt.events.Event`. The first upload of a run that
succeeds after a failed one is an ``uploaded`` note (no event): rank 0 logs that the remote tier caught up.
The local tier is never touched.

The first job of a remote directory in this persister deletes what interrupted uploads left there
(:meth:`~snapckpt.storage.remote.RemoteStore.clean_orphans`): only one persister per job uploads (the
committer's), and a new one usually starts after the previous one is gone. When rank 0 moved to another node
on a restart, the previous committer's persister may still upload: an upload of its that the clean-up removed
fails its read-back and is retried (:meth:`~snapckpt.storage.remote.RemoteStore.upload`). That job (queued
when the committer connects) then **catches up**: the newest checkpoints committed in ``checkpoint_dir`` but
not in the remote tier (a persister killed after a local commit, before or during its upload) are uploaded,
those saved after the newest remote checkpoint only (save order, as retention's: after a rewind a lower step
can be newer), at most :data:`QUEUE_DEPTH` + 1 (and ``keep_last``) of them.

A checkpoint whose local directory disappears before or during its upload (local retention retired it), or
holds another commit by then (a later save of the same name: a fixed tag saved again), is skipped cleanly (``upload_skipped``, what it had sent is removed), unless an attempt had already failed (an
outage while saves come faster than the retries): then it is an ``upload_failed`` naming that failure. Any
other error, a network fault or a transient read error of a local file alike, is retried.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple

from snapckpt.ondisk.manifest import MANIFEST, list_committed, save_order
from snapckpt.storage.factory import open_storage

if TYPE_CHECKING:  # imported where a store is made: a persister without a remote tier never needs it
    from snapckpt.storage.remote import RemoteStore

__all__ = ["Uploader", "UploadJob", "NOTES_KEPT", "QUEUE_DEPTH", "RETRIES"]

log = logging.getLogger("snapckpt.persister")

#: Checkpoints waiting for upload (beyond the one being uploaded); the oldest is dropped past it.
QUEUE_DEPTH = 2
#: Notes kept per run, the newest (:meth:`Uploader.notes_window`): every status reply carries them, so a run whose
#: uploads fail for days must not grow each reply with every failure since the start.
NOTES_KEPT = 256
#: Retries of a failed upload (backoff 1, 2, 4... seconds) before it is given up.
RETRIES = 3
BACKOFF_SECS = 1.0


@dataclass
class UploadJob:
    """One committed checkpoint to upload (``manifest`` is ``None`` for a clean-up job, which also catches
    up the checkpoints of ``checkpoint_dir`` that the remote tier lacks when ``checkpoint_dir`` is set)."""

    run_id: str
    remote_dir: str
    local_dir: str
    dirname: str
    manifest: Optional[Dict[str, Any]]
    keep_last: Optional[int]
    tracker_name: str = ""
    tracker_content: str = ""
    checkpoint_dir: str = ""
    #: a clean-up job catches up only checkpoints committed before this time (Unix seconds): those of the
    #: run that queued it are submitted by their own commits (and may be dropped from the queue on purpose)
    before_unix: float = 0.0
    #: the persister's request order of the save (its local tracker gate's); what a clean-up job catches up
    #: gets the order of the upload that last wrote the tracker object (it was saved after every remote one)
    order: int = 0


class Uploader:
    """The upload queue and its thread.

    Args:
        on_done: called with no argument (from the uploader thread) each time a submitted job ends,
            uploaded, failed or dropped: the scheduler's count of pending work.
    """

    def __init__(self, on_done) -> None:
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: Deque[UploadJob] = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._stores: Dict[str, RemoteStore] = {}
        self._cleaned: Set[str] = set()
        self._stop = False
        self.notes: Dict[str, List[Dict[str, Any]]] = {}  # run id -> upload_skipped/upload_failed/uploaded notes
        self.notes_dropped: Dict[str, int] = {}  # run id -> its notes dropped from the front (NOTES_KEPT)
        self._failing: Set[str] = set()  # run ids whose last upload that ended failed
        self._current: Optional[Tuple[UploadJob, float]] = None  # the job the thread runs, since (monotonic s)
        # (remote_dir, tracker name) -> the order of the upload that last wrote that tracker object
        self._tracker_order: Dict[Tuple[str, str], int] = {}

    def submit(self, job: UploadJob) -> None:
        """Queue ``job`` before the waiting checkpoints requested after it; drop the oldest checkpoint (by
        request order, ``job`` included) when :data:`QUEUE_DEPTH` are waiting."""
        dropped: Optional[UploadJob] = None
        with self._cond:
            waiting = [j for j in self._queue if j.manifest is not None]
            if job.manifest is not None and len(waiting) >= QUEUE_DEPTH:
                dropped = min(waiting + [job], key=lambda j: j.order)
                if dropped is not job:
                    self._queue.remove(dropped)
            if dropped is not job:
                later = [i for i, j in enumerate(self._queue) if j.manifest is not None and j.order > job.order]
                if job.manifest is not None and later:
                    self._queue.insert(later[0], job)
                else:
                    self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="snapckpt-uploader", daemon=True)
                self._thread.start()
            self._cond.notify()
        if dropped is not None:
            newest = max(waiting + [job], key=lambda j: j.order)
            current, busy = self._current or (None, 0.0)
            behind = "" if current is None or current.manifest is None else (
                f" behind the upload of step {current.manifest['step']}, running for "
                f"{time.monotonic() - busy:.0f} s: the store may be slow or not answering")
            reason = (f"the upload queue was full ({QUEUE_DEPTH} waiting{behind}); step {newest.manifest['step']} "
                      "will be uploaded instead")
            log.warning("remote: upload of step %d (%s) to %s skipped: %s", dropped.manifest["step"],
                        dropped.dirname, dropped.remote_dir, reason)
            self._note(dropped, "upload_skipped", reason)
            self._on_done()

    def shutdown(self) -> None:
        """Let the queued uploads finish, then stop the thread (at exit)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def notes_for(self, run_id: str) -> List[Dict[str, Any]]:
        """The newest :data:`NOTES_KEPT` notes of run ``run_id``, oldest first."""
        return self.notes_window(run_id)[1]

    def notes_window(self, run_id: str) -> Tuple[int, List[Dict[str, Any]]]:
        """``(number of notes of run_id dropped before the first one given, the newest NOTES_KEPT notes)``: a rank
        that has seen ``n`` notes in all reads the new ones from position ``n - dropped``."""
        with self._cond:
            return self.notes_dropped.get(run_id, 0), list(self.notes.get(run_id, ()))

    def _note(self, job: UploadJob, kind: str, reason: str) -> None:
        with self._cond:
            if kind == "upload_failed":
                self._failing.add(job.run_id)
            elif kind == "uploaded":
                if job.run_id not in self._failing:
                    return  # only a recovery is news: the list stays as long as the failures made it
                self._failing.discard(job.run_id)
            notes = self.notes.setdefault(job.run_id, [])
            notes.append({"kind": kind, "step": job.manifest["step"] if job.manifest else -1, "reason": reason})
            if len(notes) > NOTES_KEPT:
                self.notes_dropped[job.run_id] = self.notes_dropped.get(job.run_id, 0) + len(notes) - NOTES_KEPT
                del notes[:-NOTES_KEPT]

    def _store(self, url: str) -> RemoteStore:
        store = self._stores.get(url)
        if store is None:
            from snapckpt.storage.remote import RemoteStore

            store = self._stores[url] = RemoteStore(url)
        return store

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._current = (job, time.monotonic())
            try:
                self._do(job)
            except BaseException as e:  # never let the thread die: the queue would stall
                log.error("remote: unexpected error in the uploader: %s", e)
            finally:
                with self._cond:
                    self._current = None
                self._on_done()

    def _do(self, job: UploadJob) -> None:
        try:
            store = self._store(job.remote_dir)
        except Exception as e:
            log.error("remote: %s", e)
            if job.manifest is not None:
                self._note(job, "upload_failed", str(e))
            return
        if job.remote_dir not in self._cleaned:
            try:
                removed = store.clean_orphans()
                self._cleaned.add(job.remote_dir)
                if removed:
                    log.warning("remote: removed %d interrupted upload(s) under %s: %s", len(removed),
                                job.remote_dir, removed)
            except Exception as e:
                log.warning("remote: could not clean interrupted uploads under %s: %s", job.remote_dir, e)
        if job.manifest is None:
            if job.checkpoint_dir:
                self._catch_up(store, job)
            return
        self._upload(store, job)

    def _catch_up(self, store: RemoteStore, job: UploadJob) -> None:
        """Upload the newest checkpoints committed in ``job.checkpoint_dir`` before ``job.before_unix`` that
        were saved after the newest remote one (an earlier persister was killed after their local commit,
        before or during the upload, or their upload failed; what that upload left was just removed), oldest
        first by save order (not by step: a rewind), so the tracker object ends at the newest, as the local
        tracker does."""
        try:
            remote = store.list_committed()
            local = list_committed(open_storage(), job.checkpoint_dir)
        except Exception as e:  # the next commit's upload still happens
            log.warning("remote: could not compare %s with %s for uploads to catch up: %s", job.checkpoint_dir,
                        job.remote_dir, e)
            return
        # newer means saved later (retention's and the tracker's order), not a higher step: after a rewind
        # the lower steps saved last are the ones to catch up, and the tracker object must end at them
        newest = max((save_order(c.manifest) for c in remote), default=float("-inf"))
        limit = QUEUE_DEPTH + 1 if job.keep_last is None else max(1, min(job.keep_last, QUEUE_DEPTH + 1))
        todo = sorted((c for c in local if save_order(c.manifest) > newest
                       and float(c.manifest.get("created_unix", 0.0)) < job.before_unix),
                      key=lambda c: save_order(c.manifest))[-limit:]
        for c in todo:
            tracker = c.manifest.get("tracker") if isinstance(c.manifest.get("tracker"), dict) else {}
            name, content = tracker.get("name", ""), tracker.get("content", "")
            if not (isinstance(name, str) and isinstance(content, str) and "/" not in name
                    and not name.startswith(".")):
                name = content = ""
            log.warning("remote: step %d (%s) was committed locally but never uploaded (the persister that "
                        "committed it ended first); uploading it now to %s", c.step, c.dirname, job.remote_dir)
            # saved after every remote checkpoint, so never behind an upload of this persister (an earlier
            # run's, whose order is above 0): it moves the tracker object and is protected from retention
            order = self._tracker_order.get((job.remote_dir, name), 0)
            self._upload(store, UploadJob(job.run_id, job.remote_dir, c.path, c.dirname, c.manifest,
                                          job.keep_last, name, content, order=order))

    def _skip_retired(self, job: UploadJob, when: str) -> None:
        reason = (f"{job.local_dir} was deleted {when} (by retention, keep_last={job.keep_last}, or by hand) or "
                  "replaced by a later save of that name; a newer checkpoint is uploaded instead")
        log.warning("remote: upload of step %d to %s skipped: %s", job.manifest["step"], job.remote_dir, reason)
        self._note(job, "upload_skipped", reason)

    def _fail_retired(self, store: RemoteStore, job: UploadJob, attempts: int, cause: str) -> None:
        """``job``'s checkpoint was retired locally while the store kept failing (an outage, saves faster than
        the retries), before or during a later attempt (``attempts`` made; ``cause``: the store's error of the
        last one made while the directory was there): a failure, or training would never hear of the outage.
        What the attempts left (no manifest) is cleaned."""
        step = job.manifest["step"]
        log.error("remote: upload of step %d (%s) to %s failed (%d attempts: %s); the local checkpoint was retired "
                  "meanwhile (keep_last=%s), a newer one is uploaded next", step, job.dirname, job.remote_dir,
                  attempts, cause, job.keep_last)
        self._note(job, "upload_failed", f"{job.remote_dir}: {cause}")
        _clean_after(store, step, "failed")

    def _upload(self, store: RemoteStore, job: UploadJob) -> None:
        """Upload one checkpoint with retries, then apply the remote retention."""
        step = job.manifest["step"]
        delay = BACKOFF_SECS
        cause = ""  # the last failed attempt's
        for attempt in range(RETRIES + 1):
            t0 = time.monotonic()
            if _gone(job):  # local retention retired it (or a later save replaced it) before its turn came
                if cause:
                    self._fail_retired(store, job, attempt, cause)
                else:
                    self._skip_retired(job, "before its upload began")
                return
            gate = (job.remote_dir, job.tracker_name)
            behind = bool(job.tracker_name) and self._tracker_order.get(gate, -1) > job.order
            try:
                moved = store.upload(job.local_dir, job.dirname, job.manifest, run_id=job.run_id,
                                     tracker_name="" if behind else job.tracker_name,
                                     tracker_content=job.tracker_content)
                behind = behind or not moved  # a later save's upload, maybe another persister's, wrote it
            except Exception as e:
                if _gone(job):
                    if cause:  # during a later attempt of an outage
                        self._fail_retired(store, job, attempt + 1, cause)
                        return
                    # retired meanwhile (retention renames the directory away at once): not a fault to retry
                    self._skip_retired(job, "during its upload")
                    _clean_after(store, step, "skipped")
                    return
                cause = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                if attempt == RETRIES:
                    log.error("remote: upload of step %d (%s) to %s failed after %d attempts: %s; the local "
                              "checkpoint is intact", step, job.dirname, job.remote_dir, attempt + 1, cause)
                    self._note(job, "upload_failed", f"{job.remote_dir}: {cause}")
                    _clean_after(store, step, "failed")
                    return
                log.warning("remote: upload of step %d to %s failed (%s); retrying in %g s", step,
                            job.remote_dir, cause, delay)
                time.sleep(delay)
                delay *= 2
                continue
            nbytes = sum(int(r["nbytes"]) for r in job.manifest["files"].values())
            log.info("remote: uploaded step %d (%d bytes) to %s in %.3f s%s", step, nbytes, job.remote_dir,
                     time.monotonic() - t0, f" ({job.tracker_name} not moved back: a later save's upload "
                                            "wrote it)" if behind else "")
            if job.tracker_name and not behind:
                self._tracker_order[gate] = job.order
            self._note(job, "uploaded", job.remote_dir)
            break
        try:  # a checkpoint uploaded behind a later one is not protected: retention may take it at once
            store.apply_retention(job.keep_last, protect=[] if behind else [job.dirname])
        except Exception as e:  # retention never fails an upload that happened
            log.warning("remote retention after step %d failed: %s", step, e)


def _gone(job: UploadJob) -> bool:
    """Whether ``job``'s checkpoint is no longer in its local directory: retired (renamed away), or replaced by a
    later commit of the same name (its manifest names another commit: run id and commit time; its files are not
    those ``job.manifest`` lists). A manifest that cannot be read while the directory is there: not gone (a
    transient read error is retried)."""
    if not os.path.isdir(job.local_dir):
        return True
    try:
        with open(os.path.join(job.local_dir, MANIFEST), "rb") as f:
            local = json.loads(f.read())
    except FileNotFoundError:  # renamed away since the check above, or never one (a directory of another kind)
        return not os.path.isdir(job.local_dir)
    except (OSError, ValueError):
        return False
    mine = job.manifest or {}
    return not isinstance(local, dict) or [local.get("run_id"), local.get("created_unix")] != [
        mine.get("run_id"), mine.get("created_unix")]


def _clean_after(store: RemoteStore, step: int, what: str) -> None:
    """Delete what an upload of ``step`` that ended ``what`` (failed, skipped) left in ``store`` (no manifest):
    nothing else uploads meanwhile. A store that fails this too is a warning (the next job's clean-up retries)."""
    try:
        store.clean_orphans()
    except Exception as e:
        log.warning("remote: could not clean up after the %s upload of step %d: %s", what, step, e)
