"""Checkpointer: the one object a training loop talks to (save / fence / load / wait / close).

A save of step ``N`` on each rank: plan and pickle the skeleton (:class:`~snapckpt.engine.stager.Stager`),
get a slot from the node persister, copy the state into it, mark it READY; for the DISK tier also ask the
persister to write and commit it. ``save`` returns once the copy is done: the state may then change
freely (DESIGN contract 1). Background failures surface on the next call or on ``SaveHandle.wait``.

A load is collective: every rank reports which steps it holds in memory, rank 0 lists the committed
steps on disk, and every rank picks the same newest step complete on all ranks (memory first when it is
at least as new as disk); if any rank cannot read it (a torn memory slot, a corrupt file), all ranks move
to the next candidate together (cases B3, C2, C9).
"""
from __future__ import annotations

import copy
import errno
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from snapckpt.ondisk import dirclaim
from snapckpt._internal import faultpoints as faults
from snapckpt.ondisk import layout
from snapckpt import errors as error_types
from snapckpt.engine.device_copy import CudaCopier, has_cuda_sources
from snapckpt.dist.coordination import Coordinator, make_coordinator
from snapckpt.errors import (CheckpointCorruptError, all_damaged_error, CheckpointDirError, CheckpointNotFoundError,
                     IncompatibleCheckpointError, InsufficientDiskError, PersisterDiedError,
                     SlotBusyError, SnapckptError, UnsafeCheckpointError)
from snapckpt.events import Event, SaveStats, StorageType
from snapckpt.formats import respec
from snapckpt.engine.handle import SaveHandle
from snapckpt.ondisk.manifest import (MANIFEST, check_checksums, check_sizes, list_committed, parse_manifest, validate_dirname,
                       validate_file_name)
from snapckpt.options import CheckpointOptions
from snapckpt._internal.progress import byte_bar
from snapckpt.persister.client import PersisterClient, job_dirs, job_key
from snapckpt.engine.slot_maps import MappedSlot, SlotMaps
from snapckpt.engine.stager import Stager, read_slot
from snapckpt.storage.factory import check_location, open_storage
from snapckpt.storage.posix import PosixStorage
from snapckpt.dist.topology import Topology, host_identity

__all__ = ["Checkpointer", "LoadCandidate", "LoadInfo"]

DIR_ID_XATTR = "user.snapckpt.dir_id"  # random id of a checkpoint directory, an extended attribute of it

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadInfo:
    """What the last ``load`` restored (``Checkpointer.last_load``).

    Attributes:
        step: the step loaded (``load`` returns the state only: this is where its step is).
        tier: ``StorageType.MEMORY`` or ``StorageType.DISK``.
        seconds: how long the load took.
        skipped: newer candidates that were tried first and refused, one line each (step, tier, directory,
            ranks and cause, e.g. a checksum mismatch); empty when the newest candidate loaded.
    """

    step: int
    tier: StorageType
    seconds: float
    skipped: Tuple[str, ...] = ()


class LoadCandidate:
    """One checkpoint the ranks agreed to try loading (see :meth:`Checkpointer.load_with`).

    Attributes:
        step: its step (int).
        tier: ``StorageType.MEMORY`` or ``StorageType.DISK``.
        dirname: its directory name (the tag) for DISK, ``None`` for MEMORY.
        path: absolute path of the committed directory for DISK, ``None`` for MEMORY.
    """

    def __init__(self, owner: "Checkpointer", step: int, tier: StorageType, key: Optional[str]) -> None:
        self._owner, self.step, self.tier, self._key = owner, step, tier, key
        self.dirname = key if tier == StorageType.DISK else None
        self.path = os.path.join(owner.checkpoint_dir, key) if tier == StorageType.DISK else None

    _files: Optional[Dict[str, Any]] = None

    def files(self) -> Dict[str, Any]:
        """This rank's files: ``{name: object}`` (torch files unpickled with CPU tensors, raw files as
        ``bytes``). MEMORY: every file of the rank's snapshot, ``MemoryOnly`` ones included. DISK: the files
        the manifest assigns to this rank, sizes and checksums verified first. Read once, then kept.

        Raises:
            CheckpointCorruptError / CheckpointNotFoundError: damaged or vanished; UnsafeCheckpointError.
        """
        if self._files is None:
            self._files = self._owner._read_candidate(self)
        return self._files

    def verify(self) -> None:
        """DISK: check this rank's files against the manifest (sizes, and checksums unless
        ``verify_checksums=False``); raises :class:`~snapckpt.errors.CheckpointCorruptError`. MEMORY: no-op."""
        if self.tier == StorageType.DISK:
            self._owner._verify_disk(self.path, self.dirname)

    def __repr__(self) -> str:
        return f"LoadCandidate(step={self.step}, tier={self.tier.value}, dirname={self.dirname!r})"


class _CopyJob:
    """One snapshot between slot acquisition and the hand-over to the persister."""

    def __init__(self, prepared, slot: int, mapped: MappedSlot, step: int, storage_type: StorageType,
                 dirname: str, tracker_name: str, tracker_content: str, t0: float, t1: float, t2: float):
        self.prepared, self.slot, self.mapped, self.step = prepared, slot, mapped, step
        self.storage_type, self.dirname = storage_type, dirname
        self.tracker_name, self.tracker_content = tracker_name, tracker_content
        self.t0, self.t1, self.t2 = t0, t1, t2
        self.future = None
        self.handle: Optional[SaveHandle] = None
        self.fence_secs = 0.0
        self.copy_secs = 0.0
        self.device_done = None  # the event of the CUDA copies queued for this job, if any


