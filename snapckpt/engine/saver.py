"""Saver: the save pipeline of one rank, from ``save_files`` to the hand-over of a slot to the persister.

Sequence of one save of step ``N`` (the only part of snapckpt on the training critical path):

1. checks (step, names, tracker), the first save's writer claim of ``checkpoint_dir`` (every rank learns
   the outcome), ``poll`` for earlier failures;
2. the Stager plans and pickles the skeleton (:meth:`~snapckpt.engine.stager.Stager.prepare`); DISK: free
   space is checked;
3. ``acquire`` a slot of the rank's arena from the persister (wait or skip when all are busy, contract 2);
4. copy into the slot: at once, or with ``overlap=True`` on the copy thread until :meth:`Saver.fence`
   (CUDA tensors on a side stream, :mod:`snapckpt.engine.device_copy`). With ``SNAPCKPT_STREAM_PERSIST=1`` a
   DISK save of CPU tensors is *streamed* (:meth:`Saver._stream`): the pickles and index go first, the persister is told (``stream``) and
   writes the spans as the copy's watermark passes them, so the write overlaps the copy;
5. ``ready`` (and, for DISK, persist): :meth:`Saver._copied` builds the :class:`SaveStats` and the event.

A failed copy hands its slot back (``abort``). Each save's :class:`~snapckpt.engine.handle.SaveHandle` sees
the Saver as its :class:`~snapckpt.engine.handle.SaveOwner`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from snapckpt import errors as error_types
from snapckpt._internal import env as _env
from snapckpt._internal import faultpoints as faults
from snapckpt.dist.coordination import Coordinator
from snapckpt.engine.device_copy import CudaCopier, has_cuda_sources
from snapckpt.engine.handle import SaveHandle
from snapckpt.engine.preflight import host_memory_shortfall, slot_limit
from snapckpt.engine.restore import check_step
from snapckpt.engine.session import CLOSED, PersisterSession
from snapckpt.engine.slot_maps import MappedSlot, SlotMaps
from snapckpt.engine.stager import Stager
from snapckpt.errors import (CheckpointDirError, CheckpointerClosedError, InsufficientDiskError, SaveSkippedError,
                             PersisterDiedError, PersisterTimeoutError, SlotBusyError, SnapckptError)
from snapckpt.events import Event, SaveStats, StorageType
from snapckpt.metrics import summary_line
from snapckpt.ondisk import dirclaim
from snapckpt.ondisk.manifest import list_committed, validate_dirname, validate_file_name
from snapckpt.options import CheckpointOptions
from snapckpt.persister.arena import stores_in_order
from snapckpt.storage.posix import PosixStorage
from snapckpt.storage.urls import shown_url

__all__ = ["Saver"]

log = logging.getLogger(__name__)
summary_log = logging.getLogger("snapckpt.metrics")  # one line per checkpoint, global rank 0
#: While uploads keep failing, rank 0 repeats its warning at most once per this many seconds.
UPLOAD_FAILED_REMINDER_SECS = 600.0


class _CopyJob:
    """One snapshot between slot acquisition and the hand-over to the persister."""

    def __init__(self, prepared, slot: int, mapped: MappedSlot, step: int, storage_type: StorageType,
                 dirname: str, tracker_name: str, tracker_content: str, t0: float, t1: float, t2: float,
                 started: float):
        self.prepared, self.slot, self.mapped, self.step = prepared, slot, mapped, step
        self.storage_type, self.dirname = storage_type, dirname
        self.tracker_name, self.tracker_content = tracker_name, tracker_content
        self.t0, self.t1, self.t2 = t0, t1, t2
        self.started = started  # time.monotonic() of the save call (durable_secs counts from it)
        self.future = None
        self.handle: Optional[SaveHandle] = None
        self.fence_secs = 0.0
        self.copy_secs = 0.0
        self.device_done = None  # the event of the CUDA copies queued for this job, if any


def _timed_copy(prepared, mapped: MappedSlot, device_done=None) -> float:
    """The copy thread's job: map the reserved slot's pages not mapped yet (:meth:`MappedSlot.populate`), copy a
    prepared snapshot into it (and wait for its queued CUDA copies); returns the seconds it took."""
    t0 = time.perf_counter()
    mapped.populate(prepared.total_nbytes)
    Stager.copy_into(prepared, mapped.tensor, mapped.buf, device_done)
    return time.perf_counter() - t0


class Saver:
    """The save pipeline of one rank (the :class:`~snapckpt.engine.handle.SaveOwner` of its handles).

    Args:
        options: the Checkpointer's options.
        checkpoint_dir: absolute path of the checkpoint directory.
        run_id: this launch attempt's run id (recorded in the writer claim).
        rank: global rank.
        coord: the job's coordination channel (the writer claim's outcome).
        storage: the storage of ``checkpoint_dir`` (free space).
        stager: plans and copies snapshots.
        maps: the rank's slot mappings.
        session: the persister session.
        emit: delivers an :class:`~snapckpt.events.Event` to the Checkpointer's listeners.
        local: ``False`` in remote-only mode (``checkpoint_dir`` is a URL): no local writer claim (the
            store's owner record is the claim), no free-space check, no tracker file.

    Attributes:
        cuda: the side-stream copier of CUDA tensors, made on first use (``None`` until then).
        last_stats: statistics of the newest snapshot taken, or ``None``.
    """

    def __init__(self, options: CheckpointOptions, checkpoint_dir: str, run_id: str, rank: int,
                 coord: Coordinator, storage: PosixStorage, stager: Stager, maps: SlotMaps,
                 session: PersisterSession, emit: Callable[[Event], None], *, local: bool = True) -> None:
        self._options, self._checkpoint_dir, self._run_id, self._rank = options, checkpoint_dir, run_id, rank
        self._local = local
        self._coord, self._storage, self._stager, self._maps = coord, storage, stager, maps
        self._session, self._emit = session, emit
        self._handles: List[SaveHandle] = []  # DISK saves not yet ended or not yet reported
        self._inflight: Optional[_CopyJob] = None  # an overlapped copy not yet fenced
        self._newest: Optional[SaveHandle] = None  # the handle of the last snapshot taken or being copied
        self._copier = None  # the copy thread (overlap=True), started on first use
        self.cuda: Optional[CudaCopier] = None
        self._claim: Optional[dirclaim.DirClaim] = None
        self._claimed = not local  # the writer claim of checkpoint_dir was settled (see _claim_dir)
        self._other_world: Dict[str, int] = {}  # committed dirname -> world size, another world size's (_claim_dir)
        self.last_stats: Optional[SaveStats] = None
        self._remote_seen = 0  # remote-tier notes of the persister already emitted as events
        self._remote_failures = 0  # uploads given up since the last one that succeeded
        self._remote_warned_at: Optional[float] = None  # monotonic time of rank 0's last upload_failed warning
        self._streams = _env.stream_persist() and stores_in_order()  # DISK saves of CPU tensors are streamed
        self._checked_nbytes = 0  # the largest slot size the host-memory preflight has checked
        self._slot_nbytes = 0  # the slot size the last acquire asked for (see _acquire)

    # ------------------------------------------------------------------- SaveOwner (for the handles)
    @property
    def commit_timeout_secs(self) -> float:
        """The options' ``commit_timeout_secs``."""
        return self._options.commit_timeout_secs

    def status(self, step: int, dirname: str, wait_secs: float = 0.0, seq: int = -1) -> Dict[str, Any]:
        """The persister's state of a save (:meth:`PersisterSession.status`, ``wait_secs`` and ``seq`` as there);
        the remote tier's notes it carries (uploads skipped or failed) become ``upload_skipped`` /
        ``upload_failed`` events."""
        reply = self._session.status(step, dirname, wait_secs, seq)
        # the persister keeps the newest notes only: "remote_base" of them were dropped before the first one sent
        notes, base = reply.get("remote") or [], int(reply.get("remote_base") or 0)
        for n in notes[max(0, self._remote_seen - base):]:
            kind, reason = str(n.get("kind")), str(n.get("reason", ""))
            if kind == "uploaded":
                self._remote_caught_up(int(n.get("step", -1)), reason)
                continue
            if kind == "upload_failed":
                self._remote_failed(int(n.get("step", -1)), reason)
            else:
                log.warning("rank %d: remote tier: %s of step %s: %s", self._rank, kind, n.get("step"), reason)
            self._emit(Event(kind, int(n.get("step", -1)), StorageType.DISK, self._rank, reason=reason))
        self._remote_seen = max(self._remote_seen, base + len(notes))
        return reply

    def _remote_failed(self, step: int, reason: str) -> None:
        """An upload given up (``reason``: ``"<remote_dir>: <cause>"``): rank 0 warns with the fix at the first
        failure, then at most once per :data:`UPLOAD_FAILED_REMINDER_SECS` while uploads keep failing."""
        self._remote_failures += 1
        now = time.monotonic()
        if self._rank != 0 or (self._remote_warned_at is not None
                               and now - self._remote_warned_at < UPLOAD_FAILED_REMINDER_SECS):
            log.debug("rank %d: remote tier: upload_failed of step %d: %s", self._rank, step, shown_url(reason))
            return
        again = "" if self._remote_warned_at is None else \
            f" ({self._remote_failures} failed uploads since uploads began failing)"
        self._remote_warned_at = now
        log.warning("rank 0: the upload of step %d to the remote tier failed: %s%s. Checkpoints are NOT "
                    "reaching object storage (only the local tier, %s, has them): check the credentials (expired?), "
                    "that the bucket exists and accepts writes from this node, and persister.log; training goes on "
                    "and the next upload is tried as usual", step, shown_url(reason), again,
                    self._checkpoint_dir)

    def _remote_caught_up(self, step: int, url: str) -> None:
        """The first upload that succeeded after failed ones: rank 0 says so once."""
        if self._rank == 0 and self._remote_failures:
            log.info("rank 0: the remote tier %s caught up: step %d was uploaded after %d failed upload(s)",
                     shown_url(url), step, self._remote_failures)
        self._remote_failures = 0
        self._remote_warned_at = None

    def context(self, step: int) -> str:
        """Rank, step and persister pid, for error messages."""
        return self._session.context(step)

    def lost_error(self, step: int) -> Exception:
        """The error of a save the persister no longer knows."""
        return self._session.lost_error(step)

    def on_committed(self, handle: SaveHandle) -> None:
        """Log and emit ``committed``, its stats with ``durable_secs`` and ``persist_gbps``."""
        log.info("rank %d: step %d committed to %s", self._rank, handle.step, self._checkpoint_dir)
        stats = handle.stats
        if stats is not None and handle.durable_secs is not None:
            secs = handle.durable_secs
            stats = dataclasses.replace(stats, durable_secs=secs,
                                        persist_gbps=stats.slot_nbytes / secs / 1e9 if secs > 0 else None)
        self._emit_and_summarise(Event("committed", handle.step, handle.storage_type, self._rank, stats=stats))

    def _emit_and_summarise(self, event: Event) -> None:
        if self._rank == 0:
            line = summary_line(event)
            if line is not None:
                summary_log.info("snapckpt: %s", line)
        self._emit(event)

    def on_failed(self, handle: SaveHandle, exc: BaseException) -> None:
        """Log and emit ``failed``."""
        log.error("rank %d: save of step %d failed: %s", self._rank, handle.step, exc)
        self._emit(Event("failed", handle.step, handle.storage_type, self._rank, error=exc))

    def on_skipped(self, handle: SaveHandle) -> None:
        """Log and emit ``skipped``: another rank skipped this save (its reason in ``handle.skipped_reason``)."""
        log.warning("rank %d: save of step %d skipped: %s", self._rank, handle.step, handle.skipped_reason)
        self._emit(Event("skipped", handle.step, handle.storage_type, self._rank, reason=handle.skipped_reason))

    # ----------------------------------------------------------------------------------- the save
    def save_files(self, files: Mapping[str, Any], step: int, storage_type: StorageType, *, dirname: str,
                   tracker_name: Optional[str], tracker_content: str = "",
                   check_weights_only: bool = False) -> SaveHandle:
        """``Checkpointer.save_files`` (its docstring has the arguments and errors)."""
        check_step(step)
        storage_type = StorageType(storage_type)
        validate_dirname(dirname)
        started = time.monotonic()
        # (a DISK save of a directory whose earlier save is still in flight, a fixed tag or the same step again, is
        # not waited for here: the persister orders the saves of one directory, Scheduler._wait_for_directory)
        self.fence()
        if tracker_name is not None:
            validate_dirname(tracker_name)
            tracker = os.path.join(self._checkpoint_dir, tracker_name)
            if storage_type == StorageType.DISK and self._local and os.path.isdir(tracker) \
                    and not os.path.islink(tracker):
                # rename() cannot replace a directory: every commit would fail at its last step
                raise CheckpointDirError(
                    f"the tracker file {tracker} is a directory, so no commit could replace it: remove or rename "
                    f"it (the checkpoints themselves are in {self._checkpoint_dir}); nothing was written")
        target = os.path.join(self._checkpoint_dir, dirname)
        if storage_type == StorageType.DISK and self._local and (
                dirname == tracker_name or (os.path.lexists(target) and not os.path.isdir(target))):
            # the commit's rename() onto a file fails with a bare NotADirectoryError after the whole write
            what = "the tracker file's name" if dirname == tracker_name else f"{target}, which is not a directory"
            raise CheckpointDirError(f"checkpoint tag {dirname!r} names {what}: pick another tag (or move that "
                                     f"file away); nothing was written")
        for name in files:
            validate_file_name(name)
        if not self._claimed:
            self._claim_dir(step, storage_type)
        if storage_type == StorageType.DISK and dirname in self._other_world:
            self._warn_replacing(step, storage_type, dirname, target)
        t0 = time.perf_counter()
        self.poll()
        try:  # (a failure from here on is this rank's alone, maybe: the other ranks are told, _save_failed)
            prepared = self._stager.prepare(files, step, check_weights_only=check_weights_only)
            t1 = time.perf_counter()
            if storage_type == StorageType.DISK and self._local:
                self._check_free(step, dirname, prepared.total_nbytes)
            reply = self._acquire(step, prepared.total_nbytes, storage_type)
        except Exception as e:
            self._save_failed(step, storage_type, dirname, e)
            raise
        t2 = time.perf_counter()
        if reply is None:
            return self._skip(step, storage_type, dirname)
        slot = reply["slot"]
        try:
            # overlap (CPU sources): a prefault of this slot still running is not waited for on the training
            # thread; the copy thread takes the page faults it left. CUDA sources are among the span copies only
            # (direct tensors are CPU tensors): Prepared.copies would make a view per tensor on every save
            m = self._maps.get(slot, reply["path"], reply["nbytes"], usable=reply.get("usable"),
                               wait_prefault=not self._options.overlap or has_cuda_sources(prepared.span_copies))
        except BaseException as e:
            self._abort_and_fail(slot, step, storage_type, dirname, e)
            raise
        job = _CopyJob(prepared, slot, m, step, storage_type, dirname, tracker_name or "",
                       tracker_content if tracker_name else "", t0, t1, t2, started)
        self._newest = self._copy(job)
        return self._newest

    def _skip(self, step: int, storage_type: StorageType, dirname: str) -> SaveHandle:
        """No free slot with ``on_slot_busy="skip"``: a skipped handle and a ``skipped`` event. A DISK save is
        collective, so the persister is told (``fail`` with a :class:`SaveSkippedError`): the other ranks' saves of
        ``(step, dirname)`` end skipped at once, naming this rank, and the next save of every rank pairs with the
        others' next one (this skip counts as this rank's save of it). A MEMORY save is this rank's alone: the load
        agreement takes the newest step every rank holds."""
        reason = f"rank {self._rank} had no free arena slot for step {step} (on_slot_busy='skip')"
        if storage_type == StorageType.DISK:
            reason += f"; {dirname} is skipped on every rank"
            self._fail_for_every_rank(step, dirname, SaveSkippedError(reason))
        log.warning("rank %d: snapshot of step %d skipped: %s", self._rank, step, reason)
        handle = SaveHandle(self, step, storage_type, None, skipped_reason=reason, dirname=dirname)
        self._emit(Event("skipped", step, storage_type, self._rank, reason=reason))
        return handle

    def _check_free(self, step: int, dirname: str, nbytes: int) -> None:
        """DISK: raise ``InsufficientDiskError`` when ``checkpoint_dir`` has less than ``nbytes`` free (the caller
        fails this step for the other ranks at once: :meth:`_save_failed`)."""
        free = self._storage.free_bytes(self._checkpoint_dir)
        if free < nbytes:
            err = InsufficientDiskError(
                f"{self._checkpoint_dir!r} has {free} bytes free; rank {self._rank}'s part of step {step} "
                f"needs {nbytes}; free space or keep fewer checkpoints (keep_last; "
                "save_total_limit under the Trainer); nothing was written")
            raise err

    def _fail_for_every_rank(self, step: int, dirname: str, err: BaseException) -> None:
        """Tell the persister that this rank's save of ``(step, dirname)`` ends with ``err`` before it (a skip, or a
        failure before the hand-over: :meth:`_save_failed`): the other ranks' saves of it end at once with this cause, not at the commit timeout,
        and it counts as this rank's save of it. A dead or hung persister is only logged: the next save's requests
        raise it."""
        try:
            self._session.request("fail", step=step, dirname=dirname, type=type(err).__name__, message=str(err))
        except SnapckptError as e:
            log.warning("rank %d: could not tell the persister that step %d ends with %s: %s", self._rank, step,
                        type(err).__name__, e)

    def _save_failed(self, step: int, storage_type: StorageType, dirname: str, exc: BaseException) -> None:
        """This rank's save failed before its snapshot was handed over: its preparation, the free-space preflight,
        the slot (no slot freed in time: ``SlotBusyError``; the host-memory budget), or the snapshot copy (its slot
        aborted). A DISK save tells the persister (``fail``, :meth:`_fail_for_every_rank`), so that the other ranks'
        saves of ``(step, dirname)`` end at once with this cause, not at the commit timeout, and this rank's next
        save of them pairs with the others' next one: it counts as this rank's save of them, as a skip does.
        Without it, that next part was taken for this rank's part of the save it failed (written into it beside the
        others' older snapshots, or, that save over, dropped as a late part of it while the others' next save waited
        for it). A streamed part's writer already fails the part on the abort (the persister takes this ``fail`` as
        that save's: ``Scheduler.fail_part``). An interrupt (not an ``Exception``), or a persister that died or
        does not answer (its requests would wait again), tells nothing."""
        if (storage_type == StorageType.DISK and isinstance(exc, Exception)
                and not isinstance(exc, (PersisterDiedError, PersisterTimeoutError))):
            self._fail_for_every_rank(step, dirname, exc)

    def _abort_and_fail(self, slot: int, step: int, storage_type: StorageType, dirname: str, exc: BaseException,
                        *, sync_cuda: bool = False, device_done=None) -> None:
        """This rank's save of ``(step, dirname)`` failed with ``exc`` once it held ``slot``, before the hand-over:
        hand the slot back (:meth:`_abort`; ``sync_cuda`` / ``device_done``: its queued CUDA copies are waited for
        first), then tell the persister (:meth:`_save_failed`), in that order; the caller re-raises ``exc``."""
        self._abort(slot, sync_cuda=sync_cuda, device_done=device_done)
        self._save_failed(step, storage_type, dirname, exc)

    def _copy(self, job: _CopyJob) -> SaveHandle:
        """Copy ``job``'s snapshot into its slot: now, or on the copy thread until the next fence."""
        prepared, m, slot, step, storage_type = job.prepared, job.mapped, job.slot, job.step, job.storage_type
        prepared.views = m.views
        prepared.slot_file = m.file  # small CPU tensors are written by pwritev of the file (span_write)
        prepared.on_caller = not self._options.overlap  # no copy thread: the others by memmove (Stager.copy_into)
        device_done = None
        cuda = has_cuda_sources(prepared.span_copies)
        if cuda or not self._options.overlap:
            # a reserved slot whose prefault was cut short (the first save came first): the rest of its pages mapped
            # by read faults before the copy writes them (overlap, CPU sources: on the copy thread)
            m.populate(prepared.total_nbytes)
        if cuda:
            # Queued on a side stream after the compute stream's work so far; never waited for here.
            try:
                if self.cuda is None:
                    self.cuda = CudaCopier(self._options.cuda_copy_piece_nbytes if self._options.overlap else 0)
                m.cuda = self.cuda
                device_done = self.cuda.start(prepared.span_copies, m.tensor)
            except BaseException as e:
                self._abort_and_fail(slot, step, storage_type, job.dirname, e, sync_cuda=True)
                raise
        try:
            if device_done is None:
                self._stream(job)
        except BaseException as e:
            self._abort_and_fail(slot, step, storage_type, job.dirname, e)
            raise
        if self._options.overlap:
            # The copy runs on the copy thread; fence() (before the optimizer step) waits for it and then
            # hands the slot to the persister. Until then the state must not change.
            job.device_done = device_done
            job.future = self._copy_thread().submit(_timed_copy, prepared, m, device_done)
            job.handle = SaveHandle(self, step, storage_type, None, dirname=job.dirname, copying=True,
                                    started=job.started)
            self._inflight = job
            if storage_type == StorageType.DISK:
                self._handles.append(job.handle)
            return job.handle
        try:
            Stager.copy_into(prepared, m.tensor, m.buf, device_done)
        except BaseException as e:
            self._abort_and_fail(slot, step, storage_type, job.dirname, e, sync_cuda=device_done is not None)
            raise
        return self._copied(job)

    def _stream(self, job: _CopyJob) -> None:
        """Start a streamed copy of ``job`` if it is a local DISK save of CPU tensors (``SNAPCKPT_STREAM_PERSIST``,
        on a CPU whose stores stay in order): write the slot's pickles and index (:meth:`Stager.begin_stream`:
        the copy then publishes the watermark), then tell the persister, which starts writing the files while
        the spans are copied (each byte once the watermark has passed it). The request is not waited for: a
        persister that cannot stream writes the slot at ``ready``, as for any save."""
        if job.storage_type != StorageType.DISK or not self._local or not self._streams:
            return
        p = job.prepared
        Stager.begin_stream(p, job.mapped.buf)
        self._session.post("stream", slot=job.slot, step=job.step, index_offset=p.index_offset,
                           index_nbytes=p.index_nbytes, data_end=p.layout.plan.data_end, dirname=job.dirname,
                           tracker_name=job.tracker_name, tracker_content=job.tracker_content)

    def _claim_dir(self, step: int, storage_type: StorageType) -> None:
        """First save of this Checkpointer: global rank 0 claims ``checkpoint_dir`` for this job
        (:mod:`snapckpt.ondisk.dirclaim`) and every rank learns the outcome, so that all ranks raise together.
        Rank 0 also lists the committed checkpoints written by another world size, with a warning and a
        ``world_size_changed`` event (and another when a DISK save replaces one, :meth:`_warn_replacing`).

        Raises:
            CheckpointDirInUseError: another job holds the claim (on every rank; nothing was saved).
            CheckpointDirError: the lock file cannot be used.
        """
        if self._session.closed:
            raise CheckpointerClosedError(CLOSED)
        mine: Dict[str, Any] = {"ok": True}
        err: Optional[BaseException] = None
        if self._rank == 0:
            try:
                self._claim = dirclaim.claim_dir(self._checkpoint_dir, {"job_id": self._options.job_id,
                                                                        "run_id": self._run_id})
                mine["other_world"] = self._other_world_checkpoints()
            except SnapckptError as e:
                err, mine = e, {"ok": False, "type": type(e).__name__, "error": str(e)}
        got = self._coord.all_gather("claim", mine, self._options.coordination_timeout_secs)[0]
        if err is not None:
            raise err
        if not got["ok"]:
            raise getattr(error_types, got["type"], CheckpointDirError)(got["error"])
        self._claimed = True
        self._other_world = got.get("other_world") or {}
        if self._other_world and self._rank == 0:
            reason = (f"{self._checkpoint_dir} holds checkpoints written by world size "
                      f"{sorted(set(self._other_world.values()))} ({', '.join(sorted(self._other_world))}); this "
                      f"job has world size {self._coord.world_size}. Its saves go next to them (retention counts "
                      "them); a save of one of their steps replaces it, with a warning")
            log.warning("rank 0: %s", reason)
            self._emit(Event("world_size_changed", step, storage_type, self._rank, reason=reason))

    def _other_world_checkpoints(self) -> Dict[str, int]:
        """Rank 0: ``{dirname: world size}`` of the committed checkpoints of another world size ({} when the
        directory cannot be listed: the save itself then says why)."""
        try:
            return {c.dirname: c.manifest["world_size"] for c in list_committed(
                self._storage, self._checkpoint_dir, quick_check=False)
                if c.manifest.get("world_size") != self._coord.world_size}
        except OSError:
            return {}

    def _warn_replacing(self, step: int, storage_type: StorageType, dirname: str, target: str) -> None:
        """Rank 0: a warning and a ``world_size_changed`` event: this DISK save replaces ``target``, a committed
        checkpoint written by another world size (a resume from an earlier step goes on from there, as a
        re-save of a step by the same world size does; said, never silent)."""
        ws = self._other_world.pop(dirname)
        if self._rank != 0 or not os.path.isdir(target):
            return
        reason = (f"step {step}: this save replaces {target}, a committed checkpoint written by world size {ws} "
                  f"(this job has world size {self._coord.world_size}) once it commits; to keep it, save under "
                  "another step or tag, or into another checkpoint directory")
        log.warning("rank 0: %s", reason)
        self._emit(Event("world_size_changed", step, storage_type, self._rank, reason=reason))

    def _abort(self, slot: int, sync_cuda: bool = False, device_done=None) -> None:
        # a queued device-to-host copy must not land in the slot after it is handed back (a paced copy: nor a
        # piece issued later, so its pacer is waited for first)
        waits = [] if device_done is None else [device_done.synchronize]
        if sync_cuda or device_done is not None:
            waits.append(torch.cuda.synchronize)
        for wait in waits:
            try:
                wait()
            except Exception:
                log.exception("rank %d: CUDA synchronize after a failed snapshot copy", self._rank)
        try:
            self._session.request("abort", slot=slot)
        except SnapckptError:
            pass

    def _copy_thread(self):
        if self._copier is None:
            import concurrent.futures as cf

            self._copier = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-copy")
        return self._copier

    def _copied(self, job: _CopyJob) -> SaveHandle:
        """The copy of ``job`` is complete: hand the slot to the persister (READY, and persist for DISK)."""
        faults.point("snapshot.before_ready", step=job.step)
        t3 = time.perf_counter()
        p = job.prepared
        ready = dict(slot=job.slot, step=job.step, index_offset=p.index_offset, index_nbytes=p.index_nbytes,
                     dirname=job.dirname, tracker_name=job.tracker_name, tracker_content=job.tracker_content,
                     persistable=p.persistable, persist=job.storage_type == StorageType.DISK)
        seq = -1
        if job.storage_type == StorageType.MEMORY:
            # not waited for: the answer is read by the next request (the next save's acquire), which raises a
            # refusal; the round trip was 0.4 ms idle and up to 12 ms on a loaded 2-core host, on every save
            self._session.post("ready", check=True, **ready)
        else:  # DISK: a refusal (e.g. the writers cannot take it) fails this save
            seq = int(self._session.request("ready", **ready).get("seq", -1))
        t4 = time.perf_counter()
        if job.handle is None:  # synchronous copy: save blocked for all of it
            stats = SaveStats(job.step, job.storage_type, p.tensor_nbytes, p.total_nbytes, job.t1 - job.t0,
                              job.t2 - job.t1, t3 - job.t2, t4 - job.t0)
        else:  # overlapped: save blocked until the copy was started, then fence() for what remained
            stats = SaveStats(job.step, job.storage_type, p.tensor_nbytes, p.total_nbytes, job.t1 - job.t0,
                              job.t2 - job.t1, job.copy_secs, job.t2 - job.t0 + job.fence_secs + (t4 - t3))
        self.last_stats = stats
        handle = job.handle
        if handle is None:
            handle = SaveHandle(self, job.step, job.storage_type, stats, dirname=job.dirname, started=job.started,
                                seq=seq)
            if job.storage_type == StorageType.DISK:
                self._handles.append(handle)
        else:
            handle.mark_copied(stats, held_in_memory=job.storage_type == StorageType.MEMORY, seq=seq)
        log.info("rank %d: snapshot of step %d taken (%s, %d bytes, blocked %.3f s)", self._rank, job.step,
                 job.storage_type.value, p.tensor_nbytes, stats.blocking_secs)
        self._emit_and_summarise(Event("snapshot_taken", job.step, job.storage_type, self._rank, stats=stats))
        return handle

    def slot_limit(self, slot_nbytes: int) -> int:
        """The slots this rank may use for ``slot_nbytes``-byte slots (``slots_per_rank``, or fewer under the
        host-memory budget: :func:`~snapckpt.engine.preflight.slot_limit`);
        when the size grew, the first local rank warns if the node's arena does not fit the host, and a
        lower count stops the prefaults of slots the persister may now empty.

        Raises:
            InsufficientSharedMemoryError: the budget cannot hold one slot per rank.
        """
        limit = slot_limit(self._options, self._session.topology, slot_nbytes)
        if slot_nbytes > self._checked_nbytes:
            self._checked_nbytes = slot_nbytes
            if self._session.topology.local_rank == 0:
                warning = host_memory_shortfall(self._options, self._session.topology, slot_nbytes, limit,
                                                self._session.arena_dir)
                if warning:
                    log.warning("rank %d: %s", self._rank, warning)
        self._maps.set_limit(limit)
        return limit

    @property
    def acquired(self) -> bool:
        """Whether a save of this rank was handed a slot (its size then follows the saved state)."""
        return self._slot_nbytes > 0

    def _acquire(self, step: int, nbytes: int, storage_type: StorageType) -> Optional[Dict[str, Any]]:
        o = self._options
        want = max(int(nbytes * o.slot_headroom), nbytes)
        if nbytes <= self._slot_nbytes <= want:
            # The size asked for before still holds the state within its headroom: ask for it again, so that the
            # persister hands the slot out as it is and the rank keeps its mapping. A new nbytes x headroom at
            # every save would regrow the slot by the few bytes a state gains per step (a log list, a step
            # number's new digit), and a regrown slot is mapped anew: its copy faults every page in again.
            want = self._slot_nbytes
        limit = self.slot_limit(want)
        deadline = time.monotonic() + o.slot_wait_timeout_secs
        delay = 0.001
        logged = False
        while True:
            reply = self._session.request("acquire", step=step, nbytes=want, slots=limit)
            for n in reply.get("replication") or []:  # the peer tier's news since the last snapshot
                self._emit(Event(str(n["kind"]), int(n["step"]), StorageType.MEMORY, self._rank,
                                 reason=str(n.get("reason", ""))))
            if not reply["busy"]:
                self._slot_nbytes = want  # only once granted: a size the arena refused is not asked again
                return reply
            if o.on_slot_busy == "skip":
                return None
            if not logged:
                log.warning("rank %d: every arena slot is busy (%s); step %d waits for the persister",
                            self._rank, reply.get("detail"), step)
                self._emit(Event("slot_wait", step, storage_type, self._rank,
                                 reason=f"waiting for a free slot ({reply.get('detail')})"))
                logged = True
            if time.monotonic() > deadline:
                raise SlotBusyError(
                    f"rank {self._rank}: no arena slot freed within {o.slot_wait_timeout_secs:g} s "
                    f"for step {step} ({reply.get('detail')}); the persister is slower than the save "
                    "interval: save less often, add slots_per_rank (or host memory budget), or use "
                    "on_slot_busy='skip'")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    # ------------------------------------------------------------------------ fence, wait, poll
    def fence(self) -> None:
        """``Checkpointer.fence``: wait for the in-flight copy, then hand its slot to the persister.

        Raises:
            The copy's own error (the snapshot is then dropped; the slot is freed), or the persister's while
            the slot is handed over (``PersisterDiedError``, ``PersisterTimeoutError``); the save's handle ends
            with that error either way.
        """
        job, self._inflight = self._inflight, None
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            t_copy = job.future.result()
        except BaseException as e:
            self._abort_and_fail(job.slot, job.step, job.storage_type, job.dirname, e, device_done=job.device_done)
            job.handle.fail(e)
            job.handle.mark_reported()
            raise
        job.fence_secs = time.perf_counter() - t0
        job.copy_secs = t_copy
        try:
            self._copied(job)
        except BaseException as e:  # the hand-over failed (a dead or hung persister): the save ends with it
            job.handle.fail(e)
            job.handle.mark_reported()
            raise

    def wait(self, timeout: Optional[float] = None) -> None:
        """``Checkpointer.wait``: fence, then wait for every DISK save; raise the first unreported failure."""
        self.fence()
        handles, self._handles = self._handles, []
        first: Optional[BaseException] = None
        for h in handles:
            reported = h.reported
            try:
                h.wait(timeout)
            except BaseException as e:
                if first is None and not reported:
                    first = e
        if first is not None:
            raise first

    def poll(self) -> None:
        """``Checkpointer.poll``: end the DISK saves the persister finished; raise the first unreported
        failure (each once)."""
        still = []
        first: Optional[BaseException] = None
        for h in self._handles:
            if not h.done():
                still.append(h)
            elif h.exception() is not None and not h.reported:
                if first is None:
                    h.mark_reported()
                    first = h.exception()
                else:
                    still.append(h)
        self._handles = still
        if first is not None:
            raise first

    def at_risk(self) -> bool:
        """Whether a failure now leaves a snapshot of this Saver that is not known to be on disk, which the
        persister's crash flush then writes: a copy not yet handed over, a DISK save not known to be committed,
        or a newest snapshot held in memory only. ``False`` when it took no snapshot, or its newest one and every
        DISK save are known committed. Asks the persister nothing (it may be dead): a commit not yet observed by
        ``poll``/``wait``/``done`` counts as at risk."""
        if self._newest is None:
            return False
        return (self._inflight is not None or not self._newest.committed
                or any(not h.committed for h in self._handles))

    def stop_copy_thread(self) -> None:
        """Stop the copy thread and the CUDA pacer, if started, after their current jobs (``Checkpointer.close``)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        if self.cuda is not None:
            self.cuda.close()

    def release_claim(self) -> None:
        """Release the writer claim of ``checkpoint_dir`` (rank 0, if it claimed it)."""
        if self._claim is not None:
            self._claim.release()
