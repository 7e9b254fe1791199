"""The persister's records of runs, ranks and slots, and the slot state machine.

Data path: a training rank asks the persister (:mod:`snapckpt.persister.server`) for a slot of the
arena, copies its snapshot into it and says it is ready; the scheduler
(:mod:`snapckpt.persister.scheduler`) writes READY slots to disk. Every transition of a slot's state
(:class:`~snapckpt.persister.arena.SlotState`) happens here::

    FREE/INVALID/READY (not the newest held) --acquire--> WRITING(N) --ready--> READY(N)
    WRITING(N) --abort, or its rank left--> INVALID
    READY(N) --start_persist--> PERSISTING(N) --release / finish_persist--> READY(N)

A streamed DISK save (:mod:`snapckpt.persister.stream`) is written while its slot is still WRITING; the slot
carries the stream (``Slot.stream``) until its writer stops reading it, and is not handed out before.

A rank's newest READY slot is never handed out again (it is the memory tier's restore point); the
other READY ones are reused oldest first once no slot is FREE (contract 2: a slot is rewritten only
after the persister is done with it). A rank limited to one slot (``slots_per_rank=1``, or a host-memory
budget that allows one, :mod:`snapckpt.persister.budget`) is the exception: its only slot is handed out
again once it is READY (not while PERSISTING or pinned by a peer send), so while the next snapshot is
copied into it the rank holds no complete memory snapshot: the slot is WRITING, and INVALID if the copy
dies. Slots beyond a rank's limit are emptied (their pages released) once nothing reads them.

Several local ranks share the node's shared memory. A rank's slots beyond its first grow only once every
local rank of its run has asked for a slot (an ``acquire``, or a ``reserve`` ahead of its first save), so that
the node knows each rank's size before it grants a second slot: until then the rank saves with its first slot
alone, as a rank limited to one slot does (a save waits while it is being written to disk, never refused for
it). Every growth is then checked against the whole node: the free shared memory must hold what this rank's
slots and every other local rank's slots still need at the sizes they asked for (:meth:`SlotTable.acquire`), so
one rank's second slot never takes the room another rank needs for its first, ranks of different sizes
(pipeline stages) fit as they are, and when the node's slots do not fit every rank is refused alike, with the
setting that fits for the node (the one the node check names: :func:`snapckpt.engine.preflight.host_memory_shortfall`).
A local rank that has not asked within :attr:`SlotTable.FIRST_SLOTS_WAIT_SECS` of the run's first save that used one
slot for want of it (it never saves, or its process never started) no longer holds the others back; it is counted
once it asks. The wait runs from that save, not from the first ask: a rank that reserved ahead of its first save
(``expected_nbytes``, a restart's size) may ask minutes before another rank asks at that save.

Locking: every method runs with the server's lock held, except :meth:`SlotTable.release` (called by
a writer thread), which takes it.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

from snapckpt.errors import PersisterError
from snapckpt.ondisk.manifest import validate_dirname
from snapckpt.persister import protocol as P
from snapckpt.persister.arena import SlotFiles, SlotState
from snapckpt.persister.budget import OtherRanks
from snapckpt.storage.urls import is_remote_url

log = logging.getLogger("snapckpt.persister")

__all__ = ["Slot", "RankEntry", "Run", "SlotTable", "ReserveHolds"]

HELD = (SlotState.READY, SlotState.PERSISTING)  # states of a slot that holds a complete snapshot


@dataclass
class Slot:
    """One slot file of a rank's arena and what it holds (``nbytes``: the file's size in bytes)."""

    index: int
    path: str
    nbytes: int = 0
    state: SlotState = SlotState.FREE
    step: int = -1
    run_id: str = ""
    index_offset: int = 0
    index_nbytes: int = 0
    dirname: str = ""
    tracker_name: str = ""
    tracker_content: str = ""
    persistable: bool = True  # the snapshot has files for disk (False: a memory-only record, never flushed)
    seq: int = 0  # order of READY transitions: the newest READY slot has the highest seq
    growing: Optional["cf.Future[int]"] = None  # a background ensure_size of this FREE slot (its new size)
    growing_to: int = 0  # the size a reservation's growth makes (bytes; its file grows piece by piece); 0: none
    mapping: Any = None  # the writers' read mapping of the slot file, kept across persists (see scheduler)
    pins: int = 0  # peer sends reading the slot (persister/replication.py): never handed out meanwhile
    origin: Optional[Dict[str, Any]] = None  # a fetched snapshot of an earlier run: its world_size and dir_id
    # a streamed part's writer reads the slot (persister/stream.py): never handed out, emptied or freed meanwhile,
    # whatever its state (an aborted copy leaves it INVALID while the writer has not yet stopped)
    stream: Any = None


@dataclass
class RankEntry:
    """A local rank: its slots and the connection it is served on (``None`` while it is away)."""

    rank: int
    slots: List[Slot]
    conn: Optional[socket.socket] = None
    run_id: str = ""
    limit: int = 0  # the slot limit of its last acquire (0, before its first: all slots; see SlotTable.usable)
    # the slot size (bytes) and slot limit of its last acquire or reserve in its run (0: it has not asked yet):
    # what the node counts for it when another local rank's slot grows (SlotTable.acquire)
    want: int = 0
    want_slots: int = 0
    deferred: List[int] = field(default_factory=list)  # its slots its last acquire left ungrown (SlotTable.acquire)


@dataclass
class Run:
    """One launch attempt of the job, as its ranks described it in their ``hello``."""

    run_id: str
    world_size: int
    local_ranks: List[int]
    committer: bool
    checkpoint_dir: str
    keep_last: Optional[int]
    commit_timeout_secs: float
    flush_on_crash: bool
    fsync: bool
    dir_id: str = ""  # device:inode of checkpoint_dir when the run started (a re-created directory differs)
    remote_dir: str = ""  # the remote tier's URL ("": none); the committer uploads every commit there
    connected: Set[int] = field(default_factory=set)
    crashed: bool = False
    peer_timeout_secs: float = 10.0  # a node lease unrenewed this long is a lost node (persister/peers.py)
    # local ranks whose process died (disconnected without bye): rank -> gone record (persister/peers.py)
    gone: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    # time.monotonic() of the first acquire of a local rank that left a slot ungrown because another local rank had
    # not asked (SlotTable.acquire)
    deferred_since: Optional[float] = None
    waited_out: bool = False  # some local rank had not asked within SlotTable.FIRST_SLOTS_WAIT_SECS of that

    @property
    def remote_only(self) -> bool:
        """Whether ``checkpoint_dir`` is an object-store URL: parts and commits go straight to the store
        (:mod:`snapckpt.persister.remote_only`)."""
        return is_remote_url(self.checkpoint_dir)

    @property
    def multi_node(self) -> bool:
        """Whether ranks of this run live on other nodes (their persisters need files to learn things)."""
        return len(self.local_ranks) < self.world_size


def _still_to_reserve(s: Slot, nbytes: int) -> int:
    """Bytes slot ``s`` has yet to reserve to hold ``nbytes``: to its background growth's size while that runs (its
    file's size says how far it got), else up to ``nbytes``."""
    if s.growing is None:
        return max(0, nbytes - s.nbytes)
    try:
        done = max(s.nbytes, os.path.getsize(s.path))
    except OSError:
        done = s.nbytes
    return max(0, max(nbytes, s.growing_to) - done)


