"""The commit protocol: one strategy in one place (contract 4 (docs/design/contracts.md)).

The committer is the persister that serves global rank 0. For a step ``N`` of run ``R`` it:

1. waits until the partial directory ``.<dirname>.partial-<R>`` holds a part marker from exactly the
   ranks ``0 .. world_size-1`` (a failure marker ends the wait at once with that rank's error; a marker
   from an unexpected rank, a missing rank at the deadline, or a file the marker lists that is missing
   or of the wrong size fails the commit: case B9; a missing rank whose process died before handing its
   part over, or whose node's persister is lost, ends the wait in seconds with ``PeerLostError``:
   :mod:`snapckpt.persister.peers`);
2. writes ``.snapckpt/manifest.json`` into the partial directory (atomic, fsynced) and fsyncs it;
3. renames the partial directory to ``<dirname>`` (an older committed directory of the same name is
   moved aside first, to ``.<dirname>.replaced-<R>``, and deleted after; when a crash comes between the
   two renames, the next persister of the job renames it back: :func:`recover_interrupted_commits`)
   and fsyncs the checkpoint directory;
4. only then replaces the tracker file (``latest``...) atomically;
5. runs retention (holding the checkpoint directory's lock, which step 3's renames take too: commits run
   in parallel, and retention retires directories by name from its listing). It protects the directories
   whose commits are still in flight (``CommitRequest.in_flight``): one that ends after a later save's is
   in place before its answer, and the other nodes' watchers read its manifest until then. A commit that
   ended behind later saves' commits, and is itself beyond the newest ``keep_last``, is retired by its own
   retention once its answer is out (:func:`retire_after_answer`), not left for the next commit: the
   scheduler calls it when a later save of the run committed first, and, across nodes, once the committed
   notice was sent to every other node (a watcher that lost it ends on the manifest only).

Every other node's persister runs :func:`watch_commit` instead, which waits for the manifest of run ``R``
to appear (and gives up in seconds, as the committer does, on a dead peer or a lost committer node).

Neither wait polls the shared filesystem: each blocks on its save's wake event (``CommitRequest.wake``),
set by this node's persister when a local part ends, when a peer's notice arrives over the peer channel
(a part of another node ended; the commit ended: :mod:`snapckpt.persister.commit_notices`) or when a local
rank dies. Woken, it reads the filesystem, which stays the source of truth (the markers, the manifest);
between wakes it only runs the in-memory and peer-record checks (``peer_check``, every
``peer_tick_secs``), and it re-reads the filesystem every :data:`BACKSTOP_SECS` in case a notice was lost.
``CommitRequest.stats`` counts the reads (``listings``) and the wakes.

On failure the committer deletes the partial directory (the node persister does it once its
own writers of that step are done): nothing a loader would look at is left behind, and the previous
checkpoint and tracker are untouched. Partial directories of this job's earlier, crashed runs are
removed by :func:`recover_interrupted_commits` when the next run of the job starts.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from snapckpt._internal import faultpoints as faults
from snapckpt.errors import CheckpointCorruptError, CommitError, CommitTimeoutError, PeerLostError, SaveSkippedError
from snapckpt.ondisk.manifest import (CHECKSUM, MANIFEST, SIDECAR, build_manifest, check_checksums, check_sizes, parse_manifest,
                        partial_dirname, validate_file_name)
from snapckpt.storage.base import StorageReader, StorageWriter
from snapckpt.persister.client import job_of_run
from snapckpt.persister.leftovers import leftover_run, writer_is_dead
from snapckpt.persister.protocol import error_from_record
from snapckpt.persister.retention import apply_retention

__all__ = ["CommitRequest", "commit", "retire_after_answer", "wait_for_parts", "watch_commit", "recover_interrupted_commits", "collect_parts",
           "raise_local_failure", "stale_marker", "BACKSTOP_SECS", "WATCH_GRACE_SECS", "NOTICE_GRACE_SECS"]

log = logging.getLogger(__name__)
BACKSTOP_SECS = 1.0  # a wait re-reads the filesystem this often without a wake (a lost notice; seconds)
# A watcher waits this long past commit_timeout_secs for the committer's verdict (seconds). The committer's
# deadline bounds its wait for the parts only, and starts when its own rank's request came; a watcher that
# gave up at the same deadline failed its ranks while the committer committed the step (issue 15: under
# load, node 1 raised CommitTimeoutError, node 0 committed, and torchrun's agent on node 0 then waited
# 300 s in its exit barrier). Below the 30 s margin of SaveHandle.wait, so the rank still gets this error.
WATCH_GRACE_SECS = 20.0
# A watcher that finds the partial directory gone without a manifest waits this long for the committer's notice
# before it calls the commit aborted (seconds): the commit may have ended and a later save's retention retired
# the directory already (commits end out of order); the notice says which. Only where notices come.
NOTICE_GRACE_SECS = 2 * BACKSTOP_SECS
# a temporary tracker file older than this was left by a killed writer: a live one renames it within an fsync
STALE_TRACKER_TEMP_SECS = 60.0

# One lock per checkpoint directory (absolute path) for the commits of this process, which run in parallel:
# held while a commit swaps its directory into place and while retention lists and retires directories, so
# retention never retires by name from a listing that a re-commit of that name (a save after a rewind) made
# stale, and a re-commit never finds the directory it checked renamed away before it moves it aside.
_dir_locks: Dict[str, threading.Lock] = {}
_dir_locks_guard = threading.Lock()


def _dir_lock(checkpoint_dir: str) -> threading.Lock:
    """The lock of ``checkpoint_dir`` (see ``_dir_locks``)."""
    key = os.path.abspath(checkpoint_dir)
    with _dir_locks_guard:
        return _dir_locks.setdefault(key, threading.Lock())


class CommitRequest:
    """What the committer needs to know about one step (plain attributes, see :func:`commit`)."""

    def __init__(self, *, checkpoint_dir: str, dirname: str, step: int, run_id: str, world_size: int,
                 timeout_secs: float, keep_last: Optional[int], tracker_name: str, tracker_content: str,
                 tracker_gate: Optional[Callable[[Callable[[], None]], bool]] = None,
                 local_failure: Optional[Callable[[], Optional[BaseException]]] = None,
                 requested_unix: Optional[float] = None,
                 peer_check: Optional[Callable[..., None]] = None,
                 peer_tick_secs: Optional[float] = None,
                 wake: Optional[threading.Event] = None,
                 in_flight: Optional[Callable[[], List[str]]] = None,
                 committed_notice: Optional[Callable[[], bool]] = None,
                 own_parts: Optional[Callable[[], Optional[Dict[int, Dict[str, Tuple[int, str]]]]]] = None,
                 gen: Optional[int] = None, failed_gens: Optional[Callable[[], Set[int]]] = None):
        self.checkpoint_dir = checkpoint_dir
        self.dirname = dirname
        self.step = step
        self.run_id = run_id
        self.world_size = world_size
        self.timeout_secs = timeout_secs
        self.keep_last = keep_last
        self.tracker_name = tracker_name
        self.tracker_content = tracker_content
        # tracker_gate(write) runs write() unless a save requested later already moved the tracker (saves
        # of one job commit in parallel, but the tracker only ever moves forward in request order); it returns
        # whether it wrote (False: this save is behind a later one, which remote-only retention reads)
        self.tracker_gate = tracker_gate
        # local_failure() returns the error of a rank of this node whose part failed (known in memory even
        # when the disk was too full for its failure marker), so the commit fails at once, not at the timeout
        self.local_failure = local_failure
        # when the save was requested (the first persist request of the step, Unix seconds): the order of
        # saves, which retention follows; commits of one job run in parallel and may finish out of order
        self.requested_unix = time.time() if requested_unix is None else requested_unix
        # peer_check(step, dirname, missing_ranks, persisters_of) raises PeerLostError when a missing part
        # can never come: its rank's process died, or its node's lease went stale (persister/peers.py)
        self.peer_check = peer_check
        # how often peer_check must run while waiting (seconds; PeerWatch.tick_secs); default BACKSTOP_SECS
        self.peer_tick_secs = peer_tick_secs
        # set when the filesystem is worth reading again: a part of this node ended, a peer's notice came
        # (commit_notices.py), a local rank died; without a wake the waits read it every BACKSTOP_SECS only
        self.wake = wake if wake is not None else threading.Event()
        # in_flight() lists the directory names of checkpoint_dir whose commits (this one's, parallel ones) are
        # not yet reported: retention protects them (one that ended after a later save's is in place already)
        self.in_flight = in_flight
        # committed_notice() (a watcher): whether the committer's node said this commit ended committed; None
        # where no notices come (a partial directory that vanished without a manifest is then an abort at once)
        self.committed_notice = committed_notice
        # own_parts() (a watcher): {rank: {file: (nbytes, checksum)}} of the parts this node wrote for this save,
        # None while one has not ended; a manifest of the run and step that lists other files for those ranks is
        # an earlier save's of the step (a step saved again), not this one's. None: any manifest of it counts
        self.own_parts = own_parts
        # which save of (run_id, step, dirname) this is (the scheduler's Result.gen; None: any), and failed_gens(): the
        # generations of the step's earlier saves known failed here. A marker of such a save (a part written on
        # another node after the committer had deleted the partial directory, before that node heard of the
        # abort) is stale: not counted (collect_parts)
        self.gen = gen
        self.failed_gens = failed_gens
        # filesystem reads of the wait (listings of the partial directory, manifest reads) and wakes
        self.stats = {"listings": 0, "wakes": 0}

    @property
    def partial_dir(self) -> str:
        return os.path.join(self.checkpoint_dir, partial_dirname(self.dirname, self.run_id))

    @property
    def final_dir(self) -> str:
        return os.path.join(self.checkpoint_dir, self.dirname)


def collect_parts(reader: StorageReader, req: CommitRequest, unreadable: Optional[Dict[str, str]] = None, *,
                  in_dir: Optional[str] = None, seen: Optional[Dict[str, Dict[str, Any]]] = None
                  ) -> Dict[int, Dict[str, Any]]:
    """The part records of the partial directory (JSON markers, never unpickled). A marker that does not
    parse is skipped for this poll and described in ``unreadable`` (path -> why), which a timeout names.
    ``in_dir``: where the markers are instead (``<url>/<dirname>`` in remote-only mode, ``reader`` the
    :class:`~snapckpt.storage.remote.RemoteStore`). ``seen``: the valid part markers of this save read by
    an earlier call (marker name -> file records), filled here: a wait lists the directory at each wake,
    and reads only the markers that are new (a part marker of a save is written once, by a rename), so
    the markers of N ranks cost N reads in all, not one per rank per wake.

    A marker of an earlier save of the step that failed (its ``gen`` is in ``req.failed_gens()``, and it is not
    a crash flush's) is stale (:func:`_stale`): skipped, and described in ``unreadable``; the rank's part of this
    save replaces it (the same marker name). A marker without ``gen`` (remote-only parts, replica stand-ins)
    counts for any save of its step.

    Raises:
        SaveSkippedError: a rank's failure marker says it skipped the save (no free slot).
        CommitError: a failure marker (that rank's error), or a part marker listing a file outside the
            checkpoint directory or a malformed record (names the marker).
    """
    parts: Dict[int, Dict[str, Any]] = {}
    side = os.path.join(in_dir or req.partial_dir, SIDECAR)
    for name in reader.listdir(side):
        if not name.endswith(".json") or name.startswith("."):
            continue
        kind, _, rest = name[:-5].partition("_")
        if kind not in ("part", "fail") or not rest.isdigit():
            continue
        if seen is not None and name in seen:
            parts[int(rest)] = seen[name]
            continue
        path = os.path.join(side, name)
        try:
            rec = json.loads(reader.read_bytes(path))
            if not isinstance(rec, dict):
                raise ValueError(f"a JSON {type(rec).__name__}, not an object")
        except (OSError, ValueError, RecursionError) as e:
            if unreadable is not None:  # being replaced, or damaged: read again next poll
                unreadable[path] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        if unreadable is not None:
            unreadable.pop(path, None)
        if rec.get("run_id") != req.run_id or rec.get("step") != req.step:
            continue
        if _stale(rec, req):
            if unreadable is not None:  # (named by a timeout)
                unreadable[path] = (f"a marker of save {rec['gen']} of step {req.step}, which failed (this is save "
                                    f"{req.gen}): not counted")
            continue
        rank = int(rest)
        if kind == "fail":
            err = rec.get("error")
            exc = error_from_record(err if isinstance(err, dict) else {})
            if isinstance(exc, SaveSkippedError):  # a rank skipped the save: every rank's ends skipped
                raise exc
            raise CommitError(f"step {req.step}: rank {rank} failed to write its part: "
                              f"{type(exc).__name__}: {exc}") from exc
        files = rec.get("files")
        if not isinstance(files, dict):
            raise CommitError(f"step {req.step}: part marker {path} has no file records")
        for fname, frec in files.items():
            try:
                validate_file_name(fname)
            except ValueError as e:
                raise CommitError(f"step {req.step}: part marker {path} lists a file outside the checkpoint "
                                  f"directory: {e}") from e
            if not (isinstance(frec, dict) and isinstance(frec.get("nbytes"), int)
                    and isinstance(frec.get(CHECKSUM), str)):
                raise CommitError(f"step {req.step}: part marker {path} has a malformed record for {fname!r}")
        parts[rank] = files
        if seen is not None:
            seen[name] = files
    return parts


def _stale(rec: Dict[str, Any], req: CommitRequest) -> bool:
    """Whether marker ``rec`` (of ``req``'s run and step) is one of an earlier save of the step that failed."""
    return stale_marker(rec, req.gen, req.failed_gens)


def stale_marker(rec: Dict[str, Any], gen: Optional[int], failed_gens: Optional[Callable[[], Set[int]]]) -> bool:
    """Whether part or failure marker ``rec`` (of the save's run and step) is one of an earlier save of the step
    that failed, for the save of generation ``gen``: it names another generation, among ``failed_gens()``, and is
    not a crash flush's (``flush``). ``failed_gens`` ``None``: never."""
    mgen = rec.get("gen")
    return (failed_gens is not None and isinstance(mgen, int) and mgen != gen and not rec.get("flush")
            and mgen in failed_gens())


def raise_local_failure(req: CommitRequest) -> None:
    """Raise :class:`CommitError` with the error of a local rank whose part of this save failed, or the
    committer node's notice that the commit failed (a watcher), if any; :class:`SaveSkippedError` as it is (a
    rank skipped the save: its message names the rank)."""
    exc = req.local_failure() if req.local_failure is not None else None
    if isinstance(exc, SaveSkippedError) or (isinstance(exc, CommitError) and not hasattr(exc, "snapckpt_rank")):
        raise exc  # a rank skipped the save (its message names it), or the committer's abort notice
    if exc is not None:
        rank = getattr(exc, "snapckpt_rank", "?")
        raise CommitError(f"step {req.step}: rank {rank} failed to write its part: {type(exc).__name__}: "
                          f"{exc}") from exc


def _refuse_other_jobs_checkpoint(reader: StorageReader, req: CommitRequest) -> None:
    """A commit replaces an older committed directory of the same name only if this job wrote it (a
    re-save of a step after a rewind), or if it is damaged (a file missing, of the wrong size or failing
    its checksum: loaders refuse it, so nothing loadable is lost; a warning names it). An intact checkpoint
    of another job is never overwritten. Run ids start with the job key
    (:func:`snapckpt.persister.client.job_of_run`), which depends on the directory's real path: a directory
    that was moved or copied is another job's for this check.

    Raises:
        CommitError: the directory holds another job's intact checkpoint (the message names the run and
            the fixes).
    """
    try:
        old = parse_manifest(reader.read_bytes(os.path.join(req.final_dir, MANIFEST)), req.dirname)
    except Exception:
        return  # no valid commit record there: not a checkpoint anyone can load
    old_run = str(old.get("run_id", ""))
    if job_of_run(old_run) == job_of_run(req.run_id):
        return
    try:
        check_checksums(reader, req.final_dir, old)
    except CheckpointCorruptError as e:
        log.warning("step %d: replacing %s, committed by another job (run %s) and damaged: %s", req.step,
                    req.final_dir, old_run, e)
        return
    raise CommitError(
        f"{req.final_dir} was committed by another job (run {old_run}) and is intact; refusing to replace it. "
        "Two jobs must not write the same steps into one checkpoint_dir: give each job its own directory. "
        "(A directory that was moved or copied since it was written counts as another job's: to save this "
        "step again there, delete or rename that step's directory first.)")


def _wait(req: CommitRequest, next_read: float) -> None:
    """Block until ``req.wake`` is set, the next backstop read (``next_read``, monotonic) or the next peer
    check is due, whichever comes first."""
    tick = req.peer_tick_secs if req.peer_check is not None and req.peer_tick_secs else BACKSTOP_SECS
    if req.wake.wait(max(0.0, min(tick, next_read - time.monotonic()))):
        req.stats["wakes"] += 1


def wait_for_parts(reader: StorageReader, req: CommitRequest, *, in_dir: Optional[str] = None,
                   poll_secs: float = BACKSTOP_SECS) -> Dict[int, Dict[str, Any]]:
    """Wait until every rank's part marker of ``req`` is there (``in_dir``: see :func:`collect_parts`);
    return ``{rank: files}``. The markers are listed at the start, whenever ``req.wake`` is set, and every
    ``poll_secs`` seconds (the backstop); ``req.peer_check`` runs every ``req.peer_tick_secs`` in between.

    Raises:
        CommitTimeoutError: ranks missing at the deadline (named in the message).
        PeerLostError: a missing part can never come (``req.peer_check``).
        CommitError: a rank failed (its failure marker, or this node's record), or a rank outside the world
            size wrote a part.
    """
    deadline = time.monotonic() + req.timeout_secs
    unreadable: Dict[str, str] = {}
    seen: Dict[str, Dict[str, Any]] = {}  # markers already read and valid (each is read once)
    next_read = time.monotonic()
    missing: List[int] = []
    while True:
        raise_local_failure(req)
        if req.wake.is_set() or time.monotonic() >= next_read:
            req.wake.clear()  # before looking: a part ending from now on wakes the wait below
            next_read = time.monotonic() + poll_secs
            req.stats["listings"] += 1
            parts = collect_parts(reader, req, unreadable, in_dir=in_dir, seen=seen)
            unexpected = sorted(r for r in parts if r >= req.world_size)
            if unexpected:
                raise CommitError(f"step {req.step}: parts from ranks {unexpected} but the world size is "
                                  f"{req.world_size}: more processes wrote than expected")
            missing = sorted(set(range(req.world_size)) - set(parts))
            if not missing:
                return parts
        if req.peer_check is not None:
            req.peer_check(req.step, req.dirname, missing, ())
        if time.monotonic() > deadline:
            where = f" to {in_dir}" if in_dir else ""
            raise CommitTimeoutError(
                f"step {req.step}: ranks {missing} did not write their part{where} within "
                f"{req.timeout_secs:g} s (save() is collective: every rank must call it for the same "
                "step; or those ranks died)" + (f"; markers not counted: {unreadable}" if unreadable else ""))
        _wait(req, next_read)


def _put_back(storage: StorageWriter, aside: str, req: CommitRequest) -> None:
    """Renames the copy a failed re-commit moved to ``aside`` back to ``req.final_dir``; logs (never raises, so the
    commit's own error is what the caller sees) when that fails too: the next persister's
    :func:`recover_interrupted_commits` then puts it back."""
    try:
        storage.rename(aside, req.final_dir)
    except OSError as e:
        log.warning("step %d: the committed %s stays at %s after the failed re-commit: %s", req.step, req.dirname,
                    aside, e)


def commit(storage: StorageWriter, reader: StorageReader, req: CommitRequest, *,
           remove_partial_on_failure: bool = True, defer_deletion: Optional[List[str]] = None,
           late: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the commit sequence for one step; return the manifest.

    Args:
        remove_partial_on_failure: delete the partial directory when the commit fails. The node
            persister passes ``False`` and deletes it itself once its writers of the step are done (a
            writer whose directory vanished would fail with a misleading error of its own).
        defer_deletion: when a list is given, checkpoints retired by retention are renamed to hidden
            directories listed there, for the caller to delete after it has reported the commit (see
            :mod:`snapckpt.persister.retention`).
        late: when a list is given and retention kept this checkpoint only because its own commit was in
            flight (it ended behind later saves' commits, beyond the newest ``keep_last``), its directory
            name is appended: the caller retires it with :func:`retire_after_answer` once it has reported the
            commit. Without the list it stays until the next commit's retention.

    Raises:
        CommitTimeoutError: ranks missing at the deadline (named in the message).
        PeerLostError: a missing part can never come: its rank died before handing it over, or its
            node's persister is lost (``req.peer_check``, :mod:`snapckpt.persister.peers`).
        SaveSkippedError: a rank skipped the save (``on_slot_busy="skip"``): nothing is committed.
        CommitError: a rank failed, an unexpected rank wrote a part, or a listed file is damaged.
        OSError: the filesystem failed while committing.
    """
    t0 = time.monotonic()
    try:
        parts = wait_for_parts(reader, req)
        t_parts = time.monotonic()
        manifest = build_manifest(step=req.step, dirname=req.dirname, world_size=req.world_size,
                                  requested_unix=req.requested_unix,
                                  run_id=req.run_id, parts=parts)
        if req.tracker_name:  # the remote tier's catch-up upload and a download rebuild the tracker from it
            manifest["tracker"] = {"name": req.tracker_name, "content": req.tracker_content}
        check_sizes(reader, req.partial_dir, manifest)
        storage.write_atomic(os.path.join(req.partial_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
        storage.fsync_dir(req.partial_dir)
        t_manifest = time.monotonic()
        faults.point("commit.before_rename", step=req.step, rank=None)
        aside = None
        if reader.isdir(req.final_dir):  # reads only (checksums, maybe GiBs): before the lock
            _refuse_other_jobs_checkpoint(reader, req)
        with _dir_lock(req.checkpoint_dir):  # no retention of a parallel commit in between
            if reader.isdir(req.final_dir):
                aside = os.path.join(req.checkpoint_dir, f".{req.dirname}.replaced-{req.run_id}")
                storage.remove_tree(aside)
                storage.rename(req.final_dir, aside)
            try:
                if aside is not None:
                    faults.point("commit.between_renames", step=req.step, rank=None)
                storage.rename(req.partial_dir, req.final_dir)
            except BaseException:
                if aside is not None:  # the committed copy stays loadable, not hidden until a restart
                    _put_back(storage, aside, req)
                    aside = None
                raise
        storage.fsync_dir(req.checkpoint_dir)
        t_renamed = time.monotonic()
    except BaseException:
        if remove_partial_on_failure:
            try:  # never mask why the commit failed
                storage.remove_tree(req.partial_dir)
            except OSError as e:
                log.warning("step %d: could not remove %s after the failed commit: %s", req.step,
                            req.partial_dir, e)
        raise
    faults.point("commit.before_tracker", step=req.step, rank=None)
    if req.tracker_name:
        def write_tracker() -> None:
            remove_stale_tracker_temps(req.checkpoint_dir, req.tracker_name)
            storage.write_atomic(os.path.join(req.checkpoint_dir, req.tracker_name), req.tracker_content.encode())

        if req.tracker_gate is None:
            write_tracker()
        else:
            req.tracker_gate(write_tracker)
    t_tracker = time.monotonic()
    if aside is not None:
        storage.remove_tree(aside)
    log.info("committed step %d as %s (%d files): parts waited for %.3f s, manifest %.3f s, rename %.3f s, "
             "tracker %.3f s", req.step, req.dirname, len(manifest["files"]), t_parts - t0, t_manifest - t_parts,
             t_renamed - t_manifest, t_tracker - t_renamed)
    faults.point("commit.after_tracker_before_retention", step=req.step, rank=None)
    try:
        if req.keep_last is not None:
            with _dir_lock(req.checkpoint_dir):  # its listing holds until it has retired what it chose
                in_flight = req.in_flight() if req.in_flight is not None else []
                spared: List[str] = []
                apply_retention(storage, reader, req.checkpoint_dir, req.keep_last,
                                protect=[req.dirname, *in_flight], defer_to=defer_deletion,
                                run_id=req.run_id, step=req.step, spared=spared)
                if late is not None and req.dirname in spared:
                    late.append(req.dirname)
    except OSError as e:  # retention never fails a commit that already happened
        log.warning("retention after step %d failed: %s", req.step, e)
    return manifest


def retire_after_answer(storage: StorageWriter, reader: StorageReader, req: CommitRequest,
                        defer_deletion: Optional[List[str]] = None) -> List[str]:
    """Run ``req``'s retention again once its commit is reported, no longer protecting it (``commit``'s
    ``late``): a commit that ended behind later saves' commits is retired now if it is still beyond the
    newest ``req.keep_last`` (a later save of the same directory may have replaced it meanwhile; the listing
    is read again). Other nodes' watchers that have not read its manifest yet end on the committer's
    committed notice (:func:`watch_commit`): the caller runs this only once that notice was sent to every
    other node, and only for a commit that ended behind a later save's (``Scheduler._commit_task``). Returns the retired directory names (``defer_deletion``: as
    :func:`commit`'s).

    Raises:
        OSError: the filesystem failed (the commit itself stands).
    """
    with _dir_lock(req.checkpoint_dir):
        in_flight = req.in_flight() if req.in_flight is not None else []
        return apply_retention(storage, reader, req.checkpoint_dir, req.keep_last, protect=in_flight,
                               defer_to=defer_deletion, run_id=req.run_id, step=req.step)


def watch_commit(reader: StorageReader, req: CommitRequest) -> Optional[Dict[str, Any]]:
    """On a non-committer node: wait for the committer's manifest of this run and step. The manifest and the
    partial directory are read at the start, whenever ``req.wake`` is set (the committer's notice that the
    commit ended, a local part ended) and every :data:`BACKSTOP_SECS`; ``req.peer_check`` runs every
    ``req.peer_tick_secs`` in between.

    The committer decides: its abort notice ends the watch at once, and so does the partial directory gone
    without a manifest where no notices come (with notices: after :data:`NOTICE_GRACE_SECS`, below); its
    lost node too (``req.peer_check``); the watch's own deadline, ``req.timeout_secs`` plus
    :data:`WATCH_GRACE_SECS`, only ends a wait for a committer that neither commits nor aborts.

    A manifest counts when it is of this run and step and, where ``req.own_parts`` is given, lists the parts
    this node wrote for this save (a step saved again in the run: the step directory still holds the first
    save's manifest until the committer replaces it).

    Returns the manifest, or ``None`` when the committer's notice said the commit ended committed and the
    directory is gone already (``req.committed_notice``: commits end out of order, and a later save's retention
    may retire this one before the watch reads it). With notices, a partial directory that vanished without a
    manifest is an abort only when no notice came within :data:`NOTICE_GRACE_SECS`.

    Raises:
        CommitTimeoutError: no manifest by the deadline.
        PeerLostError: a missing part can never come, or the committer's node is lost (``req.peer_check``).
        CommitError: the partial directory vanished without a commit (the committer aborted), or a rank
            wrote a failure marker.
    """
    deadline = time.monotonic() + req.timeout_secs + WATCH_GRACE_SECS
    mpath = os.path.join(req.final_dir, MANIFEST)
    seen_partial = False
    next_read = time.monotonic()
    parts: Dict[int, Dict[str, Any]] = {}
    seen: Dict[str, Dict[str, Any]] = {}  # markers already read (collect_parts)

    def committed() -> Optional[Dict[str, Any]]:
        req.stats["listings"] += 1
        try:
            m = parse_manifest(reader.read_bytes(mpath), req.dirname)
        except Exception:  # not there yet, or being replaced
            return None
        if m.get("run_id") != req.run_id or m["step"] != req.step:
            return None
        if req.own_parts is not None:  # this save's, not an earlier save's of the step (saved again)
            own = req.own_parts()
            if own is None or any(_files_of(m, rank) != files for rank, files in own.items()):
                return None
        return m

    def told_committed() -> bool:
        return req.committed_notice is not None and req.committed_notice()

    vanished_at: Optional[float] = None  # when the partial directory was first seen gone without a manifest
    while True:
        if req.wake.is_set() or time.monotonic() >= next_read:
            req.wake.clear()  # before looking: a notice from now on wakes the wait below
            next_read = time.monotonic() + BACKSTOP_SECS
            m = committed()
            if m is not None:
                return m
            if told_committed():
                return None
            raise_local_failure(req)
            if reader.isdir(req.partial_dir):
                seen_partial = True
                parts = collect_parts(reader, req, seen=seen)  # raises on a failure marker
            elif seen_partial:
                m = committed()  # the rename may have happened between the two checks
                if m is not None:
                    return m
                now = time.monotonic()
                vanished_at = now if vanished_at is None else vanished_at
                if req.committed_notice is None or now - vanished_at >= NOTICE_GRACE_SECS:
                    raise CommitError(f"step {req.step}: the committer aborted the commit (see rank 0's error)")
                # committed, then retired by a later save's retention before this read? its notice tells
            else:
                parts, seen = {}, {}
        else:
            raise_local_failure(req)
        if req.peer_check is not None:  # the committer (rank 0's persister) must live to finish it, too
            try:
                req.peer_check(req.step, req.dirname, sorted(set(range(req.world_size)) - set(parts)), (0,))
            except PeerLostError:
                m = committed()  # the parts were listed while the committer renamed the directory
                if m is not None or told_committed():
                    return m
                raise
        if time.monotonic() > deadline:
            m = committed()  # the last backstop read may be up to a second old
            if m is not None or told_committed():
                return m
            raise CommitTimeoutError(
                f"step {req.step}: no commit record from the committer (the persister of rank 0's node) within "
                f"{req.timeout_secs + WATCH_GRACE_SECS:g} s (commit_timeout_secs={req.timeout_secs:g} plus "
                f"{WATCH_GRACE_SECS:g} s), and it did not abort the commit either; its "
                "persister.log says why")
        _wait(req, next_read)


def _files_of(manifest: Dict[str, Any], rank: int) -> Dict[str, Tuple[int, str]]:
    """``{file: (nbytes, checksum)}`` of ``rank``'s files in ``manifest``."""
    return {n: (int(f["nbytes"]), str(f[CHECKSUM])) for n, f in manifest["files"].items() if f.get("rank") == rank}


def recover_interrupted_commits(storage: StorageWriter, checkpoint_dir: str, *, job: str,
                                known_runs: Set[str], runtime_root: Optional[str] = None,
                                quiet_secs: float = 600.0) -> None:
    """The commit's own crash recovery, run by the committer's persister when a run of ``job`` starts in
    ``checkpoint_dir``: restore interrupted re-commits and remove partial directories left by earlier runs
    of this job that this persister does not know (``known_runs``: the run ids it serves; others crashed).

    A commit replacing step directory ``X`` renames ``X`` to ``.X.replaced-R``, then ``.X.partial-R``
    to ``X``; a crash between the two leaves no ``X``, and ``.X.replaced-R`` is the committed
    (intact) checkpoint: it is renamed back to ``X`` and the interrupted ``.X.partial-R`` is removed (a
    warning says so, and keeps ``persister.log``).
    That holds for any job's leftover that has a manifest (a directory moved or copied since has another
    job key). Only one job writes a directory (:mod:`snapckpt.ondisk.dirclaim`); should another job's live
    commit be between its two renames at this very moment (microseconds), its rename fails and its
    commit raises ``CommitError``, its old copy restored: nothing is lost. Other leftovers are removed
    only when their run id starts with this job's key, or (with ``runtime_root``) when their writer is provably
    dead (:func:`snapckpt.persister.leftovers.writer_is_dead`: no persister of that job on this host, nothing
    changed for ``quiet_secs``): another job sharing the directory has its own persister, and its directories
    in flight are never touched.

    Raises:
        OSError: the filesystem failed while listing, renaming or removing.
    """
    names = storage.listdir(checkpoint_dir)
    for name in sorted(n for n in names if n.startswith(".") and ".replaced-" in n):
        rid = name.rsplit("-", 1)[-1]
        dirname = name[1:name.rindex(".replaced-")]
        src, final = os.path.join(checkpoint_dir, name), os.path.join(checkpoint_dir, dirname)
        if rid in known_runs or not dirname or os.path.lexists(final) or not _restorable(src):
            continue
        storage.rename(src, final)
        storage.fsync_dir(checkpoint_dir)
        storage.remove_tree(os.path.join(checkpoint_dir, partial_dirname(dirname, rid)))
        log.warning("restored %s from %s: a commit replacing it was interrupted between its two renames "
                    "(the persister died); the interrupted new copy is discarded", final, name)
    for name in storage.listdir(checkpoint_dir):
        rid = leftover_run(name)
        if rid is None or rid in known_runs:
            continue
        path = os.path.join(checkpoint_dir, name)
        if rid.startswith(job):
            storage.remove_tree(path)
        elif runtime_root is not None and writer_is_dead(path, rid, runtime_root, quiet_secs):
            storage.remove_tree(path)
            log.warning("removed %s: left by a save of another job (run %s) whose persister is gone and which "
                        "changed nothing for %.0f s", path, rid, quiet_secs)


def remove_stale_tracker_temps(checkpoint_dir: str, tracker_name: str,
                               stale_secs: float = STALE_TRACKER_TEMP_SECS) -> None:
    """Remove the temporary files of ``tracker_name`` (``.<name>.tmp-<12 hex>``, written by
    :meth:`~snapckpt.storage.posix.PosixStorage.write_atomic`) left in ``checkpoint_dir`` by a persister killed
    while it replaced the tracker (between the temporary file's fsync and its rename). Called by the writer of
    the tracker, so no writer of this job is between those two steps; a file changed in the last
    ``stale_secs`` seconds may be a live writer's (a download rebuilding the tracker) and is left alone. A
    failure is logged, never raised: the commit has happened."""
    prefix = f".{tracker_name}.tmp-"
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return
    for name in names:
        suffix = name[len(prefix):]
        if not name.startswith(prefix) or len(suffix) != 12 or any(c not in "0123456789abcdef" for c in suffix):
            continue
        path = os.path.join(checkpoint_dir, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > stale_secs:
                os.unlink(path)
                log.info("removed %s: the temporary file of a tracker replace that a killed persister left", path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove the stale temporary tracker file %s: %s", path, e)


def _restorable(path: str) -> bool:
    """Whether the moved-aside directory ``path`` is to be renamed back: it holds a manifest (a commit
    record: it was a committed checkpoint)."""
    return os.path.isfile(os.path.join(path, MANIFEST))