class Checkpointer:
    """Asynchronous, crash-safe checkpoints of one training job.

    Args:
        checkpoint_dir: directory of committed checkpoints (created if missing; must be writable).
        **options: fields of :class:`~snapckpt.options.CheckpointOptions` (``keep_last``, ``shm_dir``,
            ``job_id``, timeouts...).

    The constructor is collective when ``torch.distributed`` is initialized: every rank must build its
    Checkpointers in the same order. Rank, world size and the ranks of this node come from
    ``torch.distributed`` (case C6).

    Raises:
        CheckpointDirError: ``checkpoint_dir`` is not a non-empty path (``None``, bytes...), or cannot be
            created or written.
        RankTimeoutError: some ranks did not construct theirs within ``coordination_timeout_secs``.
        PersisterError: the node persister could not be started or refused this rank.
    """

    def __init__(self, checkpoint_dir: "str | os.PathLike[str]", **options: Any) -> None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
            raise CheckpointDirError(
                f"checkpoint_dir must be a non-empty path (a str or os.PathLike naming the directory that holds "
                f"the checkpoints, e.g. Checkpointer(\"ckpt\")), not {checkpoint_dir!r} "
                f"({type(checkpoint_dir).__name__})")
        self.options = CheckpointOptions.from_kwargs(**options)
        self.checkpoint_dir = os.path.abspath(check_location(checkpoint_dir))
        self.job = job_key(self.checkpoint_dir, self.options.job_id)
        self._coord = make_coordinator(self.job, self.options.coordination_timeout_secs)
        self._maps = SlotMaps(self._coord.rank, self.options.slots_per_rank, self.options.slot_wait_timeout_secs)
        self._storage = open_storage(self.checkpoint_dir, fsync=self.options.fsync)
        self._stager = Stager()
        self._handles: List[SaveHandle] = []
        self._listeners: List[Callable[[Event], None]] = []
        self._inflight: Optional[_CopyJob] = None  # an overlapped copy not yet fenced
        self._copier = None  # the copy thread (overlap=True), started on first use
        self._cuda: Optional[CudaCopier] = None  # side-stream copies of CUDA tensors, made on first use
        self._closed = False
        self._claim: Optional[dirclaim.DirClaim] = None
        self._claimed = False  # the writer claim of checkpoint_dir was settled (see _claim_dir)
        self.last_load: Optional[LoadInfo] = None
        self.last_stats: Optional[SaveStats] = None
        t = self.options.coordination_timeout_secs
        # A run id starts with the job key: a persister only ever cleans up its own job's leftovers.
        me = {"host": host_identity(), "run_id": self.job + uuid.uuid4().hex[:12], "pid": os.getpid()}
        everyone = self._coord.all_gather("init", me, t)
        self.topology = Topology.from_hosts(self._coord.rank, [p["host"] for p in everyone])
        faults.set_rank(self._coord.rank)
        self.run_id = everyone[0]["run_id"]
        self._preflight_dir()
        # The directory's identity: memory snapshots taken for a directory that was deleted and re-created
        # since belong to another run and are never loaded (inode numbers are reused: a random id instead).
        mine = self._dir_identity() if self._coord.rank == 0 else ""
        self._dir_id = self._coord.all_gather("dir_id", {"id": mine}, t)[0]["id"]
        rt, arena = job_dirs(self.options.resolved_runtime_dir, self.options.resolved_shm_dir, self.job)
        self._client = PersisterClient(
            rt, arena, self.job, startup_timeout_secs=self.options.persister_startup_timeout_secs,
            request_timeout_secs=self.options.request_timeout_secs,
            idle_timeout_secs=self.options.persister_idle_timeout_secs)
        self._connect()
        self._coord.all_gather("connected", {"ok": True}, t)

    # ---------------------------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.topology.world_size

    @property
    def persister_pid(self) -> Optional[int]:
        """Process id of the node persister this rank talks to."""
        return self._client.persister_pid

    @property
    def coordinator(self) -> Coordinator:
        """This job's checkpoint coordination channel (never the training process group): ``gather``,
        ``broadcast`` from rank 0 and ``agree`` on errors, each collective and bounded by
        ``coordination_timeout_secs`` (:class:`~snapckpt.dist.coordination.Coordinator`). Integrations use
        it to make every rank take the same decision."""
        return self._coord

    @property
    def storage(self) -> PosixStorage:
        """The storage reader/writer of ``checkpoint_dir`` (built once by
        :func:`~snapckpt.storage.factory.open_storage`)."""
        return self._storage

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run: every later save or load raises."""
        return self._closed

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn(event)`` for every :class:`~snapckpt.events.Event` of this rank."""
        self._listeners.append(fn)

    # ------------------------------------------------------------------------------------ plumbing
    def _emit(self, event: Event) -> None:
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # a user callback never breaks checkpointing
                log.exception("snapckpt event listener failed on %s", event.kind)

    def _context(self, step: int) -> str:
        return f"rank {self.rank}, step {step}, persister pid {self._client.persister_pid}"

    def _preflight_dir(self) -> None:
        d = self.checkpoint_dir
        probe = os.path.join(d, f".snapckpt-probe-{self.run_id}-{self.rank}")
        if os.path.exists(d) and not os.path.isdir(d):
            raise CheckpointDirError(f"checkpoint directory {d!r} exists and is not a directory; pick "
                                     "another path")
        shm = self.options.resolved_shm_dir
        if not os.path.isdir(shm):
            from snapckpt.errors import PreflightError

            raise PreflightError(f"shared-memory directory {shm!r} does not exist; point shm_dir= (or "
                                 "SNAPCKPT_SHM_DIR) at an existing tmpfs such as /dev/shm")
        if _fs_type(shm) not in ("tmpfs", "ramfs", "hugetlbfs", None):
            log.warning("shm_dir %r is on a %s filesystem, not a tmpfs: memory snapshots will be written to "
                        "that disk and will be slow", shm, _fs_type(shm))
        try:
            os.makedirs(d, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as e:
            try:
                os.unlink(probe)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CheckpointDirError(f"checkpoint directory {d!r} is full (rank {self.rank}: {e.strerror}); "
                                         "free space (older checkpoints, leftover .*.partial-* directories) "
                                         "or pick another directory") from e
            raise CheckpointDirError(f"checkpoint directory {d!r} is not writable by rank {self.rank}: "
                                     f"{e.strerror or e}; fix its permissions or pick another directory") from e

    def _dir_identity(self) -> str:
        """Rank 0: a random id kept in the extended attribute ``user.snapckpt.dir_id`` of the checkpoint
        directory (created on first use; it goes with the directory, and listings do not show it). ``""``
        where the filesystem has no user xattrs: then memory snapshots are not tied to the directory."""
        d = self.checkpoint_dir
        try:
            return os.getxattr(d, DIR_ID_XATTR).decode("ascii")
        except OSError as e:
            if e.errno not in (errno.ENODATA, getattr(errno, "ENOATTR", errno.ENODATA)):
                return ""
        value = uuid.uuid4().hex
        try:
            os.setxattr(d, DIR_ID_XATTR, value.encode("ascii"), os.XATTR_CREATE)
            return value
        except FileExistsError:
            return os.getxattr(d, DIR_ID_XATTR).decode("ascii")
        except OSError:
            return ""

    def _connect(self) -> None:
        o = self.options
        self._maps.drop()
        self._client.connect({
            "run_id": self.run_id, "rank": self.rank, "world_size": self.world_size,
            "local_ranks": list(self.topology.local_ranks), "committer": self.rank == 0,
            "pid": os.getpid(), "checkpoint_dir": self.checkpoint_dir, "slots_per_rank": o.slots_per_rank,
            "keep_last": -1 if o.keep_last is None else o.keep_last,
            "commit_timeout_secs": o.commit_timeout_secs, "flush_on_crash": o.flush_on_crash,
            "fsync": o.fsync, "dir_id": self._dir_id})

    def _request(self, op: str, **fields: Any) -> Dict[str, Any]:
        if self._closed:
            raise SnapckptError("this Checkpointer is closed")
        if not self._client.connected:
            self._connect()
        return self._client.request(op, **fields)

    def _status(self, step: int, dirname: str) -> Dict[str, Any]:
        return self._request("status", step=step, dirname=dirname)

    def _lost_error(self, step: int) -> Exception:
        return PersisterDiedError(f"the persister no longer knows step {step} (it was restarted); that save is "
                                  "lost, committed checkpoints are intact; the next call uses the new persister: "
                                  f"repeat that save; {self._context(step)}")

    def _on_committed(self, handle: SaveHandle) -> None:
        log.info("rank %d: step %d committed to %s", self.rank, handle.step, self.checkpoint_dir)
        self._emit(Event("committed", handle.step, handle.storage_type, self.rank))

    def _on_failed(self, handle: SaveHandle, exc: BaseException) -> None:
        log.error("rank %d: save of step %d failed: %s", self.rank, handle.step, exc)
        self._emit(Event("failed", handle.step, handle.storage_type, self.rank, error=exc))

    def poll(self) -> None:
        """Ask the persister about outstanding DISK saves without waiting: their ``committed`` / ``failed``
        events fire now, on the caller's thread, and the first failure nobody has seen yet is raised
        (each failure once; a second one is raised at a later call). One request per outstanding save;
        none when there is none. ``save`` calls it first; ``HookRegistry.step_end`` on other steps."""
        still = []
        first: Optional[BaseException] = None
        for h in self._handles:
            if not h.done():
                still.append(h)
            elif h.exception() is not None and not h._reported:
                if first is None:
                    h._reported = True
                    first = h.exception()
                else:
                    still.append(h)
        self._handles = still
        if first is not None:
            raise first

    # ---------------------------------------------------------------------------------------- save
    def save(self, state_dict: Any, step: int, storage_type: StorageType = StorageType.DISK) -> SaveHandle:
        """Snapshot ``state_dict`` at ``step``; return once it is safe from later mutation.

        Args:
            state_dict: any picklable object holding CPU or CUDA tensors: model and optimizer state
                dicts, scheduler state, RNG states, counters, user objects. CUDA tensors are copied on a
                side stream into page-locked shared memory (:mod:`snapckpt.engine.device_copy`).
            step: training step, an ``int`` in ``[0, 2**63 - 1]``; names the directory ``step_%08d``.
            storage_type: ``MEMORY`` keeps it in the node's shared memory; ``DISK`` also writes it to
                ``checkpoint_dir`` and commits it in the background.

        Collective: every rank saves the same step (a rank that does not makes the commit fail with
        the missing ranks named).

        Raises:
            ValueError: ``step`` is not an ``int`` in ``[0, 2**63 - 1]`` (a bool, a float, negative, too large).
            CheckpointDirInUseError: another job (another process) saves into ``checkpoint_dir``
                (:mod:`snapckpt.ondisk.dirclaim`); raised by the first save, on every rank; nothing was saved.
            SnapshotError: the state holds an unsupported tensor.
            InsufficientSharedMemoryError / InsufficientDiskError: preflight; nothing was changed.
            CheckpointDirError: DISK, and the tracker file (``latest``) is a directory, which no commit could
                replace; nothing was saved.
            SlotBusyError: ``on_slot_busy="wait"`` and no slot freed in time.
            PersisterDiedError / PersisterTimeoutError: the persister died or hangs.
            An earlier save's background failure, once, with its original type.
        """
        _check_step(step)
        return self.save_files({layout.rank_filename(self.rank): state_dict}, step, storage_type,
                                dirname=layout.step_dirname(step), tracker_name=layout.TRACKER,
                                tracker_content=layout.step_dirname(step),
                                check_weights_only=self.options.weights_only)

    def save_files(self, files: Mapping[str, Any], step: int, storage_type: StorageType, *, dirname: str,
                    tracker_name: Optional[str], tracker_content: str = "",
                    check_weights_only: bool = False) -> SaveHandle:
        """Save several files of this rank as one step (the integrations' entry point); see :meth:`save`.

        Args:
            files: ``{file name inside dirname: value}``; a value is a file spec of
                :mod:`snapckpt.formats` (``TorchSave``, ``RawBytes``, ``Concat``, ``MemoryOnly``) or a
                plain object (a ``TorchSave``). ``{}`` is a valid, empty part.
            dirname: the checkpoint's directory name under ``checkpoint_dir`` (a tag: one path component).
            tracker_name: tracker file replaced with ``tracker_content`` after the commit (``None``: none).
            check_weights_only: warn once per new plan when :meth:`load` (``weights_only=True``) would
                refuse the state (:meth:`save` sets it; integrations have their own loaders).
        """
        _check_step(step)
        storage_type = StorageType(storage_type)
        validate_dirname(dirname)
        self.fence()
        if storage_type == StorageType.DISK:
            # the same step and directory again: the first save must end first (its commit would otherwise
            # race the second, and ranks could decide differently)
            for h in [h for h in self._handles if h.step == step and h.dirname == dirname]:
                h.wait()
        if tracker_name is not None:
            validate_dirname(tracker_name)
            tracker = os.path.join(self.checkpoint_dir, tracker_name)
            if storage_type == StorageType.DISK and os.path.isdir(tracker) and not os.path.islink(tracker):
                # rename() cannot replace a directory: every commit would fail at its last step
                raise CheckpointDirError(
                    f"the tracker file {tracker} is a directory, so no commit could replace it: remove or rename "
                    f"it (the checkpoints themselves are in {self.checkpoint_dir}); nothing was written")
        for name in files:
            validate_file_name(name)
        if not self._claimed:
            self._claim_dir()
        t0 = time.perf_counter()
        self.poll()
        prepared = self._stager.prepare(files, step, check_weights_only=check_weights_only)
        t1 = time.perf_counter()
        if storage_type == StorageType.DISK:
            free = self._storage.free_bytes(self.checkpoint_dir)
            if free < prepared.total_nbytes:
                err = InsufficientDiskError(
                    f"{self.checkpoint_dir!r} has {free} bytes free; rank {self.rank}'s part of step {step} "
                    f"needs {prepared.total_nbytes}; free space or keep fewer checkpoints (keep_last; "
                    "save_total_limit under the Trainer); nothing was written")
                try:  # the other ranks' saves of this step fail at once with this cause, not at a timeout
                    self._request("fail", step=step, dirname=dirname, type=type(err).__name__, message=str(err))
                except SnapckptError:
                    pass
                raise err
        reply = self._acquire(step, prepared.total_nbytes, storage_type)
        t2 = time.perf_counter()
        if reply is None:
            reason = f"no free arena slot for step {step} (on_slot_busy='skip')"
            log.warning("rank %d: snapshot of step %d skipped: %s", self.rank, step, reason)
            handle = SaveHandle(self, step, storage_type, None, skipped_reason=reason, dirname=dirname)
            self._emit(Event("skipped", step, storage_type, self.rank, reason=reason))
            return handle
        slot = reply["slot"]
        try:
            m = self._maps.get(slot, reply["path"], reply["nbytes"])
        except BaseException:
            self._abort(slot)
            raise
        job = _CopyJob(prepared, slot, m, step, storage_type, dirname, tracker_name or "",
                       tracker_content if tracker_name else "", t0, t1, t2)
        device_done = None
        if has_cuda_sources(prepared.copies):
            # Queued on a side stream after the compute stream's work so far; never waited for here.
            try:
                if self._cuda is None:
                    self._cuda = CudaCopier()
                m.cuda = self._cuda
                device_done = self._cuda.start(prepared.copies, m.tensor)
            except BaseException:
                self._abort(slot, sync_cuda=True)
                raise
        if self.options.overlap:
            # The copy runs on the copy thread; fence() (before the optimizer step) waits for it and then
            # hands the slot to the persister. Until then the state must not change.
            job.device_done = device_done
            job.future = self._copy_thread().submit(_timed_copy, prepared, m.tensor, m.buf, device_done)
            job.handle = SaveHandle(self, step, storage_type, None, dirname=dirname, copying=True)
            self._inflight = job
            if storage_type == StorageType.DISK:
                self._handles.append(job.handle)
            return job.handle
        try:
            Stager.copy_into(prepared, m.tensor, m.buf, device_done)
        except BaseException:
            self._abort(slot, sync_cuda=device_done is not None)
            raise
        return self._copied(job)

    def _claim_dir(self) -> None:
        """First save of this Checkpointer: global rank 0 claims ``checkpoint_dir`` for this job
        (:mod:`snapckpt.ondisk.dirclaim`) and every rank learns the outcome, so that all ranks raise together.

        Raises:
            CheckpointDirInUseError: another job holds the claim (on every rank; nothing was saved).
            CheckpointDirError: the lock file cannot be used.
        """
        if self._closed:
            raise SnapckptError("this Checkpointer is closed")
        mine: Dict[str, Any] = {"ok": True}
        err: Optional[BaseException] = None
        if self.rank == 0:
            try:
                self._claim = dirclaim.claim_dir(self.checkpoint_dir, {"job_id": self.options.job_id,
                                                                       "run_id": self.run_id})
            except SnapckptError as e:
                err, mine = e, {"ok": False, "type": type(e).__name__, "error": str(e)}
        got = self._coord.all_gather("claim", mine, self.options.coordination_timeout_secs)[0]
        if err is not None:
            raise err
        if not got["ok"]:
            raise getattr(error_types, got["type"], CheckpointDirError)(got["error"])
        self._claimed = True

    def _abort(self, slot: int, sync_cuda: bool = False) -> None:
        if sync_cuda:  # a queued device-to-host copy must not land in the slot after it is handed back
            try:
                torch.cuda.synchronize()
            except Exception:
                log.exception("rank %d: CUDA synchronize after a failed snapshot copy", self.rank)
        try:
            self._request("abort", slot=slot)
        except SnapckptError:
            pass

    def _copy_thread(self):
        if self._copier is None:
            import concurrent.futures as cf

            self._copier = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-copy")
        return self._copier

    def _copied(self, job: "_CopyJob") -> SaveHandle:
        """The copy of ``job`` is complete: hand the slot to the persister (READY, and persist for DISK)."""
        faults.point("snapshot.before_ready", step=job.step)
        t3 = time.perf_counter()
        p = job.prepared
        self._request("ready", slot=job.slot, step=job.step, index_offset=p.index_offset,
                      index_nbytes=p.index_nbytes, dirname=job.dirname, tracker_name=job.tracker_name,
                      tracker_content=job.tracker_content, persistable=p.persistable,
                      persist=job.storage_type == StorageType.DISK)
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
            handle = SaveHandle(self, job.step, job.storage_type, stats, dirname=job.dirname)
            if job.storage_type == StorageType.DISK:
                self._handles.append(handle)
        else:
            handle.stats = stats
            handle._copying = False
            if job.storage_type == StorageType.MEMORY:
                handle._state = "done"  # held in memory from now on
        log.info("rank %d: snapshot of step %d taken (%s, %d bytes, blocked %.3f s)", self.rank, job.step,
                 job.storage_type.value, p.tensor_nbytes, stats.blocking_secs)
        self._emit(Event("snapshot_taken", job.step, job.storage_type, self.rank, stats=stats))
        return handle

    def _acquire(self, step: int, nbytes: int, storage_type: StorageType) -> Optional[Dict[str, Any]]:
        want = int(nbytes * self.options.slot_headroom)
        deadline = time.monotonic() + self.options.slot_wait_timeout_secs
        delay = 0.001
        logged = False
        while True:
            reply = self._request("acquire", step=step, nbytes=max(want, nbytes))
            if not reply["busy"]:
                return reply
            if self.options.on_slot_busy == "skip":
                return None
            if not logged:
                log.warning("rank %d: every arena slot is busy (%s); step %d waits for the persister",
                            self.rank, reply.get("detail"), step)
                self._emit(Event("slot_wait", step, storage_type, self.rank,
                                 reason=f"waiting for a free slot ({reply.get('detail')})"))
                logged = True
            if time.monotonic() > deadline:
                raise SlotBusyError(
                    f"rank {self.rank}: no arena slot freed within {self.options.slot_wait_timeout_secs:g} s "
                    f"for step {step} ({reply.get('detail')}); the persister is slower than the save "
                    "interval: save less often, add slots_per_rank, or use on_slot_busy='skip'")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def fence(self) -> None:
        """Wait until the in-flight snapshot copy is done (call before ``optimizer.step()``).

        With ``overlap=False`` (the default) ``save`` copies before it returns and this returns at once.
        With ``overlap=True`` the copy runs on a copy thread while training goes on (forward, backward);
        this waits for it, then hands the slot to the persister. Every other call (``save``, ``wait``,
        ``load``, ``close``) fences first.

        Raises:
            The copy's own error (the snapshot is then dropped; the slot is freed).
        """
        job, self._inflight = self._inflight, None
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            t_copy = job.future.result()
        except BaseException as e:
            self._abort(job.slot, sync_cuda=job.device_done is not None)
            job.handle._copying = False
            job.handle._fail(e)
            job.handle._reported = True
            raise
        job.fence_secs = time.perf_counter() - t0
        job.copy_secs = t_copy
        self._copied(job)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every DISK save of this rank is committed; raise the first failure not already
        raised to the caller (by ``SaveHandle.wait`` or an earlier call): each failure is raised once."""
        self.fence()
        handles, self._handles = self._handles, []
        first: Optional[BaseException] = None
        for h in handles:
            reported = h._reported
            try:
                h.wait(timeout)
            except BaseException as e:
                if first is None and not reported:
                    first = e
        if first is not None:
            raise first

    # ---------------------------------------------------------------------------------------- load
    def _candidates(self, step: Optional[int] = None) -> List[Tuple[int, str, Optional[str]]]:
        """Agree with all ranks on the load candidates: ``[(step, "memory"|"disk", dirname)]``, newest first.

        Directories skipped as damaged are kept in ``self._damaged`` (``"dirname: what is wrong"``). With
        ``step``, a committed directory whose files fail the quick size check is still a candidate, so
        that reading it fails with an error naming the damaged file instead of "not found" (case B3).
        """
        held = self._request("held")["slots"]
        stale = sorted({s["step"] for s in held if s.get("dir_id") not in (None, self._dir_id)})
        if stale:
            log.warning("rank %d: memory snapshots of steps %s belong to an earlier %s that was deleted and "
                        "re-created; they are ignored (a fresh start)", self.rank, stale, self.checkpoint_dir)
        mem = sorted({(s["step"], s["run_id"]) for s in held if s.get("world_size", self.world_size)
                      == self.world_size and s.get("dir_id") in (None, self._dir_id)})
        disk: List[List[Any]] = []
        problems: List[str] = []
        if self.rank == 0:
            for c in list_committed(self._storage, self.checkpoint_dir, quick_check=step is None,
                                    problems=problems, name_pattern=layout.STEP_DIR_PATTERN):
                saved = c.manifest.get("requested_unix", c.manifest.get("created_unix", 0.0))
                disk.append([c.step, c.dirname, c.manifest["world_size"], saved])
            for p in problems:
                log.warning("not a loadable checkpoint: %s", p)
        everyone = self._coord.all_gather("candidates", {"mem": mem, "disk": disk, "damaged": problems},
                                          self.options.coordination_timeout_secs)
        self._damaged: List[str] = everyone[0]["damaged"]
        common = None
        for p in everyone:
            steps = {tuple(x) for x in p["mem"]}
            common = steps if common is None else common & steps
        if not common and any(p["mem"] for p in everyone):
            log.warning("rank %d: ranks hold memory snapshots but no step is held by every rank (%s); "
                        "the memory tier cannot be used", self.rank,
                        {r: [m[0] for m in p["mem"]] for r, p in enumerate(everyone)})
        disk_all = everyone[0]["disk"]
        wrong = [d for d in disk_all if d[2] != self.world_size]
        disk_ok = [d for d in disk_all if d[2] == self.world_size]
        self._disk_saved = [(d[0], d[1], d[3]) for d in disk_ok]  # (step, dirname, saved at), see _warn_rewind
        cands: List[Tuple[int, str, Optional[str]]] = [(s, "memory", rid) for s, rid in (common or set())]
        cands += [(d[0], "disk", d[1]) for d in disk_ok]
        cands.sort(key=lambda c: (c[0], c[1] == "memory"), reverse=True)
        if not cands and wrong:
            raise IncompatibleCheckpointError(
                f"{self.checkpoint_dir} holds checkpoints written by world size "
                f"{sorted({d[2] for d in wrong})}, this job has {self.world_size}; snapckpt does not "
                "reshard: resume with the same number of ranks")
        return cands

    def latest_step(self) -> Optional[int]:
        """Newest step complete on every rank, in memory or on disk; ``None`` if there is no checkpoint at
        all (a fresh start is safe). Collective.

        It checks completeness, not content: a disk checkpoint counts when its manifest is valid and every
        file it lists (every rank's) exists with the listed size; a memory snapshot when every rank holds
        it. Checksums are not read here (that would read every byte): a file damaged in place (a flipped
        byte) still counts. :meth:`load` verifies the checksums, and if the newest step fails them it loads
        the newest step that verifies, with a warning naming the refused step and why; which step it
        loaded is then ``last_load.step`` (not necessarily ``latest_step()``). ``snapckpt verify <dir>``
        checks every checksum.

        Raises:
            CheckpointCorruptError: checkpoints exist but none is complete (each directory was skipped as
                damaged); the message lists them and the fix. Not ``None``: that would start the run afresh.
        """
        self.wait()
        cands = self._candidates()
        if not cands and self._damaged:
            self._raise_nothing_loadable(None, [])
        return cands[0][0] if cands else None

    def _verify_disk(self, path: str, dirname: str) -> Dict[str, Any]:
        mpath = os.path.join(path, MANIFEST)
        m = parse_manifest(self._storage.read_bytes(mpath), dirname, source=mpath)
        if self.options.verify_checksums:
            mine = sum(int(r.get("nbytes", 0)) for r in m["files"].values() if r.get("rank") == self.rank)
            # A bar for a long read (>= 1 GiB), on local rank 0 only, when its stderr is a terminal.
            show = None if mine >= (1 << 30) and self.topology.local_rank == 0 else False
            with byte_bar(mine, f"verifying {dirname}", show) as bar:
                check_checksums(self._storage, path, m, rank=self.rank, progress=bar.update)
        else:
            check_sizes(self._storage, path, m, rank=self.rank)
        return m

    def _read_candidate(self, cand: "LoadCandidate", views: bool = False) -> Dict[str, Any]:
        if cand.tier == StorageType.MEMORY:
            held = self._request("held")["slots"]
            mine = [s for s in held if s["step"] == cand.step and s["run_id"] == cand._key]
            if not mine:
                raise CheckpointNotFoundError(f"rank {self.rank} no longer holds step {cand.step} in memory")
            s = max(mine, key=lambda x: x["seq"])
            m = self._maps.get(s["slot"], s["path"], s["nbytes"])
            got_step, files = read_slot(m.buf, m.tensor, weights_only=self.options.weights_only, source=m.path,
                                        copy=not views)
            if got_step != cand.step:
                raise CheckpointCorruptError(f"memory slot of rank {self.rank} holds step {got_step}, "
                                             f"not {cand.step}")
            return files
        path = cand.path
        m = self._verify_disk(path, cand.dirname)

        def read(name: str, rec: Dict[str, Any]) -> Any:
            if rec.get("kind", "torch") == "bytes":
                return self._storage.read_bytes(os.path.join(path, name))
            try:
                return torch.load(os.path.join(path, name), map_location="cpu",
                                  weights_only=self.options.weights_only, mmap=views)
            except Exception as e:
                if self.options.weights_only and "weights_only" in str(e):
                    raise UnsafeCheckpointError(
                        f"{os.path.join(path, name)} holds objects that weights_only=True refuses; if you "
                        "trust this checkpoint directory pass weights_only=False to the Checkpointer") from e
                raise

        mine = [(name, rec) for name, rec in sorted(m["files"].items()) if rec["rank"] == self.rank]
        if len(mine) <= 1:
            return {name: read(name, rec) for name, rec in mine}
        import concurrent.futures as cf

        # Several files of this rank (DeepSpeed's model and optimizer states, a Trainer's folder): read in
        # parallel; file reads release the GIL.
        with cf.ThreadPoolExecutor(max_workers=min(4, len(mine)), thread_name_prefix="snapckpt-load") as ex:
            futures = [(name, ex.submit(read, name, rec)) for name, rec in mine]
            return {name: fut.result() for name, fut in futures}

    def load_with(self, fn: Callable[["LoadCandidate"], Any], step: Optional[int] = None, *,
                   dirname: Optional[str] = None, check: Optional[Callable[["LoadCandidate"], Any]] = None
                   ) -> Tuple[Any, "LoadCandidate"]:
        """Collective: agree on load candidates with every rank, newest first, and return
        ``(fn(candidate), candidate)`` for the first candidate ``fn`` succeeded on in every rank.

        The integrations' entry point for loading: ``fn`` restores the framework's state from
        ``candidate.files()`` (either tier) or through the framework's own loader from
        ``candidate.path`` (DISK, after ``candidate.verify()``). When ``fn`` raises on any rank, every rank
        moves to the next candidate together (a warning names the ranks and errors).

        Args:
            step: only candidates of this step.
            dirname: only the committed directory of this name (DISK).
            check: run first on every rank, then agreed on: when it raises on any rank, no rank calls ``fn``
                for that candidate. A framework loader that runs collectives of the training group (DeepSpeed
                ZeRO-3) must only be called once every rank knows its files are intact: pass
                ``check=lambda c: c.verify()`` (or ``c.files()``, which is kept for ``fn``).

        Raises:
            CheckpointNotFoundError, CheckpointCorruptError, IncompatibleCheckpointError,
            UnsafeCheckpointError: as :meth:`load`.
        """
        if step is not None:
            check_step(step)
        self.wait()
        t0 = time.perf_counter()
        cands = self._candidates(step)
        if step is not None:
            cands = [c for c in cands if c[0] == step]
        if dirname is not None:
            cands = [c for c in cands if c[1] == "disk" and c[2] == dirname]
        errors: List[str] = []
        for cstep, tier, key in cands:
            cand = LoadCandidate(self, cstep, StorageType.MEMORY if tier == "memory" else StorageType.DISK, key)
            result = None
            bad = {}
            for phase, call in (("checked", check), ("loaded", fn)):
                if call is None:
                    continue
                try:
                    out = call(cand)
                    if phase == "loaded":
                        result = out
                    mine = {"ok": True, "error": ""}
                except Exception as e:
                    mine = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    if isinstance(e, UnsafeCheckpointError):  # a trust decision, not damage: no fallback
                        raise
                everyone = self._coord.all_gather(phase, mine, self.options.coordination_timeout_secs)
                bad = {r: p["error"] for r, p in enumerate(everyone) if not p["ok"]}
                if bad:
                    break
            if not bad:
                self.last_load = LoadInfo(cstep, cand.tier, time.perf_counter() - t0, tuple(errors))
                log.info("rank %d: loaded step %d from %s in %.3f s", self.rank, cstep, cand.tier.value,
                         self.last_load.seconds)
                if step is None and dirname is None:
                    self._warn_rewind(cstep)
                if errors:
                    log.warning("rank %d: loaded step %d (%s), not the newest: %d newer checkpoint(s) refused: "
                                "%s; `snapckpt verify %s` checks them all", self.rank, cstep, cand.tier.value,
                                len(errors), " | ".join(errors), self.checkpoint_dir)
                return result, cand
            where = f"{tier}, {key}" if tier == "disk" else tier
            msg = f"step {cstep} ({where}) unreadable on ranks {sorted(bad)}: " + "; ".join(
                f"rank {r}: {e}" for r, e in sorted(bad.items()))
            log.warning("%s; trying the next newest checkpoint", msg)
            errors.append(msg)
        self._raise_nothing_loadable(step, errors)

    def _raise_nothing_loadable(self, step: Optional[int], errors: List[str]) -> None:
        """Raise why nothing (of ``step``) can be loaded: :class:`CheckpointCorruptError` when checkpoints
        exist but every one was refused (``errors``, one per candidate) or skipped as damaged
        (``self._damaged``), :class:`CheckpointNotFoundError` only when there is truly nothing. Never "not
        found" for damage: integrations and users rightly read that as "start afresh" or "let the
        framework's own loader read the directory"."""
        what = f"step {step}" if step is not None else "any step"
        if errors or self._damaged:
            raise all_damaged_error(self.checkpoint_dir, errors, what=what, skipped=self._damaged,
                                    note=" (memory tier included)")
        raise CheckpointNotFoundError(f"no complete checkpoint of {what} in memory or in {self.checkpoint_dir}")

    def _warn_rewind(self, loaded: int) -> None:
        """Warn when a lower step than ``loaded`` was saved to disk after it (a rewind): load() picks the
        highest step, retention keeps the most recently saved ones. Only disk saves carry a time (their
        manifest's ``requested_unix``): a step loaded from memory with no disk copy at or above it is the
        ordinary resume after a crash, never reported as a rewind."""
        since = [e[2] for e in self._disk_saved if e[0] >= loaded]
        if not since:
            return
        later = [d for d in self._disk_saved if d[0] < loaded and d[2] > max(since)]
        if later and self.rank == 0:
            newest = max(later, key=lambda d: d[2])
            log.warning("loaded step %d, the highest step; step %d (%s) was saved after it (a rewind?). To "
                        "resume from it pass load(step=%d), or delete the abandoned higher steps", loaded,
                        newest[0], newest[1], newest[0])

    def _load_files(self, step: Optional[int] = None) -> Tuple[int, StorageType, Dict[str, Any]]:
        """Collective: agree on a step and read this rank's files; ``(step, tier, {file: object})``."""
        files, cand = self.load_with(lambda c: c.files(), step)
        return cand.step, cand.tier, files

    def load(self, state_dict: Optional[Dict[str, Any]] = None, step: Optional[int] = None) -> Dict[str, Any]:
        """Restore the newest step complete on every rank (or ``step``); collective.

        Memory is used when every rank holds the step and it is at least as new as the newest committed
        disk checkpoint; otherwise disk, with checksums verified. A candidate that any rank cannot read
        is skipped by all ranks together, with a warning naming the step, the rank and the cause, and
        the next newest is tried. The step loaded, its tier and the refused newer candidates are in
        :attr:`last_load` (a :class:`LoadInfo`): ``ck.last_load.step``.

        Newest means the highest step number, as the frameworks' own resume does (the Trainer's
        ``get_last_checkpoint``, DeepSpeed's ``latest`` that never moves back), while retention keeps
        the ``keep_last`` most recently *saved*. After a rewind (saving lower steps than committed ones)
        the abandoned higher steps win until retention rotates them away: a warning names the more
        recently saved step; pass ``step=`` or delete the abandoned steps.

        Args:
            state_dict: if given, tensors are copied into it in place (cast to its dtypes) and other
                values replaced; it is returned. Otherwise the loaded object is returned (CPU tensors).
            step: load exactly this step.

        Raises:
            ValueError: ``step`` is not an ``int`` in ``[0, 2**63 - 1]``.
            CheckpointNotFoundError: nothing (or not ``step``) to load, and nothing damaged either: a fresh
                start is safe.
            CheckpointCorruptError: checkpoints exist but every one was refused: it failed its checks on
                some rank, or its directory was skipped as damaged (no readable manifest, or a file missing
                or of the wrong size). The message lists each one and why, one line each, then the fix
                (``snapckpt verify``). Never a fresh start: hours of training may be one repair away.
            IncompatibleCheckpointError: world size differs, or a tensor's shape differs from ``state_dict``.
            UnsafeCheckpointError: ``weights_only=True`` met pickled objects.
        """
        if step is not None:
            _check_step(step)
        if state_dict is None:
            _, _, files = self._load_files(step)
            return files[layout.rank_filename(self.rank)]
        # Into live tensors: a memory snapshot is read as views of the arena slot, a disk checkpoint as a
        # memory map of its files (torch.load(mmap=True), after the checksums), and copied straight into
        # them: one copy, no fresh memory to fault in. Values that are not copied into a live tensor are
        # deep-copied, so nothing the caller keeps points into the arena or a file.
        files, _ = self.load_with(lambda c: self._read_candidate(c, views=True), step)
        copy_into(state_dict, files[layout.rank_filename(self.rank)], own=True)
        return state_dict

    def verify_directory(self, path: "str | os.PathLike[str]", dirname: Optional[str] = None) -> str:
        """Collective: verify every file of the committed directory ``path`` against its manifest's sizes and
        checksums, each rank a share of the files (sorted by name, ``rank::world_size``), whatever the
        world size that saved it.

        Returns:
            ``""`` when every file verified, or when ``path`` has no ``.snapckpt/manifest.json`` at all (a
            directory the framework wrote itself); otherwise every failing rank's error, ``"; "``-joined
            (``"CheckpointCorruptError: ..."``), the same string on every rank.
        """
        path = os.fspath(path)
        name = dirname or os.path.basename(path.rstrip("/"))
        mpath = os.path.join(path, MANIFEST)
        error: Optional[str] = None
        if os.path.exists(mpath):
            try:
                m = parse_manifest(self._storage.read_bytes(mpath), name, source=mpath)
                share = dict(sorted(m["files"].items())[self.rank::self.world_size])
                check_checksums(self._storage, path, {**m, "files": share})
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        bad = self._coord.agree(f"verify {name}", error)
        return "; ".join(bad[r] for r in sorted(bad))

    def write_out(self, files: Mapping[str, Any], step: int, dirname: str, *, tracker_name: Optional[str] = None,
                  tracker_content: str = "") -> None:
        """Collective: commit files read back from a snapshot (``LoadCandidate.files()`` of a MEMORY
        candidate) as the native directory ``dirname`` of ``step``, and wait until it is committed. The way
        an integration turns a memory-only snapshot into the folder its framework's own loader reads.

        Raises:
            Any error of :meth:`save_files` or of the commit (:meth:`SaveHandle.wait`).
        """
        self.save_files(respec(files), step, StorageType.DISK, dirname=dirname, tracker_name=tracker_name,
                        tracker_content=tracker_content).wait()

    # --------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Wait for outstanding commits, then detach from the persister (which exits when the last rank
        has closed). Idempotent. Raises the first outstanding failure after detaching."""
        if self._closed:
            return
        err: Optional[BaseException] = None
        try:
            self.wait()
        except BaseException as e:
            err = e
        finally:
            if self._copier is not None:
                self._copier.shutdown(wait=True)
            self._client.close(bye=True)
            self._maps.close()
            if self._claim is not None:
                self._claim.release()
            self._closed = True
        if err is not None:
            raise err

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the original error
            try:
                self.close()
            except Exception:
                log.exception("error while closing the Checkpointer after another error")


def _timed_copy(prepared, slot_tensor, buf, device_done=None) -> float:
    """The copy thread's job: copy a prepared snapshot into its slot (and wait for its queued CUDA copies);
    returns the seconds it took."""
    t0 = time.perf_counter()
    Stager.copy_into(prepared, slot_tensor, buf, device_done)
    return time.perf_counter() - t0


def _fs_type(path: str) -> Optional[str]:
    """Filesystem type of the mount holding ``path`` (from ``/proc/mounts``), ``None`` if unknown."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for mnt, fstype in mounts:
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best[0])):
            best = (mnt, fstype)
    return best[1] if best else None