class ReserveHolds:
    """The ranks reading a checkpoint right now (``reserve_hold`` requests): while any holds, the reservations
    made ahead of a first save (:meth:`SlotTable.reserve`) wait between pieces, so that a restart's load does
    not share the node's CPUs and memory bandwidth with zeroing shared memory (issue 18: a 1 GiB disk restore
    read 1.5-2x slower beside it). Node-wide, since any rank's read competes with any reservation. A rank's
    hold ends with its connection; a wait ends after :attr:`MAX_WAIT_SECS` whatever holds it, and for good
    once :meth:`hurry` is called after it began (a save needs its slot now: a load's ``fn`` may save)."""

    MAX_WAIT_SECS = 300.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holders: Set[int] = set()
        self._issued = 0  # growths that may pause (tokens handed out by pauser)
        self._hurried = 0  # growths up to this token no longer pause

    def set(self, rank: int, hold: bool) -> None:
        """Start (``hold``) or end the hold of global ``rank``."""
        with self._cond:
            if hold:
                self._holders.add(rank)
            else:
                self._holders.discard(rank)
                self._cond.notify_all()

    def clear(self) -> None:
        """End every hold (at exit)."""
        with self._cond:
            self._holders.clear()
            self._cond.notify_all()

    def pauser(self) -> Callable[[], None]:
        """The ``pause`` of one growth (:meth:`~snapckpt.persister.arena.SlotFiles.ensure_size`): it returns once
        no rank holds, or at once after :meth:`hurry` (or after :attr:`MAX_WAIT_SECS`)."""
        with self._cond:
            self._issued += 1
            token = self._issued

        def pause() -> None:
            with self._cond:
                self._cond.wait_for(lambda: not self._holders or token <= self._hurried, timeout=self.MAX_WAIT_SECS)
        return pause

    def hurry(self) -> None:
        """Let every growth that may pause so far run to its end without pausing (an ``acquire`` waits for
        one; the grow thread takes them in order, so all of them)."""
        with self._cond:
            self._hurried = self._issued
            self._cond.notify_all()


