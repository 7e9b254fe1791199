"""Checkpointer: the one object a training loop talks to (save / fence / load / wait / close).

A thin facade over the engine's parts, one job each: :mod:`~snapckpt.engine.preflight` (directory checks
at construction), :mod:`~snapckpt.engine.session` (the conversation with the node persister),
:mod:`~snapckpt.engine.saver` (the save pipeline: snapshot into an arena slot, hand it to the persister,
which commits it in the background; contract 1), :mod:`~snapckpt.engine.loader` (the collective
load: all ranks agree on the newest step complete everywhere, memory or disk, and move on together when
any rank cannot read it; cases B3, C2, C9) and :mod:`~snapckpt.engine.restore` (the copy into live tensors).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from snapckpt._internal import env as _env
from snapckpt._internal import faultpoints as faults
from snapckpt.dist.coordination import Coordinator, make_coordinator
from snapckpt.dist.topology import Topology, host_identity
from snapckpt.engine.device_copy import CudaCopier
from snapckpt.engine.handle import SaveHandle
from snapckpt.engine.loader import LoadCandidate, LoadInfo, Loader
from snapckpt.engine.prefetch import Prefetch
from snapckpt.engine.preflight import (check_shared_dir, dir_identity, host_memory_shortfall, newest_part_files,
                                      newest_part_nbytes, preflight_dir, tensor_nbytes)
from snapckpt.engine.restore import check_step, copy_into
from snapckpt.engine.saver import Saver
from snapckpt.engine.replicas import setup_replicas
from snapckpt.engine.session import CLOSED, PersisterSession
from snapckpt.engine import plain_restore, slot_restore
from snapckpt.engine.slot_maps import SlotMaps
from snapckpt.engine.stager import Stager
from snapckpt.errors import (CheckpointDirError, CheckpointerClosedError, InsufficientSharedMemoryError,
                             RemoteStorageError, RemoteURLError)
from snapckpt.events import Event, SaveStats, StorageType
from snapckpt.formats import respec
from snapckpt.ondisk import layout
from snapckpt.options import CheckpointOptions
from snapckpt.persister.client import job_key
from snapckpt.storage.factory import check_location, open_storage, remote_only_url
from snapckpt.storage.posix import PosixStorage
from snapckpt.storage.remote import PROBE_TIMEOUT_SECS, RemoteStore

__all__ = ["Checkpointer", "LoadCandidate", "LoadInfo", "check_step"]

log = logging.getLogger(__name__)


class Checkpointer:
    """Asynchronous, crash-safe checkpoints of one training job.

    Args:
        checkpoint_dir: directory of committed checkpoints (created if missing; must be writable); or an
            object store URL (``"s3://bucket/run1"``, any fsspec URL): **remote-only mode**, one node, every
            part written from shared memory straight to the store and committed there, no local copy
            (docs/remote.md).
        **options: fields of :class:`~snapckpt.options.CheckpointOptions` (``keep_last``, ``shm_dir``,
            ``job_id``, timeouts...).

    The constructor is collective when ``torch.distributed`` is initialized: every rank must build its
    Checkpointers in the same order. Rank, world size and the ranks of this node come from
    ``torch.distributed`` (case C6).

    With no live persister for the job on this node (a restart after the node was lost) the constructor starts
    one and waits until it answers, so that a persister that cannot start raises here; meanwhile this rank's
    files of the checkpoint named by ``checkpoint_dir/latest`` are read into the page cache on a background
    thread (:mod:`snapckpt.engine.prefetch`), for the ``load`` that follows.

    Raises:
        RemoteURLError: the object store URL (``checkpoint_dir`` in remote-only mode, ``remote_dir`` or
            ``$SNAPCKPT_REMOTE_DIR``) cannot be used as given: fsspec cannot handle it (unknown scheme,
            implementation not installed, host unknown), no bucket or prefix, credentials in it, ``file://``;
            the same type whichever argument carried it, and both a ``CheckpointDirError`` and a
            ``RemoteStorageError``; before any request to the store.
        CheckpointDirError: ``checkpoint_dir`` is not a non-empty path (``None``, bytes...), is a URL that
            ``pathlib`` mangled (``s3:/bucket``), or cannot be created or written; or the job spans several
            nodes and some ranks see another directory at that path (node-local by mistake; raised on every
            rank, naming them: case G7); or a URL with ``remote_dir`` too, or on several nodes.
        RemoteStorageError: ``remote_dir`` (or the URL of remote-only mode) cannot be used (missing bucket,
            refused credentials, unreachable endpoint, another job's prefix); raised on every rank, before
            training.
        RankTimeoutError: some ranks did not construct theirs within ``coordination_timeout_secs``.
        PersisterError: the node persister could not be started or refused this rank.
    """

    def __init__(self, checkpoint_dir: "str | os.PathLike[str]", **options: Any) -> None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)) or not isinstance(os.fspath(checkpoint_dir), str) \
                or not os.fspath(checkpoint_dir):
            raise CheckpointDirError(
                f"checkpoint_dir must be a non-empty path (a str or os.PathLike naming the directory that holds "
                f"the checkpoints, e.g. Checkpointer(\"ckpt\")), not {checkpoint_dir!r} "
                f"({type(checkpoint_dir).__name__})")
        self.options = CheckpointOptions.from_kwargs(**options)
        self.options.resolved_host_memory_budget_nbytes  # a malformed SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES fails here
        _env.log_level()  # so does a malformed SNAPCKPT_LOG_LEVEL (not a persister crash at startup)
        self.options.resolved_replicas(1)  # and SNAPCKPT_REPLICAS (not at the first save, a persister started)
        for warning in _env.unknown_knobs():  # a misspelled SNAPCKPT_* variable would do nothing, silently
            log.warning("%s", warning)
        url = remote_only_url(checkpoint_dir)
        #: True when ``checkpoint_dir`` is an object-store URL: remote-only mode (no local directory)
        self.remote_only = url is not None
        if url is not None:
            self._check_remote_only(url)
            self.checkpoint_dir = url
        else:
            self.checkpoint_dir = os.path.abspath(check_location(checkpoint_dir))
        self.job = job_key(self.checkpoint_dir, self.options.job_id)
        self._coord = make_coordinator(self.job, self.options.coordination_timeout_secs)
        self._maps = SlotMaps(self._coord.rank, self.options.slots_per_rank, self.options.slot_wait_timeout_secs)
        # remote-only: a local storage still serves the tracker check and the CLI's readers, never a checkpoint
        self._storage = open_storage(None if url else self.checkpoint_dir, fsync=self.options.fsync)
        self._stager = Stager()
        self._listeners: List[Callable[[Event], None]] = []
        t = self.options.coordination_timeout_secs
        # A run id starts with the job key: a persister only ever cleans up its own job's leftovers.
        me = {"host": host_identity(), "run_id": self.job + uuid.uuid4().hex[:12], "pid": os.getpid()}
        everyone = self._coord.all_gather("init", me, t)
        self.topology = Topology.from_hosts(self._coord.rank, [p["host"] for p in everyone])
        faults.set_rank(self._coord.rank)
        self.run_id = everyone[0]["run_id"]
        if self.remote_only:
            if self.topology.num_nodes > 1:
                raise CheckpointDirError(
                    f"checkpoint_dir {self.checkpoint_dir!r} (remote-only mode) is supported on one node only; "
                    f"this job spans {self.topology.num_nodes} nodes: pass a shared directory as checkpoint_dir "
                    f"and the URL as remote_dir=\"{self.checkpoint_dir}\" (docs/remote.md)")
            preflight_dir(None, self.options.resolved_shm_dir, self.run_id, self.rank)
            remote, mine = self._open_remote_only(t)
        else:
            existed = os.path.isdir(self.checkpoint_dir)
            preflight_dir(self.checkpoint_dir, self.options.resolved_shm_dir, self.run_id, self.rank)
            try:
                check_shared_dir(self.checkpoint_dir, self.run_id, self._coord, self.topology,
                                 [p["host"] for p in everyone], t)  # case G7, only when the job spans nodes
                remote = self._open_remote(t)
            except BaseException:
                if not existed:  # a refused remote_dir leaves no empty directory behind
                    with contextlib.suppress(OSError):
                        os.rmdir(self.checkpoint_dir)
                raise
            # The directory's identity: memory snapshots taken for a directory that was deleted and re-created
            # since belong to another run and are never loaded (inode numbers are reused: a random id instead).
            mine = dir_identity(self.checkpoint_dir) if self._coord.rank == 0 else ""
        dir_id = self._coord.all_gather("dir_id", {"id": mine}, t)[0]["id"]
        self._session = PersisterSession(self.options, self.job, self.checkpoint_dir, self.run_id, self.topology,
                                         dir_id, self._maps)
        self._client = self._session.client  # the socket client (tests make a rank "die" through it)
        self._saver = Saver(self.options, self.checkpoint_dir, self.run_id, self.rank, self._coord,
                            self._storage, self._stager, self._maps, self._session, self._emit,
                            local=not self.remote_only)
        self._loader = Loader(self.options, self.checkpoint_dir, self.topology, self._coord, self._storage,
                              self._maps, self._session, dir_id, remote, remote_only=self.remote_only,
                              emit=self._emit)
        self._prefetch: Optional[Prefetch] = None
        if not self.remote_only:  # a persister to start: read the newest checkpoint into the page cache meanwhile
            self._client.on_spawn = self._start_prefetch
        try:
            self._session.connect()
        except BaseException:
            if self._prefetch is not None:
                self._prefetch.stop()
            raise
        finally:
            self._client.on_spawn = None
        self._reserving = False  # a reservation ahead of the first save may still run: loads hold it back
        self._reading_now = False  # a load runs: background prefaults and growth wait (see _reading)
        self._reserve_ahead()
        self._coord.all_gather("connected", {"ok": True}, t)
        # the peer-memory tier (several nodes, replicas >= 1): the persisters' addresses and the run's secret
        self._loader.peers = setup_replicas(self.options, self.topology, self._coord, self._session, t)

    def _start_prefetch(self) -> None:
        """This rank's files of the newest checkpoint into the page cache, in the background, while the persister
        this constructor started comes up (:mod:`snapckpt.engine.prefetch`): the load that follows a restart
        then reads them warm."""
        files = newest_part_files(self.checkpoint_dir, self.rank)
        if files and self._prefetch is None:
            self._prefetch = Prefetch(files)

    def _reserve_ahead(self, nbytes: Optional[int] = None) -> bool:
        """Reserve and map the arena for a snapshot of ``nbytes`` bytes, in the background, so that the first save
        costs what later saves cost (by default ``expected_nbytes``, else the size of this rank's files in the
        newest checkpoint); return whether slots are being grown."""
        if nbytes is None:
            nbytes = self.options.expected_nbytes
            if nbytes is None and not self.remote_only:
                nbytes = newest_part_nbytes(self.checkpoint_dir, self.rank)
        if not nbytes:
            return False
        # what a save of that size asks for (Saver._acquire), plus room for the slot's pickles and index
        want = int(nbytes * self.options.slot_headroom) + (1 << 20)
        try:  # the host-memory preflight: a budget too small, or an arena larger than the host, is said now
            limit = self._saver.slot_limit(want)
        except InsufficientSharedMemoryError as e:
            log.warning("rank %d: for the expected snapshot size: %s", self.rank, e)
            return False
        # part of an arena that does not fit would hold shared memory that slots of the real state need
        # (a guess too large then failed every save after the first): reserve all of it or none
        if host_memory_shortfall(self.options, self._session.topology, want, limit, self._session.arena_dir):
            log.warning("rank %d: nothing is reserved ahead for the expected snapshot size (%d bytes per slot): "
                        "the node's arena at that size does not fit; the first save sizes the slots to the "
                        "state it holds", self.rank, want)
            return False
        self._reserving = self._session.reserve(want, limit)
        return self._reserving

    def expect(self, state: Any = None, *, nbytes: Optional[int] = None) -> bool:
        """Reserve this rank's arena for snapshots of ``state`` (or of ``nbytes`` bytes), in the background, so
        that the first save costs what later saves cost: its slots' shared memory is allocated and mapped off
        the training thread instead of during the first save's copy (0.35 s per 0.5 GiB here, against 0.016 s
        for a later save: docs/performance.md). Not collective; call it on each rank.

        What :attr:`~snapckpt.options.CheckpointOptions.expected_nbytes` does at construction, for when the size
        is known only later: call it once the state has its full size (after the first optimizer step: PyTorch's
        optimizers create their state there) and before the first save. The integrations call it themselves
        (the Trainer callback after the first step).

        Args:
            state: what the saves will hold: tensors in dicts, lists and tuples, and objects with a
                ``state_dict()`` (a module, an optimizer), counted as the bytes of their tensors' data
                (``numel * element_size``, each tensor once, any device).
            nbytes: the snapshot's bytes, instead of ``state``.

        Returns:
            bool: Whether a reservation started: ``False`` once a save was made (the slots follow the saved
                state), for a state without tensor data (logged: an optimizer before its first step, a string)
                or whose ``state_dict()`` raised (logged), or when the arena at that size does not fit the host
                (logged; the first save then sizes its slot itself).

        Raises:
            ValueError: neither or both of ``state`` and ``nbytes``, or ``nbytes`` not an int >= 0.
            CheckpointerClosedError: the Checkpointer is closed.
        """
        if (state is None) == (nbytes is None):
            raise ValueError("expect() takes the state the saves will hold or nbytes=, one of the two")
        if nbytes is not None and (type(nbytes) is not int or nbytes < 0):
            raise ValueError(f"nbytes must be an int >= 0 (bytes), got {nbytes!r}")
        if self.closed:
            raise CheckpointerClosedError(CLOSED)
        if self._saver.acquired:
            return False
        if nbytes is None:
            try:
                nbytes = tensor_nbytes(state)
            except Exception as e:  # noqa: BLE001 - a size hint only: the first save sizes its slot itself
                log.warning("rank %d: expect() could not count the tensors of the %s it was given, so nothing is "
                            "reserved ahead of the first save: %s: %s", self.rank, type(state).__name__,
                            type(e).__name__, e)
                return False
            if not nbytes:
                log.warning("rank %d: expect() found no tensor data in the %s it was given, so nothing is reserved "
                            "ahead of the first save: pass what the saves will hold (a dict of the model and the "
                            "optimizer, or of their state dicts) after the first optimizer step, when the "
                            "optimizer has its state", self.rank, type(state).__name__)
                return False
        return self._reserve_ahead(nbytes)

    def _open_remote(self, timeout: float) -> Optional[RemoteStore]:
        """The remote tier (``remote_dir``) on rank 0, its access checked there before training; every
        rank raises the same :class:`RemoteStorageError` (or :class:`RemoteURLError`) when it cannot be used.
        ``None`` without one."""
        url = self.options.resolved_remote_dir
        if not url:
            return None
        store, error = None, {"error": "", "type": ""}
        if self._coord.rank == 0:
            try:
                store = RemoteStore(url)
                store.check_access(timeout=min(PROBE_TIMEOUT_SECS, timeout / 2))
                store.claim(self.checkpoint_dir, self.options.job_id)
            except RemoteStorageError as e:
                error = {"error": str(e), "type": type(e).__name__}
        _raise_remote_error(self._coord.all_gather("remote access", error, timeout)[0])
        return store

    def _check_remote_only(self, url: str) -> None:
        """Refuse what remote-only mode cannot do, on every rank, before anything starts.

        Raises:
            CheckpointDirError: ``remote_dir`` is set too (the object store is already the checkpoint
                location).
            RemoteURLError: fsspec cannot handle the URL (unknown scheme, implementation not installed, host
                unknown), no bucket or prefix, credentials in the URL.
        """
        if self.options.resolved_remote_dir:
            raise CheckpointDirError(
                f"checkpoint_dir {url!r} is an object store URL (remote-only mode) and remote_dir "
                f"{self.options.resolved_remote_dir!r} is set too: pass either a local directory with "
                "remote_dir (two tiers) or only the URL as checkpoint_dir (no local copy)")
        try:
            RemoteStore(url, role="checkpoint_dir")  # no request yet: the URL's shape and scheme
        except RemoteStorageError as e:
            raise RemoteURLError(f"{e} (remote-only mode: an object store URL as checkpoint_dir)") from e

    def _open_remote_only(self, timeout: float) -> Tuple[Optional[RemoteStore], str]:
        """Remote-only mode: on rank 0, check access to the store (a probe object) and claim the prefix for
        this job, before training; return ``(store on rank 0 / None elsewhere, the prefix's identity)``
        (the random ``dir_id`` of its owner record: memory snapshots taken for a prefix that was deleted
        and re-created since are not loaded).

        Raises:
            RemoteStorageError: the bucket does not exist, credentials are refused, the endpoint is
                unreachable, or another job owns the prefix (on every rank).
        """
        store, error, ident = None, {"error": "", "type": ""}, ""
        if self._coord.rank == 0:
            try:
                store = RemoteStore(self.checkpoint_dir, role="checkpoint_dir")
                store.check_access(timeout=min(PROBE_TIMEOUT_SECS, timeout / 2))
                owner = store.claim(self.checkpoint_dir, self.options.job_id)
                ident = f"remote:{owner.get('dir_id') or owner.get('created_unix', '')}"
            except RemoteStorageError as e:
                error = {"error": str(e), "type": type(e).__name__}
        _raise_remote_error(self._coord.all_gather("remote access", error, timeout)[0])
        return store, ident

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
        return self._session.persister_pid

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
        return self._session.closed

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn(event)`` for every :class:`~snapckpt.events.Event` of this rank."""
        self._listeners.append(fn)

    @property
    def last_load(self) -> Optional[LoadInfo]:
        """What the last load restored (a :class:`LoadInfo`), or ``None`` before the first load."""
        return self._loader.last_load

    @last_load.setter
    def last_load(self, info: Optional[LoadInfo]) -> None:  # integrations with their own loaders set it
        self._loader.last_load = info

    @property
    def last_stats(self) -> Optional[SaveStats]:
        """Statistics of the newest snapshot taken (a :class:`~snapckpt.events.SaveStats`), or ``None``."""
        return self._saver.last_stats

    @last_stats.setter
    def last_stats(self, stats: Optional[SaveStats]) -> None:
        self._saver.last_stats = stats

    # ------------------------------------------------------------------------------------ plumbing
    def _emit(self, event: Event) -> None:
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:  # a user callback never breaks checkpointing
                log.exception("snapckpt event listener failed on %s", event.kind)

    def _request(self, op: str, **fields: Any) -> Dict[str, Any]:
        """One request to the persister (tests and tools read its ``held`` slots through it)."""
        return self._session.request(op, **fields)

    @property
    def _cuda(self) -> Optional[CudaCopier]:
        """The side-stream copier of CUDA tensors, once made (the GPU test checks it was used)."""
        return self._saver.cuda

    def poll(self) -> None:
        """Ask the persister about outstanding DISK saves without waiting: their ``committed`` / ``failed``
        events fire now, on the caller's thread, and the first failure nobody has seen yet is raised
        (each failure once; a second one is raised at a later call). One request per outstanding save;
        none when there is none. ``save`` calls it first; ``HookRegistry.step_end`` on other steps."""
        self._saver.poll()

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
        check_step(step)
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
            dirname: the checkpoint's directory name under ``checkpoint_dir`` (a tag: one path component). A
                DISK save to a directory whose earlier DISK save (of any step) is still in flight waits for it;
                that save's failure is raised here if it was not raised before (as :meth:`poll` would), never
                again once it was (by its handle's ``wait``, say).
            tracker_name: tracker file replaced with ``tracker_content`` after the commit (``None``: none).
                ``dirname`` may not be ``tracker_name``.
            check_weights_only: warn once per new plan when :meth:`load` (``weights_only=True``) would
                refuse the state (:meth:`save` sets it; integrations have their own loaders).

        Raises:
            ValueError: ``dirname`` or a file name is not a valid name (``/``, hidden, control characters).
            CheckpointDirError: DISK, and ``dirname`` is ``tracker_name`` or names an existing file that is not
                a directory (no commit could rename onto it); nothing was saved. And :meth:`save`'s errors.
        """
        self._reserving = False  # the save's own acquire waits for what the reservation grew
        return self._saver.save_files(files, step, storage_type, dirname=dirname, tracker_name=tracker_name,
                                      tracker_content=tracker_content, check_weights_only=check_weights_only)

    def fence(self) -> None:
        """Wait until the in-flight snapshot copy is done (call before ``optimizer.step()``).

        With ``overlap=False`` (the default) ``save`` copies before it returns and this returns at once.
        With ``overlap=True`` the copy runs on a copy thread while training goes on (forward, backward);
        this waits for it, then hands the slot to the persister. Every other call (``save``, ``wait``,
        ``load``, ``close``) fences first.

        Raises:
            The copy's own error (the snapshot is then dropped; the slot is freed).
        """
        self._saver.fence()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every DISK save of this rank is committed; raise the first failure not already
        raised to the caller (by ``SaveHandle.wait`` or an earlier call): each failure is raised once."""
        self._saver.wait(timeout)

    # ---------------------------------------------------------------------------------------- load
    def latest_step(self) -> Optional[int]:
        """Newest step complete on every rank, in memory, on disk or in the remote tier (``remote_dir``; a
        remote step newer than every local one is downloaded into ``checkpoint_dir`` first, checksums
        verified); ``None`` if there is no checkpoint at all (a fresh start is safe). Collective.

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
        return self._loader.latest_step()

    def load_with(self, fn: Callable[["LoadCandidate"], Any], step: Optional[int] = None, *,
                   dirname: Optional[str] = None, check: Optional[Callable[["LoadCandidate"], Any]] = None,
                   any_world_size: bool = False) -> Tuple[Any, "LoadCandidate"]:
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
            any_world_size: committed directories saved by another world size are candidates too, for an
                integration whose framework loader reads them by path at any world size (Accelerate's
                ``load_state``, DeepSpeed ZeRO stage 0): ``candidate.verify()`` then checks a share of every
                file on each rank, and a warning names the world size that saved it. Memory snapshots (and
                the remote tier's steps) of another world size are never candidates.

        Raises:
            CheckpointNotFoundError, CheckpointCorruptError, IncompatibleCheckpointError,
            UnsafeCheckpointError: as :meth:`load`.
        """
        if step is not None:
            check_step(step)
        self.wait()
        with self._reading():
            return self._loader.load_with(fn, step, dirname=dirname, check=check, any_world_size=any_world_size)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """While a load reads and copies (the block), hold back this rank's background prefaults of its other
        slots (the one a memory read maps starts them: :meth:`SlotMaps.get`) and the persister's growth of the
        reservation made at construction (:meth:`_reserve_ahead`): on a restart they would share the CPUs and
        the memory bandwidth with the load's own copy (issue 18); they go on after it. Nested blocks hold once."""
        if self._reading_now:
            yield
            return
        self._reading_now, held = True, self._reserving
        if held:
            self._session.hold_reserve(True)  # pauses the prefaults too
        else:
            self._maps.pause(True)
        try:
            yield
        finally:
            self._reading_now = False
            if held:
                self._session.hold_reserve(False)
            else:
                self._maps.pause(False)

    def load(self, state_dict: Optional[Dict[str, Any]] = None, step: Optional[int] = None) -> Dict[str, Any]:
        """Restore the newest step complete on every rank (or ``step``); collective.

        Memory is used when every rank holds the step and it is at least as new as the newest committed
        disk checkpoint; otherwise disk, with checksums verified. With ``remote_dir``, a remote step newer
        than both is downloaded into ``checkpoint_dir`` by rank 0 first (checksums verified) and loaded
        from there (``last_load.tier`` is ``DISK``). A candidate that any rank cannot read
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
            RuntimeError: ``state_dict`` holds tensors made under ``torch.inference_mode()`` and this call is
                outside it: torch's refusal of ``copy_`` into them (from a memory snapshot raised before anything
                is written, as none of its reads by address may pass torch's check).
        """
        if step is not None:
            check_step(step)
        if state_dict is None:
            files, _ = self.load_with(lambda c: c.files(), step)
            return files[layout.rank_filename(self.rank)]
        # Into live tensors: a memory snapshot is read as views of the arena slot and copied straight into them
        # (one copy, no fresh memory to fault in); a disk checkpoint is read once, its large tensors straight into
        # the live ones, the checksum computed on the way (snapckpt.engine.disk_restore), the rest copied from
        # the file's memory map. Values that are not copied into a live tensor are deep-copied, so nothing the
        # caller keeps points into the arena or a file.
        # A memory slot that still holds what this process saved from a state of this one's layout is copied
        # from the save's typed views, without reading its skeleton (snapckpt.engine.slot_restore); one that
        # another process saved from a state of this one's layout (a restart), by its plain digest
        # (snapckpt.engine.plain_restore).
        name = layout.rank_filename(self.rank)

        def read(c: LoadCandidate) -> Tuple[Any, Any]:
            if c.tier == StorageType.DISK:
                return self._loader.read_into(c, state_dict)
            slot = self._loader.memory_slot(c)
            found = slot_restore.find(self._stager, slot, name, c.step, state_dict)
            if found is None:
                found = plain_restore.find(slot, name, c.step, state_dict)
            if found is not None:
                return found, None
            return self._loader.read(c, views=True, slot=slot)[name], frozenset()

        with self._reading():  # through the copy into the live tensors, the larger part of a memory load
            (obj, filled), _ = self.load_with(read, step)
            t0 = time.perf_counter()
            if filled is None:
                obj.run()
            else:
                copy_into(state_dict, obj, own=True, skip=filled)
        if self.last_load is not None:
            self.last_load = dataclasses.replace(self.last_load, copy_secs=time.perf_counter() - t0)
        return state_dict

    def verify_directory(self, path: "str | os.PathLike[str]", dirname: Optional[str] = None, *,
                         present_only: bool = False) -> str:
        """Collective: verify every file of the committed directory ``path`` against its manifest's sizes and
        checksums, each rank a share of the files (sorted by name, ``rank::world_size``), whatever the
        world size that saved it.

        Args:
            present_only: a listed file that is gone is no error, only the files still there are checked (a
                directory its user changed in place, e.g. re-sharded weights or a deleted optimizer file: a
                changed set of files is not damage, a changed byte of a listed file is; see
                :func:`snapckpt.ondisk.manifest.file_set_changes`). Each rank must pass the same value.

        Returns:
            str: ``""`` when every file verified, or when ``path`` has no ``.snapckpt/manifest.json`` at all (a
                directory the framework wrote itself); otherwise every failing rank's error, ``"; "``-joined
                (``"CheckpointCorruptError: ..."``), the same string on every rank.
        """
        path = os.fspath(path)
        return self._loader.verify_directory(path, dirname or os.path.basename(path.rstrip("/")), present_only)

    def write_out(self, files: Mapping[str, Any], step: int, dirname: str, *, tracker_name: Optional[str] = None,
                  tracker_content: str = "", modes: Optional[Mapping[str, int]] = None) -> None:
        """Collective: commit files read back from a snapshot (``LoadCandidate.files()`` of a MEMORY
        candidate) as the native directory ``dirname`` of ``step``, and wait until it is committed. The way
        an integration turns a memory-only snapshot into the folder its framework's own loader reads.
        ``modes``: the files' permission bits as saved (``LoadCandidate.modes()``; default: none recorded).

        Raises:
            Any error of :meth:`save_files` or of the commit (:meth:`SaveHandle.wait`).
        """
        self.save_files(respec(files, modes), step, StorageType.DISK, dirname=dirname, tracker_name=tracker_name,
                        tracker_content=tracker_content).wait()

    # --------------------------------------------------------------------------------------- close
    def close(self, *, clean: Optional[bool] = None) -> None:
        """End this rank's use of the Checkpointer; idempotent.

        A clean end (the job is done) waits for outstanding commits, then detaches from the persister,
        which exits when the last rank has closed; the first outstanding failure is raised after detaching.

        A close during a failure is not a clean end (contract 11): when ``close`` runs while an exception
        propagates (a ``with`` block left by an error, a ``finally`` or ``except`` clause) it does not wait
        for commits (they go on in the persister) and leaves like a crashed rank: the persister keeps the
        memory snapshots and, once every rank has left, flushes the newest one to disk, so the restart
        resumes from it. A rank that fails first and peers that die of the collective error therefore lose
        nothing held in memory. It warns only when this Checkpointer has a snapshot not known to be on disk
        (a save in flight, a memory snapshot newer than its last commit): a ``load`` that fails before any save
        leaves quietly.

        Args:
            clean: ``True``/``False`` say which it is; ``None`` (the default) decides from
                ``sys.exc_info()``: clean unless an exception other than ``SystemExit(0)`` propagates.
        """
        if self.closed:
            return
        if clean is None:
            clean = not _failing(sys.exc_info()[1])
        if not clean and self._saver.at_risk():
            log.warning("rank %d: Checkpointer closed during a failure: not a clean end; the persister keeps "
                        "the memory snapshots and flushes the newest to disk once every rank has left",
                        self.rank)
        elif not clean:  # nothing saved, or all of it committed: no warning to alarm a failed load() with
            log.info("rank %d: Checkpointer closed during a failure; none of its snapshots awaits the disk",
                     self.rank)
        err: Optional[BaseException] = None
        try:
            if clean:
                self.wait()
            else:
                self._saver.fence()  # an overlapped copy in flight: finished and handed over, never torn
        except BaseException as e:
            err = e
        finally:
            self._saver.stop_copy_thread()
            if self._prefetch is not None:
                self._prefetch.stop()
            # a KeyboardInterrupt or SystemExit while waiting for the commits ends the job as a failure
            self._session.detach(clean and (err is None or isinstance(err, Exception)))
            self._maps.close()
            self._saver.release_claim()
            self._session.closed = True
        if err is not None and clean:
            raise err
        if err is not None:
            log.warning("rank %d: while closing during a failure: %s", self.rank, err)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close(clean=True)
        else:  # do not mask the original error
            try:
                self.close(clean=not _failing(exc))
            except Exception:
                log.exception("error while closing the Checkpointer after another error")


def _raise_remote_error(rec: Dict[str, str]) -> None:
    """Raise rank 0's remote-tier error ``rec`` (``{"error": message, "type": class name}``) on this rank, with
    its type (a :class:`RemoteURLError` stays one); return when ``rec`` holds none."""
    if rec["error"]:
        raise (RemoteURLError if rec["type"] == "RemoteURLError" else RemoteStorageError)(rec["error"])


def _failing(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (the exception propagating, if any) makes a close a failure: any exception except
    ``SystemExit`` with code 0 or ``None`` (a deliberate, successful exit)."""
    if exc is None:
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))
