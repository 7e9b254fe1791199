"""Checkpointer options: one frozen dataclass, units in the names, validated in ``__post_init__``."""
from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Literal, Optional

from snapckpt._internal import env as _env
from snapckpt.storage.urls import check_remote_url

__all__ = ["CheckpointOptions"]


def _int_at_least(value: object, low: int, optional: bool = False) -> bool:
    """Whether ``value`` is an int (not a bool) >= ``low``, or ``None`` when ``optional``."""
    if value is None:
        return optional
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


@dataclass(frozen=True)
class CheckpointOptions:
    """Everything a :class:`snapckpt.Checkpointer` can be told.

    Attributes:
        keep_last: retention; the ``keep_last`` most recently *saved* checkpoints (save order, not commit
            order nor step number) are kept, older ones are deleted after each commit (``None`` keeps
            everything). The newest committed checkpoint, every in-flight one and the one the tracker file
            names (DeepSpeed's ``latest`` after later ``save_latest=False`` saves: what a resume loads) are
            never deleted.
        shm_dir: directory of a tmpfs that holds the shared-memory arena (default ``/dev/shm`` or
            ``$SNAPCKPT_SHM_DIR``).
        runtime_dir: parent directory for the persister's socket, lock and token (default
            ``$SNAPCKPT_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR`` or ``/tmp``).
        job_id: optional extra job identity; a job is ``(realpath(checkpoint_dir), job_id)``, with its own
            persister and arena. Two jobs should still not share a checkpoint directory: a commit
            refuses to replace a step directory that another job committed.
        slots_per_rank: arena slots per local rank (default 2: one being written while the other holds the
            newest snapshot or is being written to disk). ``1`` halves the host memory of the memory tier: the
            only slot is reused, so while a snapshot is copied into it no complete snapshot is in memory (a
            crash then restarts from the newest disk checkpoint, never from a torn slot), and a save waits
            until the slot's previous snapshot is written to disk (and sent to peers): the stall grows by
            what remains of that write. Measured trade-off: docs/performance.md.
        host_memory_budget_nbytes: bytes of host (shared) memory this node's arena may hold: every local
            rank's slots plus the peer replica slots held for other nodes (counted as one slot of the
            rank's size per replica). At each save the slot count of a rank is the largest that fits its
            equal share, at most ``slots_per_rank``; when not even one slot fits, ``save`` raises
            :class:`~snapckpt.errors.InsufficientSharedMemoryError` naming the bytes needed. ``None``
            (default): ``$SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES``, else no budget (``slots_per_rank`` slots).
        slot_headroom: a slot is allocated ``slot_headroom`` times the bytes the state needs, so that
            small growth of the state does not reallocate it. Default 1.05: at 1 GiB, 51 MiB covers the
            parts of a state that grow from save to save (counters, log history, pickled objects); a larger
            change (optimizer moments that appear after the first step) regrows the slot in any case, and
            every byte of headroom is host memory (shared memory is RAM) held for the whole job.
        on_slot_busy: what ``save`` does when every slot of the rank is held by the persister:
            ``"wait"`` (a ``slot_wait`` event and a warning, then up to ``slot_wait_timeout_secs``, then
            :class:`~snapckpt.errors.SlotBusyError`) or ``"skip"`` (no snapshot for that step; a
            ``skipped`` event and a warning say so). A DISK save is collective, and so is its skip: when one
            rank skips, every rank's save of that step and directory ends skipped at once (its handle's
            ``skipped``, a ``skipped`` event whose reason names the rank), on every node, with nothing committed
            and the previous checkpoint untouched; the skip counts as a save, so the next save of every rank
            (the same step or tag again included) pairs with the others'. A MEMORY save is skipped on that
            rank only (a restart resumes from the newest step every rank holds).
        slot_wait_timeout_secs: bound for ``on_slot_busy="wait"``, seconds.
        request_timeout_secs: bound on one request to the persister, seconds; past it
            :class:`~snapckpt.errors.PersisterTimeoutError`.
        commit_timeout_secs: bound on the wait for every rank's part of a DISK save (and for
            ``SaveHandle.wait()`` without a timeout), seconds; past it the commit fails with
            :class:`~snapckpt.errors.CommitTimeoutError` naming the missing ranks.
        peer_timeout_secs: how long a node persister's liveness lease may go unrenewed before a commit
            waiting for that node's ranks is abandoned with :class:`~snapckpt.errors.PeerLostError`
            (the node is taken for lost), seconds. ``None`` (default): ``$SNAPCKPT_PEER_TIMEOUT_SECS``, else
            10. A rank whose process died is detected at once, without this bound
            (:mod:`snapckpt.persister.peers`). Raise it where a shared filesystem may stall writes longer.
        coordination_timeout_secs: bound on the rank agreement of ``load``/``latest_step``/construction.
        persister_startup_timeout_secs: bound on starting or finding the node persister.
        persister_idle_timeout_secs: the persister exits after this long with no client (it keeps the
            memory tier alive that long after training dies).
        flush_on_crash: when training processes disconnect without ``close()``, the persister writes the
            newest snapshot held in memory on every local rank to disk (if newer than the last commit).
        verify_checksums: re-checksum files against the manifest when loading from disk.
        weights_only: the trust decision for loading: ``True`` refuses arbitrary pickled objects
            (``torch.load(weights_only=True)``); ``False`` trusts the checkpoint directory fully.
        fsync: fsync files and directories before commit (turn off only for throwaway tests).
        overlap: copy the snapshot into shared memory on a copy thread while training goes on: ``save``
            returns before the copy is done, and the state must not change until :meth:`fence` (which
            the hooks and every integration call before the optimizer step). ``False``: ``save`` copies
            before it returns, and the state may change at once.
        remote_dir: the remote tier, an object store URL (``"s3://bucket/run1"``, any fsspec URL; default
            ``$SNAPCKPT_REMOTE_DIR``, unset: no remote tier). Every committed DISK checkpoint is uploaded by
            the persister in the background, in the same layout, committed there by its manifest object;
            ``load`` takes the newest complete step across memory, disk and remote, downloading it into
            ``checkpoint_dir`` first when remote is newest. Access is checked at construction
            (:class:`~snapckpt.errors.RemoteStorageError`); a URL of the wrong shape (no bucket or prefix,
            ``file://``, credentials in it) is refused here (:class:`~snapckpt.errors.RemoteURLError`, a
            ``ValueError`` too). See docs/remote.md.
        replicas: the peer-memory tier: how many other nodes (the next ones in ring order of node index)
            hold a copy of each node's memory snapshots, sent by the node persisters in the background over
            a channel authenticated with a secret of the run. ``None`` (default): ``$SNAPCKPT_REPLICAS``,
            else 1 when the job spans several nodes; ``0`` turns it off; a one-node job has none. Costs one
            replica slot per peer rank in each holder's shared memory (see docs/multinode.md).
        expected_nbytes: bytes of this rank's snapshot (its state's tensor bytes plus a little), known before
            the first save. The constructor then has the persister reserve the rank's arena slots at that size
            and maps them, on background threads, so that the first save costs what later saves cost instead
            of paying for zeroing and mapping fresh shared memory (about 1-2 s per GiB on a loaded node).
            ``None`` (default): the size of this rank's files in the newest checkpoint named by
            ``checkpoint_dir/latest`` (a restart), else nothing is reserved before the first save. ``0``:
            never reserve ahead. A wrong guess costs nothing but the reservation: a larger state regrows
            the slot at the save, as without it; an arena of the guessed size that does not fit the shared memory is
            not reserved at all (a warning says so). A load pauses the reservation while it reads (it goes
            on afterwards), so that a restart's read does not share the CPUs with it.
        cuda_copy_piece_nbytes: ``overlap=True`` with CUDA state: the snapshot's device-to-host copy is issued
            in pieces of this many bytes, one piece at a time, from a background thread. A GPU's copy engine
            serves a stream that always has a copy queued before any other stream's copies, so a host sync of
            the training loop between ``save`` and ``fence`` (``loss.item()``, a NaN check) would otherwise wait
            for the whole snapshot; between two pieces it waits for one piece at most. ``0``: every tensor's
            copy is queued at once (the copy's full bandwidth; a loop with no host sync before ``fence`` loses
            nothing). Measured on an H200 (docs/performance.md): see there for the bandwidth it costs.
    """

    keep_last: Optional[int] = None
    shm_dir: Optional[str] = None
    runtime_dir: Optional[str] = None
    job_id: Optional[str] = None
    slots_per_rank: int = 2
    host_memory_budget_nbytes: Optional[int] = None
    slot_headroom: float = 1.05
    on_slot_busy: Literal["wait", "skip"] = "wait"
    slot_wait_timeout_secs: float = 600.0
    request_timeout_secs: float = 60.0
    commit_timeout_secs: float = 600.0
    peer_timeout_secs: Optional[float] = None
    coordination_timeout_secs: float = 300.0
    persister_startup_timeout_secs: float = 60.0
    persister_idle_timeout_secs: float = 300.0
    flush_on_crash: bool = True
    verify_checksums: bool = True
    weights_only: bool = True
    fsync: bool = True
    overlap: bool = False
    remote_dir: Optional[str] = None
    replicas: Optional[int] = None
    expected_nbytes: Optional[int] = None
    cuda_copy_piece_nbytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not _int_at_least(self.keep_last, 1, optional=True):
            raise ValueError(f"keep_last must be a positive int or None, got {self.keep_last!r}")
        if not _int_at_least(self.slots_per_rank, 1):
            raise ValueError(f"slots_per_rank must be an int >= 1, got {self.slots_per_rank!r}")
        budget = self.host_memory_budget_nbytes
        if not _int_at_least(budget, 1, optional=True):
            raise ValueError(f"host_memory_budget_nbytes must be a positive int (bytes of host memory for this "
                             f"node's arena, e.g. 64 << 30 for 64 GiB) or None, got {budget!r}")
        headroom = self.slot_headroom
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 1.0 <= headroom < math.inf:
            raise ValueError(f"slot_headroom must be a finite number >= 1.0, got {headroom!r}")
        if not _int_at_least(self.expected_nbytes, 0, optional=True):
            raise ValueError(f"expected_nbytes must be an int >= 0 (bytes) or None, got {self.expected_nbytes!r}")
        piece = self.cuda_copy_piece_nbytes
        if not _int_at_least(piece, 0):
            raise ValueError(f"cuda_copy_piece_nbytes must be an int >= 0 (bytes; 0 queues every copy at once), "
                             f"got {piece!r}")
        if self.on_slot_busy not in ("wait", "skip"):
            raise ValueError(f"on_slot_busy must be 'wait' or 'skip', got {self.on_slot_busy!r}")
        for f in dataclasses.fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
            if f.name.endswith("_secs"):
                value = getattr(self, f.name)
                if value is None and f.name == "peer_timeout_secs":
                    continue  # resolved from the environment
                # NaN fails both comparisons; past TIMEOUT_MAX (inf included) a socket or lock wait overflows
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not 0 < value <= threading.TIMEOUT_MAX:
                    raise ValueError(f"{f.name} must be a positive number of seconds, at most "
                                     f"{threading.TIMEOUT_MAX:.0f} (threading.TIMEOUT_MAX), got {value!r}")
        if self.remote_dir is not None:  # its shape now, on every rank (RemoteURLError, also a ValueError)
            check_remote_url(self.remote_dir, "remote_dir")
        if not _int_at_least(self.replicas, 0, optional=True):
            raise ValueError(f"replicas must be a non-negative int (0: off) or None, got {self.replicas!r}")
        if self.job_id is not None and (not self.job_id or "/" in self.job_id or "\x00" in self.job_id):
            raise ValueError(f"job_id must be a non-empty string without '/', got {self.job_id!r}")

    @property
    def resolved_shm_dir(self) -> str:
        """The shared-memory directory in force (option, then environment, then ``/dev/shm``)."""
        return self.shm_dir or _env.shm_dir()

    @property
    def resolved_runtime_dir(self) -> str:
        """The runtime directory in force (option, then environment, then ``/tmp``)."""
        return self.runtime_dir or _env.runtime_dir()

    @property
    def resolved_remote_dir(self) -> Optional[str]:
        """The remote tier's URL in force (option, then ``$SNAPCKPT_REMOTE_DIR``), or ``None``."""
        return self.remote_dir or _env.remote_dir() or None

    @property
    def resolved_peer_timeout_secs(self) -> float:
        """The peer timeout in force, seconds (option, then ``SNAPCKPT_PEER_TIMEOUT_SECS``, then 10).

        Raises:
            ValueError: the environment variable is not a positive number.
        """
        return float(self.peer_timeout_secs) if self.peer_timeout_secs is not None else _env.peer_timeout_secs()

    @property
    def resolved_host_memory_budget_nbytes(self) -> Optional[int]:
        """The host-memory budget of the arena in force, bytes (option, then
        ``SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES``), or ``None`` for none.

        Raises:
            ValueError: the environment variable is not a positive integer.
        """
        if self.host_memory_budget_nbytes is not None:
            return self.host_memory_budget_nbytes
        return _env.host_memory_budget_nbytes()

    def resolved_replicas(self, num_nodes: int) -> int:
        """The number of peer replicas in force for a job of ``num_nodes`` nodes (option, then
        ``SNAPCKPT_REPLICAS``, then 1), at most ``num_nodes - 1`` (0 on one node).

        Raises:
            ValueError: the environment variable is not a non-negative integer.
        """
        n = self.replicas if self.replicas is not None else _env.replicas()
        return max(0, min(1 if n is None else n, num_nodes - 1))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "CheckpointOptions":
        """Build options from keyword arguments; an unknown name is a ``TypeError`` listing valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown snapckpt option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**kwargs)