class SlotTable:
    """The runs, ranks and slots this persister knows, and the transitions of their slots.

    Args:
        arena: the slot files (sized here).
        lock: the server's lock (see the module docstring).
    """

    #: How long (seconds) after a local rank's first save with its first slot alone (another local rank had not asked
    #: for a slot) its ranks' second slots wait for the other local ranks to ask for their first (see the module
    #: docstring); then they grow without those ranks.
    FIRST_SLOTS_WAIT_SECS = 60.0

    def __init__(self, arena: SlotFiles, lock: threading.RLock) -> None:
        self.arena = arena
        self.lock = lock
        self.ranks: Dict[int, RankEntry] = {}
        self.runs: Dict[str, Run] = {}
        self.seq = 0
        # Reserves the pages of a rank's other slots while it trains, so that the first snapshot into
        # each of them does not pay for zeroing fresh shared memory (about 0.3 s per GiB) on the training
        # path.
        self.grow_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-grow")
        self.holds = ReserveHolds()

    def shutdown(self) -> None:
        """Wait for the background growths (at exit)."""
        self.holds.clear()
        self.grow_pool.shutdown(wait=True)

    # ----------------------------------------------------------------------------------- records
    def attach(self, rank: int, run: Run, conn: socket.socket, slots_per_rank: int) -> RankEntry:
        """Serve ``rank`` of ``run`` on ``conn``; its slot records are made (or added) up to
        ``slots_per_rank``, those it had before (a restarted rank) are kept with their snapshots. A rank of a new
        run (a restart) has not asked for a slot in it yet (:attr:`RankEntry.want`); one that reconnects in the
        same run keeps what it asked for."""
        entry = self.ranks.get(rank)
        if entry is None:
            entry = RankEntry(rank, [Slot(i, self.arena.path(rank, i)) for i in range(slots_per_rank)])
            self.ranks[rank] = entry
        while len(entry.slots) < slots_per_rank:
            entry.slots.append(Slot(len(entry.slots), self.arena.path(rank, len(entry.slots))))
        if entry.run_id != run.run_id:
            entry.want, entry.want_slots = 0, 0
        entry.conn = conn
        entry.run_id = run.run_id
        return entry

    def info(self, s: Slot) -> Dict[str, Any]:
        """Slot ``s`` as the protocol describes it to a client."""
        run = self.runs.get(s.run_id)
        origin = s.origin or ({"world_size": run.world_size, "dir_id": run.dir_id} if run is not None
                              else {"world_size": -1, "dir_id": ""})
        return {"slot": s.index, "path": s.path, "nbytes": s.nbytes, "state": s.state.value, "step": s.step,
                "index_offset": s.index_offset, "index_nbytes": s.index_nbytes, "run_id": s.run_id,
                "seq": s.seq, "world_size": origin["world_size"], "dir_id": origin["dir_id"]}

    def slot(self, entry: RankEntry, index: int) -> Slot:
        """Slot ``index`` of ``entry``.

        Raises:
            ProtocolError: the rank has no such slot.
        """
        if not (0 <= index < len(entry.slots)):
            raise P.ProtocolError(f"no slot {index} for rank {entry.rank}")
        return entry.slots[index]

    def held(self, entry: RankEntry) -> List[Slot]:
        """The slots of ``entry`` that hold a complete snapshot (READY or PERSISTING)."""
        return [s for s in entry.slots if s.state in HELD]

    def newest_held(self, entry: RankEntry, step: int) -> Optional[Slot]:
        """The newest slot of ``entry`` holding a complete snapshot of ``step``, or ``None``."""
        cands = [s for s in entry.slots if s.step == step and s.state in HELD]
        return max(cands, key=lambda x: x.seq) if cands else None

    def describe(self, entry: RankEntry) -> str:
        """Every slot's state and step, for a busy reply (``"slot 0: READY(5), ..."``), and why slots of the rank
        are not used (:attr:`RankEntry.deferred`)."""
        text = ", ".join(f"slot {s.index}: {s.state.value}({s.step})" for s in entry.slots)
        if entry.deferred:
            text += (f"; slot(s) {entry.deferred} grow once every local rank of this node has asked for its first "
                     f"slot (not yet: rank(s) {self.unasked(entry)})")
        return text

    def drop_moved_ranks(self, run: Run) -> List[int]:
        """Free the slots this node still holds for ranks of an earlier run of the job that are not local to
        ``run`` (the rank moved to another node at a restart, or the world shrank): otherwise every node's
        shared memory ends up holding slots of every rank. Called at an ``acquire`` of ``run``: a rank saves
        only after its load, and every load ends with a round of all ranks, so no fetch from those slots is
        still to come. A slot still written, persisted, sent or grown is left for a later call. Returns the
        ranks whose slots were freed."""
        dropped = []
        for rank, entry in list(self.ranks.items()):
            if rank in run.local_ranks or entry.conn is not None or entry.run_id == run.run_id:
                continue
            if any(s.state in (SlotState.WRITING, SlotState.PERSISTING) or s.pins or s.growing is not None
                   or s.stream is not None for s in entry.slots):
                continue
            for s in entry.slots:
                if s.mapping is not None:
                    try:
                        s.mapping.close()
                    except BufferError:  # a view is still alive: the pages go with its last reference
                        pass
                    s.mapping = None
                self.arena.remove(rank, s.index)
            del self.ranks[rank]
            dropped.append(rank)
        if dropped:
            log.info("run %s: freed the memory slots of ranks %s, held from an earlier run: they are no longer "
                     "on this node", run.run_id, dropped)
        return dropped

    # ------------------------------------------------------------------------------- transitions
    def usable(self, entry: RankEntry, limit: int = 0) -> List[Slot]:
        """The slots of ``entry`` a snapshot may use under ``limit``: the one holding the newest complete snapshot
        first, then the lowest indices. The others are emptied by :meth:`acquire`.

        ``limit`` 0 means all of them. This snapckpt's ranks always send a count (``slots_per_rank``, or fewer under
        the host-memory budget: :func:`snapckpt.engine.preflight.slot_limit`), but ranks of the same
        :data:`~snapckpt.persister.protocol.PROTOCOL_VERSION` (2) from before that send 0 for ``slots_per_rank``,
        and :attr:`RankEntry.limit` is 0 until a rank's first acquire (its ``held`` reply counts every slot). So 0
        stays (as "no slot usable" it would skip every save of such a rank) until the protocol version changes."""
        if limit <= 0 or limit >= len(entry.slots):
            return list(entry.slots)
        held = self.held(entry)
        newest = max(held, key=lambda s: s.seq) if held else None
        return sorted(entry.slots, key=lambda s: (s is not newest, s.index))[:limit]

    def _trim(self, entry: RankEntry, keep: List[Slot]) -> None:
        """Empty the slots of ``entry`` outside ``keep`` that nothing reads (FREE, INVALID, or READY and
        unpinned): their file is truncated to 0 bytes, which returns its pages to the host."""
        for s in entry.slots:
            if s in keep or s.pins or s.stream is not None:
                continue
            self._grown(s)
            if s.nbytes == 0 or s.state not in (SlotState.FREE, SlotState.INVALID, SlotState.READY):
                continue
            log.info("rank %d: slot %d (%s(%d), %d bytes) emptied: over the rank's slot limit", entry.rank,
                     s.index, s.state.value, s.step, s.nbytes)
            self.arena.release(entry.rank, s.index)
            if s.mapping is not None:
                try:
                    s.mapping.close()
                except BufferError:  # a view is still alive; it goes with its last reference
                    pass
                s.mapping = None
            s.nbytes, s.state, s.step = 0, SlotState.FREE, -1

    def acquire(self, entry: RankEntry, step: int, nbytes: int, limit: int = 0) -> Optional[Slot]:
        """Hand out a slot of at least ``nbytes`` bytes for ``step`` (WRITING), or ``None`` when every
        slot is in use (the client's policy then waits or skips).

        ``limit``: how many slots the rank may use (its ``slots_per_rank``, or the budget's count,
        :mod:`~snapckpt.persister.budget`; 0: all, see :meth:`usable`).
        With one, that slot is handed out even when it holds the rank's newest snapshot (which is then
        overwritten), but never while PERSISTING or pinned.

        While another local rank of the run has not asked for a slot (:meth:`unasked`), only the first of the
        usable slots may grow: the others are used only if they hold ``nbytes`` already (:attr:`RankEntry.deferred`
        lists the rest), and with one slot in use it is handed out as under a limit of one. The capacity check
        counts what the other local ranks' slots still need at the sizes they asked for (:meth:`_others`).

        Raises:
            InsufficientSharedMemoryError, PreflightError: the arena cannot grow the slot (the message says
                which ``slots_per_rank`` fits).
        """
        entry.limit = limit
        self._asked(entry, nbytes, limit)
        usable = self.usable(entry, limit)
        self._trim(entry, usable)
        waiting = self.unasked(entry)
        active = usable if not waiting else [s for i, s in enumerate(usable) if i == 0 or s.nbytes >= nbytes]
        deferred = [s.index for s in usable if s not in active]
        if deferred and not entry.deferred:
            log.info("rank %d: saves with %d of its %d slot(s) until local rank(s) %s of this node ask for their "
                     "first slot: their sizes are not known yet", entry.rank, len(active), len(usable), waiting)
        entry.deferred = deferred
        run = self.runs.get(entry.run_id)
        if deferred and run is not None and run.deferred_since is None:
            run.deferred_since = time.monotonic()  # the bounded wait starts (unasked)
        ready = [s for s in active if s.state == SlotState.READY]
        # the restore point: the newest complete snapshot, READY or PERSISTING (an older READY slot is not
        # kept for it while the newest is being written to disk)
        held = [s for s in active if s.state in HELD]
        newest = max(held, key=lambda s: s.seq) if held and len(active) > 1 else None
        free = [s for s in active if s.state in (SlotState.FREE, SlotState.INVALID) and s.stream is None]
        reusable = sorted((s for s in ready if s is not newest and not s.pins and s.stream is None),
                          key=lambda s: s.seq)
        candidates = free + reusable
        if not candidates:
            return None
        slot = candidates[0]
        # the slots' background growths (the reservation ahead, an earlier save's grow_others) are taken before
        # the capacity check: a finished one's pages are counted in the tmpfs's free bytes already, so counting
        # that slot as still to be reserved in full refused states that fit (they grow alongside). One still
        # running for another slot, a reservation to at least this size, is not waited for: the first save after
        # construction does not wait for the reservation of the rank's other slot (issue 18); what that growth has
        # yet to reserve is counted from its file's size, which grows piece by piece (SlotFiles.ensure_size, pause).
        for s in active:
            if s is slot or s.growing is None or s.growing.done() or s.growing_to < nbytes:
                self._grown(s)
        reserve = sum(_still_to_reserve(s, nbytes) for s in active if s is not slot)
        held_nbytes = sum(min(s.nbytes, nbytes) for s in usable)
        grows = slot.nbytes < nbytes
        others = self._others(entry, full=not waiting) if grows or reserve else None

        def grow_others() -> None:
            # reserve the other slots' pages now, off the training path, alongside this slot's growth (the
            # check just passed counted them): the rank's prefault of the next slot waits for its file to grow
            for other in active:
                self._grow_free(entry, other, nbytes, skip=slot)
            if not waiting:  # the check counted every local rank's slots too: those left ungrown grow now
                for e in self._asked_others(entry):
                    for other in self.usable(e, e.want_slots):
                        self._grow_free(e, other, e.want)

        slot.nbytes = self.arena.ensure_size(entry.rank, slot.index, nbytes, slot.nbytes, reserve,
                                             slots=len(usable), held_nbytes=held_nbytes, others=others,
                                             checked=grow_others)
        slot.state, slot.step, slot.run_id, slot.origin = SlotState.WRITING, step, entry.run_id, None
        # when this slot needed no growth (no capacity check ran): only where the node's memory holds them beside
        # the other local ranks' slots; else the acquire that hands one of them out raises, with the advice
        if not grows and reserve and reserve + others.nbytes <= self._room():
            grow_others()
        return slot

    def _grow_free(self, entry: RankEntry, s: Slot, nbytes: int, skip: Optional[Slot] = None,
                   ahead: bool = False) -> bool:
        """Grow slot ``s`` of ``entry`` to ``nbytes`` in the background if it is FREE (or INVALID), smaller and not
        growing already (and not ``skip``); return whether it grows. By default with one ``posix_fallocate``: its
        file's size says nothing of its progress until it ends, so a save that acquires the slot meanwhile waits
        for it (``growing_to`` 0), as it always did. ``ahead`` (a reservation ahead of the first save): piece by
        piece, writing zeros, pausing while a rank reads a checkpoint (:meth:`reserve`)."""
        if (s is skip or s.growing is not None or s.nbytes >= nbytes
                or s.state not in (SlotState.FREE, SlotState.INVALID)):
            return False
        if ahead:
            s.growing = self.grow_pool.submit(self.arena.ensure_size, entry.rank, s.index, nbytes, s.nbytes,
                                              pause=self.holds.pauser(), zero=True)
            s.growing_to = nbytes
        else:
            s.growing = self.grow_pool.submit(self.arena.ensure_size, entry.rank, s.index, nbytes, s.nbytes)
            s.growing_to = 0
        return True

    def reserve(self, entry: RankEntry, nbytes: int, limit: int = 0) -> List[Slot]:
        """Grow every FREE (or INVALID) slot of ``entry`` below ``nbytes`` bytes to ``nbytes``, in the background
        (the growth pool), ahead of the rank's first snapshot; return the slots being grown. A growth that
        fails (too little shared memory) is only logged: the snapshot's own ``acquire`` raises the error.
        Slots that hold a snapshot are left alone; with ``limit`` (see :meth:`acquire`), only usable ones grow. A
        slot still growing for an earlier reservation is left at that size. The rank has asked for ``nbytes``
        (:meth:`acquire` counts it for the node); only its first usable slot grows while another local rank has not
        asked, or when the node's free memory does not hold every local rank's slots at their sizes (the acquire
        then says so)."""
        self._asked(entry, nbytes, limit)
        usable = self.usable(entry, limit)
        fits = not self.unasked(entry) and self._node_fits(entry, usable, nbytes)
        out = []
        for s in (usable if fits else usable[:1]):
            if s.growing is not None and s.growing.done():
                self._grown(s)  # an earlier reservation (expected_nbytes, the restart's size) ended: a larger one grows
            if self._grow_free(entry, s, nbytes, ahead=True):
                out.append(s)
        if fits:  # every local rank's slots were counted: those of the ranks that asked before grow too
            for e in self._asked_others(entry):
                for s in self.usable(e, e.want_slots):
                    self._grow_free(e, s, e.want, ahead=True)
        return out

    def _asked(self, entry: RankEntry, nbytes: int, limit: int) -> None:
        """``entry`` asks for slots of ``nbytes`` bytes under ``limit`` (:attr:`RankEntry.want`)."""
        entry.want, entry.want_slots = nbytes, limit

    def unasked(self, entry: RankEntry) -> List[int]:
        """The local ranks of ``entry``'s run that have not asked for a slot in it yet (no ``acquire`` nor
        ``reserve``; a rank whose process has not said ``hello`` neither); ``[]`` once
        :attr:`FIRST_SLOTS_WAIT_SECS` have passed since the run's first save that left a slot ungrown for want of them
        (:attr:`Run.deferred_since`; logged once)."""
        run = self.runs.get(entry.run_id)
        if run is None or len(run.local_ranks) <= 1 or run.waited_out:
            return []
        missing = [r for r in run.local_ranks if not self._asked_in(r, run)]
        if (missing and run.deferred_since is not None
                and time.monotonic() - run.deferred_since > self.FIRST_SLOTS_WAIT_SECS):
            # info, not a warning (which keeps persister.log after a clean exit): a rank may never save, and what
            # this can cost (a later first save refused) raises its own error with the advice
            log.info("run %s: local rank(s) %s asked for no arena slot within %g s of the first save that waited "
                     "for them: the other ranks' slots beyond their first now grow without counting them; if the "
                     "node's shared memory cannot hold every rank's slots, such a rank's first save may be refused "
                     "(InsufficientSharedMemoryError names the setting that fits)", run.run_id, missing,
                     self.FIRST_SLOTS_WAIT_SECS)
            run.waited_out = True
            return []
        return missing

    def _asked_in(self, rank: int, run: Run) -> bool:
        e = self.ranks.get(rank)
        return e is not None and e.run_id == run.run_id and e.want > 0

    def _others(self, entry: RankEntry, full: bool) -> OtherRanks:
        """What the other local ranks of ``entry``'s run that asked for slots still need (:class:`OtherRanks`): their
        usable slots (with ``full`` False, their first only: their others wait too) up to the size each asked for.
        A finished background growth of theirs is taken first, and a single ``posix_fallocate`` one waited for
        (its file's size says nothing of its progress)."""
        out = OtherRanks()
        for e in self._asked_others(entry):
            usable = self.usable(e, e.want_slots)
            for s in (usable if full else usable[:1]):
                if s.growing is not None and (s.growing.done() or not s.growing_to):
                    self._grown(s)
                out.nbytes += _still_to_reserve(s, e.want)
                out.held += min(s.nbytes, e.want)
            out.ranks.append((e.rank, e.want, len(usable)))
        return out

    def _asked_others(self, entry: RankEntry) -> List[RankEntry]:
        """The other local ranks of ``entry``'s run that have asked for a slot in it."""
        run = self.runs.get(entry.run_id)
        if run is None:
            return []
        return [self.ranks[r] for r in run.local_ranks if r != entry.rank and self._asked_in(r, run)]

    def _node_fits(self, entry: RankEntry, usable: List[Slot], nbytes: int) -> bool:
        """Whether the arena's free memory holds what ``usable`` slots of ``entry`` and every other local rank's
        slots still need (:meth:`_others`), at the sizes asked for."""
        need = sum(_still_to_reserve(s, nbytes) for s in usable) + self._others(entry, full=True).nbytes
        return need <= self._room()

    def _room(self) -> int:
        """Bytes the arena may still reserve: the smaller of its filesystem's free bytes and MemAvailable."""
        free, avail = self.arena.room()
        return min(free, avail) if avail is not None else free

    def _grown(self, slot: Slot) -> None:
        """Wait for a background growth of ``slot`` and take its size (called with the lock; the growth
        never takes it). A growth that failed is dropped: the caller's own ``ensure_size`` retries it and
        raises with the rank's full capacity need."""
        if slot.growing is None:
            return
        if not slot.growing.done():
            self.holds.hurry()  # a reservation paused by a load (whose fn may save) must not hold this save
        try:
            slot.nbytes = max(slot.nbytes, slot.growing.result())
        except Exception as e:
            log.info("slot %d: reserving its pages in the background failed: %s", slot.index, e)
        slot.growing, slot.growing_to = None, 0

    def ready(self, entry: RankEntry, index: int, step: int, *, index_offset: int, index_nbytes: int,
              dirname: str, tracker_name: str, tracker_content: str, persistable: bool) -> Slot:
        """WRITING(step) -> READY(step): the rank finished copying its snapshot into slot ``index``
        (``index_offset``/``index_nbytes``: where the slot's index lies, in bytes from its start).

        Raises:
            PersisterError: the slot is not WRITING(step).
            ValueError: ``dirname`` or ``tracker_name`` is not a plain name inside the checkpoint directory.
        """
        s = self.slot(entry, index)
        if s.state != SlotState.WRITING or s.step != step:
            raise PersisterError(f"slot {s.index} of rank {entry.rank} is {s.state.value}({s.step}), "
                                 f"not WRITING({step})")
        validate_dirname(dirname)
        if tracker_name:
            validate_dirname(tracker_name)
        self.seq += 1
        s.state, s.seq = SlotState.READY, self.seq
        s.index_offset, s.index_nbytes = index_offset, index_nbytes
        s.dirname, s.tracker_name, s.tracker_content = dirname, tracker_name, tracker_content
        s.persistable = persistable
        return s

    def abort(self, entry: RankEntry, index: int) -> None:
        """WRITING -> INVALID: the rank gave up copying into slot ``index`` (a streamed part's writer fails)."""
        s = self.slot(entry, index)
        if s.state == SlotState.WRITING:
            s.state = SlotState.INVALID
            if s.stream is not None:
                s.stream.cancel(f"rank {entry.rank} gave up its snapshot copy of step {s.step} before it was "
                                "complete (its own error says why)")

    def drop_writes(self, entry: RankEntry) -> None:
        """The rank left: a slot it was writing is not trusted (WRITING -> INVALID, case C8)."""
        for s in entry.slots:
            if s.state == SlotState.WRITING:
                log.warning("rank %d left while writing step %d into slot %d: slot marked INVALID",
                            entry.rank, s.step, s.index)
                s.state = SlotState.INVALID
                if s.stream is not None:
                    s.stream.cancel(f"rank {entry.rank} left (its process died) while copying its snapshot of "
                                    f"step {s.step}: that part never completed")

    @staticmethod
    def start_persist(s: Slot) -> None:
        """READY -> PERSISTING: a writer is about to read slot ``s``."""
        s.state = SlotState.PERSISTING

    def release(self, s: Slot) -> None:
        """The persister is done reading slot ``s``: PERSISTING -> READY (takes the lock)."""
        with self.lock:
            if s.state == SlotState.PERSISTING:
                s.state = SlotState.READY

    @staticmethod
    def finish_persist(s: Slot, seq: int) -> None:
        """The writer of the snapshot ``seq`` of slot ``s`` ended: PERSISTING -> READY, unless the slot
        was released and refilled since (it then holds another snapshot)."""
        if s.state == SlotState.PERSISTING and s.seq == seq:
            s.state = SlotState.READY