MAX_STEP = 2**63 - 1  # steps are signed 64-bit integers in the arena's slot header


def check_step(step: Any, what: str = "step") -> None:
    """``ValueError`` unless ``step`` is an ``int`` in ``[0, 2**63 - 1]`` (not a bool, float or string);
    ``what`` names it in the message (``"iteration"`` for Megatron)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"{what} must be an int in [0, 2**63 - 1], got {step!r} ({type(step).__name__})")


_check_step = check_step


def copy_into(dst: Any, src: Any, path: str = "", own: bool = False) -> Any:
    """Copy ``src`` into ``dst`` in place where both hold tensors at the same key; return ``dst``.

    Tensors are copied with ``Tensor.copy_`` (so dtype and device follow ``dst``, as
    ``load_state_dict`` does); other values replace ``dst``'s (deep copies of them with ``own``: ``src``
    then views memory that is not the caller's, an arena slot; one deep-copy memo for the whole call
    keeps tensors that share storage sharing it). Every shape is checked before anything is copied, so a
    refused load leaves ``dst`` as it was.

    Raises:
        IncompatibleCheckpointError: some tensor's shape differs (names every such key path, up to 10).
    """
    bad = []
    _shape_mismatches(dst, src, path, bad)
    if bad:
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise IncompatibleCheckpointError(
            f"{len(bad)} tensor(s) of the checkpoint do not fit the live state (nothing was copied):\n  "
            + "\n  ".join(bad[:10]) + more
            + "\nload into a model built with the checkpoint's configuration, or load without a state_dict "
              "(ckpt.load()) to inspect what was saved")
    return _copy_into(dst, src, own, {} if own else None)


def _shape_mismatches(dst: Any, src: Any, path: str, out: List[str]) -> None:
    """Append ``"<key path>: checkpoint shape (..) != live shape (..)"`` for every tensor ``copy_into``
    would copy with another shape."""
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            if k in dst:
                _shape_mismatches(dst[k], v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape != src.shape:
        out.append(f"{path or 'tensor'}: checkpoint shape {tuple(src.shape)} != live shape {tuple(dst.shape)}")


def _copy_into(dst: Any, src: Any, own: bool, memo: Optional[dict]) -> Any:
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            both = (k in dst and ((isinstance(dst[k], dict) and isinstance(v, dict))
                                  or (isinstance(dst[k], torch.Tensor) and isinstance(v, torch.Tensor))))
            dst[k] = _copy_into(dst[k], v, own, memo) if both else (copy.deepcopy(v, memo) if own else v)
        return dst
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        with torch.no_grad():
            dst.copy_(src)
        return dst
    return copy.deepcopy(src, memo) if own else src
