"""Loader: the collective load of one rank, from "which step?" to the files of that step.

Sequence of a load: every rank reports which steps it holds in memory, the first rank of each node what
its node persister can serve (its own slots and the replicas of other nodes' ranks, when the run has peer
replicas), rank 0 lists the committed steps on disk (:meth:`Loader.candidates`), and every rank builds the
same list, newest first (memory first when it is at least as new as disk). A memory step is complete when
every rank's part is held by some node; a rank whose own node does not hold its part fetches it first from
the node that does (:mod:`snapckpt.persister.replication`, checksum verified) into its own arena.
:meth:`Loader.load_with` then tries each :class:`LoadCandidate` on every rank; if any rank cannot read it
(a torn memory slot, a corrupt file), all ranks move to the next candidate together (cases B3, C2, C9).
Reading is :meth:`Loader.read` (a copy or views of the arena slot; disk files after :meth:`Loader.verify`).
The restore into live tensors is :mod:`snapckpt.engine.restore`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from snapckpt._internal.progress import byte_bar
from snapckpt.dist.coordination import Coordinator
from snapckpt.dist.topology import Topology
from snapckpt.engine.agreement import MemoryTier, lost_steps, memory_tier, ranked
from snapckpt.engine.replicas import PeerMap
from snapckpt.engine.session import PersisterSession
from snapckpt.engine.slot_maps import MappedSlot, SlotMaps
from snapckpt.persister.slot_index import read_index, read_slot
from snapckpt.errors import (CheckpointCorruptError, CheckpointNotFoundError, IncompatibleCheckpointError,
                             RemoteStorageError, UnsafeCheckpointError, all_damaged_error)
from snapckpt.events import Event, StorageType
from snapckpt.ondisk import layout
from snapckpt.ondisk.manifest import (MANIFEST, check_checksums, check_sizes, list_committed, parse_manifest,
                                     present_files)
from snapckpt.options import CheckpointOptions
from snapckpt.storage.posix import PosixStorage
from snapckpt.storage.remote import NoAnswer, RemoteStore, call_bounded, remove_download_leftovers

__all__ = ["LoadCandidate", "LoadInfo", "Loader"]

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
        fetched_from: MEMORY loads of a snapshot this node did not hold (its node was replaced, or the rank
            moved): where this rank's part was fetched from (``"node 0 (replica)"``); ``None`` otherwise.
        agree_secs: of ``seconds``, the agreement on the candidates (listing, one round with every rank).
        read_secs: of ``seconds``, reading the candidates tried (checksums included; a disk load into live
            tensors reads most bytes straight into them here).
        copy_secs: ``load(state_dict)`` only: the copy of what was not read in place into the live state, after
            ``seconds`` (not part of it).
    """

    step: int
    tier: StorageType
    seconds: float
    skipped: Tuple[str, ...] = ()
    fetched_from: Optional[str] = None
    agree_secs: float = 0.0
    read_secs: float = 0.0
    copy_secs: float = 0.0


class LoadCandidate:
    """One checkpoint the ranks agreed to try loading (see :meth:`Checkpointer.load_with`).

    Attributes:
        step: its step (int).
        tier: ``StorageType.MEMORY`` or ``StorageType.DISK``.
        dirname: its directory name (the tag) for DISK, ``None`` for MEMORY.
        path: absolute path of the committed directory for DISK, ``None`` for MEMORY.
        run_id: the run that took the snapshot for MEMORY (the slot's owner), ``None`` for DISK.
    """

    def __init__(self, owner: "Loader", step: int, tier: StorageType, key: Optional[str]) -> None:
        self._owner, self.step, self.tier = owner, step, tier
        self.dirname = key if tier == StorageType.DISK else None
        self.path = os.path.join(owner.checkpoint_dir, key) if tier == StorageType.DISK else None
        self.run_id = key if tier == StorageType.MEMORY else None

    _files: Optional[Dict[str, Any]] = None
    _modes: Optional[Dict[str, int]] = None  # set by Loader.read

    def files(self) -> Dict[str, Any]:
        """This rank's files: ``{name: object}`` (torch files unpickled with CPU tensors, raw files as
        ``bytes``). MEMORY: every file of the rank's snapshot, ``MemoryOnly`` ones included. DISK: the files
        the manifest assigns to this rank, sizes and checksums verified first. Read once, then kept.

        Raises:
            CheckpointCorruptError / CheckpointNotFoundError: damaged or vanished; UnsafeCheckpointError.
        """
        if self._files is None:
            self._files = self._owner.read(self)
        return self._files

    def modes(self) -> Dict[str, int]:
        """``{name: permission bits}`` of this rank's files saved with a spec's ``mode`` (see
        :mod:`snapckpt.formats.specs`; the others have the default mode): what :meth:`Checkpointer.write_out`
        needs to write them as they were. Reads the files first (:meth:`files`) if not read yet."""
        self.files()
        return dict(self._modes or {})

    def verify(self) -> None:
        """DISK: check this rank's files against the manifest (sizes, and checksums unless
        ``verify_checksums=False``); raises :class:`~snapckpt.errors.CheckpointCorruptError`. MEMORY: no-op."""
        if self.tier == StorageType.DISK:
            self._owner.verify(self.path, self.dirname)

    def check_unchanged(self) -> None:
        """DISK: check that the directory still holds the commit the ranks agreed on, after a framework's own
        loader read it by path outside :meth:`Checkpointer.load_with` (which checks this itself once ``fn``
        returned): a re-commit in between (a save after a rewind by the job saving there) gave it another
        copy, never verified. MEMORY: no-op.

        Raises:
            CheckpointCorruptError: another commit is there now. FileNotFoundError: the directory is gone.
        """
        self._owner._still_listed(self)

    def __repr__(self) -> str:
        return f"LoadCandidate(step={self.step}, tier={self.tier.value}, dirname={self.dirname!r})"


class Loader:
    """The load path of one rank.

    Args:
        options: the Checkpointer's options (``weights_only``, ``verify_checksums``, timeouts).
        checkpoint_dir: absolute path of the checkpoint directory.
        topology: rank, world size, local rank.
        coord: the job's coordination channel (candidates and each try are agreed on).
        storage: the storage of ``checkpoint_dir``.
        maps: the rank's slot mappings (memory reads).
        session: the persister session (which slots this rank holds).
        dir_id: the checkpoint directory's identity: memory snapshots of another identity are ignored.
        remote: the remote tier on rank 0 (:class:`~snapckpt.storage.remote.RemoteStore`), or ``None``.
        remote_only: ``checkpoint_dir`` is an object store URL (remote-only mode): the committed steps are
            the store's (listed by rank 0), each rank reads its files from the store by ranged GETs,
            checksums verified, with no local directory.
        emit: called with the ``steps_lost`` event (rank 0, see :meth:`candidates`); ``None``: no events.

    Attributes:
        last_load: a :class:`LoadInfo` of the last load, or ``None``.
    """

    def __init__(self, options: CheckpointOptions, checkpoint_dir: str, topology: Topology, coord: Coordinator,
                 storage: PosixStorage, maps: SlotMaps, session: PersisterSession, dir_id: str,
                 remote: "Optional[RemoteStore]" = None, *, remote_only: bool = False,
                 emit: Optional[Callable[[Event], None]] = None) -> None:
        self.options, self.checkpoint_dir, self._topology = options, checkpoint_dir, topology
        self._coord, self._storage, self._maps, self._session, self._dir_id = coord, storage, maps, session, dir_id
        self._damaged: List[str] = []  # directories skipped as damaged by the last candidates()
        self._warned_lost: Optional[Tuple[Any, Any]] = None  # the last _warn_lost_memory warning
        self._warned_no_common = False  # the "no step held by every rank" warning, said once
        self._warned_damaged: Set[str] = set()  # damaged directories warned of: latest_step() + load() say it once
        self._disk_saved: List[Tuple[int, str, float]] = []  # (step, dirname, saved at), see _warn_rewind
        self._remote_saved: List[Tuple[int, str, float]] = []  # the same, of the remote tier's other steps
        self._listed: Dict[str, List[Any]] = {}  # dirname -> _identity of the manifest rank 0 listed
        self._saved_by: Dict[str, int] = {}  # dirname -> the world size that saved it (disk candidates)
        self._remote_dirs: Set[str] = set()
        self.last_load: Optional[LoadInfo] = None
        self._remote = remote
        self._remote_only = remote_only
        self._emit = emit  # the Checkpointer's listeners (rank 0's ``steps_lost``)
        self.peers: Optional[PeerMap] = None  # the peer-memory tier's addresses (engine/replicas.py)
        self._sources: Dict[Tuple[int, str], Dict[int, List[Tuple[int, str]]]] = {}  # see candidates()
        self._fetched: Optional[str] = None  # where the last memory read was fetched from

    @property
    def rank(self) -> int:
        return self._topology.rank

    @property
    def world_size(self) -> int:
        return self._topology.world_size

    def candidates(self, step: Optional[int] = None, *, any_world_size: bool = False
                   ) -> List[Tuple[int, str, Optional[str]]]:
        """Agree with all ranks on the load candidates: ``[(step, "memory"|"disk", dirname)]``, newest first.

        Directories skipped as damaged are kept in ``self._damaged`` (``"dirname: what is wrong"``). With
        ``step``, a committed directory whose files fail the quick size check is still a candidate, so
        that reading it fails with an error naming the damaged file instead of "not found" (case B3).
        ``any_world_size``: committed directories of another world size are candidates too (for a framework
        loader that reads them by path at any world size); memory snapshots (one per rank of the world that
        took them) stay of this world size only, as do the remote tier's steps.

        Raises:
            IncompatibleCheckpointError: only checkpoints of another world size exist (not with
                ``any_world_size``).
        """
        reply = self._session.request("held")
        held = reply["slots"]
        stale = sorted({s["step"] for s in held if s.get("dir_id") not in (None, self._dir_id)})
        if stale:
            log.warning("rank %d: memory snapshots of steps %s belong to an earlier %s that was deleted and "
                        "re-created; they are ignored (a fresh start)", self.rank, stale, self.checkpoint_dir)
        mem = sorted({(s["step"], s["run_id"]) for s in held if s.get("world_size", self.world_size)
                      == self.world_size and s.get("dir_id") in (None, self._dir_id)})
        disk: List[List[Any]] = []
        problems: List[str] = []
        if self.rank == 0:
            for c in self._list_committed(step, problems):
                saved = c.manifest.get("requested_unix", c.manifest.get("created_unix", 0.0))
                disk.append([c.step, c.dirname, c.manifest["world_size"], saved, _identity(c.manifest)])
            for p in problems:
                if p not in self._warned_damaged:
                    self._warned_damaged.add(p)
                    log.warning("not a loadable checkpoint: %s", p)
        remote, remote_error = self._remote_listing() if self.rank == 0 else ([], "")
        holds = self._holdings()
        everyone = self._coord.all_gather("candidates", {"mem": mem, "disk": disk, "damaged": problems,
                                                         "remote": remote, "remote_error": remote_error,
                                                         "holds": holds,
                                                         "node": self._topology.node_index},
                                          self.options.coordination_timeout_secs)
        self._damaged = everyone[0]["damaged"]
        #: dirnames the remote tier listed as committed (of this world size): a damaged local copy is replaced
        self._remote_dirs = {r[1] for r in everyone[0]["remote"] if r[2] == self.world_size}
        tier = memory_tier(everyone, self.world_size)
        self._sources = tier.sources
        common = tier.complete
        if not common and any(tier.have) and self.rank == 0 and not self._warned_no_common:
            self._warned_no_common = True  # candidates() runs for latest_step() and load(): said once
            log.warning("ranks hold memory snapshots but no step is held by every rank, own slots and peer "
                        "replicas counted (steps per rank: %s); the memory tier cannot be used",
                        {r: sorted({s for s, _ in have}) for r, have in enumerate(tier.have)})
        disk_all = everyone[0]["disk"]
        wrong = [] if any_world_size else [d for d in disk_all if d[2] != self.world_size]
        disk_ok = [d for d in disk_all if any_world_size or d[2] == self.world_size]
        self._saved_by = {d[1]: int(d[2]) for d in disk_ok}
        self._disk_saved = [(d[0], d[1], d[3]) for d in disk_ok]
        self._listed = {d[1]: d[4] for d in disk_ok}
        self._remote_saved = [(r[0], r[1], r[3]) for r in everyone[0]["remote"]
                              if r[2] == self.world_size and r[1] not in self._listed]
        cands = ranked(tier, disk_ok)
        self._warn_interrupted(reply, cands)
        fetched = self._fetch_remote(everyone[0]["remote"], disk_all, cands, step)
        if fetched is not None:
            cands.insert(0, (fetched[0], "disk", fetched[1]))
        self._warn_lost_memory(everyone, tier, cands)  # after the remote tier's step: it may be the newest
        if not cands and everyone[0]["remote_error"]:
            # a fresh start would upload over the remote checkpoints (and its retention delete them)
            raise RemoteStorageError(
                f"remote_dir {self._remote_url()!r} cannot be listed ({everyone[0]['remote_error']}) and neither "
                f"memory nor {self.checkpoint_dir} holds a checkpoint: the remote tier may hold this job's "
                "checkpoints, so nothing is loaded rather than starting from step 0; retry once the store "
                "answers (check the endpoint, AWS_ENDPOINT_URL, the network and the credentials), or give a "
                "new remote_dir to start afresh on purpose")
        if not cands and wrong:
            raise IncompatibleCheckpointError(
                f"{self.checkpoint_dir} holds checkpoints written by world size "
                f"{sorted({d[2] for d in wrong})}, this job has {self.world_size}; snapckpt does not "
                "reshard: resume with the same number of ranks")
        return cands

    def _list_committed(self, step: Optional[int], problems: List[str]) -> List[Any]:
        """Rank 0: the committed checkpoints of ``checkpoint_dir``, oldest first (each with ``step``,
        ``dirname``, ``manifest``); damaged ones are described in ``problems``. Remote-only mode: the
        store's prefixes with a manifest whose objects have their sizes; a store that cannot be listed is a
        problem too (never a silent fresh start)."""
        if not self._remote_only:
            return list_committed(self._storage, self.checkpoint_dir, quick_check=step is None,
                                  problems=problems, name_pattern=layout.STEP_DIR_PATTERN)
        secs = self._answer_secs
        found: List[str] = []  # the listing's own list: a listing given up may still append to it
        try:
            listed = call_bounded(lambda: self._store().list_committed(found), secs)
            problems.extend(found)
            return [c for c in listed if layout.STEP_DIR_PATTERN.fullmatch(c.dirname)]
        except NoAnswer:
            problems.append(f"{self.checkpoint_dir}: cannot be listed (the store did not answer within {secs:g} s: "
                            "stalled, overloaded or unreachable)")
            return []
        except Exception as e:
            problems.append(f"{self.checkpoint_dir}: cannot be listed ({type(e).__name__}: {str(e)[:300]})")
            return []

    def _store(self) -> RemoteStore:
        """Remote-only mode: this rank's client of the store (rank 0's is the Checkpointer's)."""
        if self._remote is None:
            self._remote = RemoteStore(self.checkpoint_dir, role="checkpoint_dir")
        return self._remote

    def _holdings(self) -> List[List[Any]]:
        """On the first rank of each node, with peer replicas: ``[[rank, step, run_id, kind]]`` of the
        snapshots its persister can serve (its slots, its replicas) of this world size and directory."""
        if self.peers is None or self._topology.local_rank != 0:
            return []
        out = []
        for h in self._session.request("holdings")["holdings"]:
            if h["world_size"] == self.world_size and h["dir_id"] == self._dir_id:
                out.append([h["rank"], h["step"], h["run_id"], h["kind"]])
        return out

    def _fetch(self, step: int, run_id: str) -> None:
        """Fetch this rank's part of memory step ``step`` (run ``run_id``) into its own arena from a node
        that holds it (a replica first, then another node's own slot; its own node last: a rank that moved
        onto the node holding its replica). Nothing happens when no node holds it (the read then fails as
        "no longer held")."""
        self._fetched = None
        holders = (self._sources.get((step, run_id)) or {}).get(self.rank) or []
        if not holders or self.peers is None:
            return
        mine = self._topology.node_index
        node, kind = sorted(holders, key=lambda h: (h[0] == mine, h[1] != "replica"))[0]
        addr, port = self.peers.addrs[node]
        t0 = time.perf_counter()
        self._session.request("fetch", step=step, run_id=run_id, addr=addr, port=port)
        self._fetched = f"node {node} ({kind})"
        log.warning("rank %d: step %d was not in this node's memory: fetched from %s in %.3f s", self.rank, step,
                    self._fetched, time.perf_counter() - t0)

    def _remote_listing(self) -> Tuple[List[List[Any]], str]:
        """Rank 0: the remote tier's committed checkpoints ``[[step, dirname, world_size, saved at]]`` (Unix
        seconds, their manifest's ``requested_unix``: see :meth:`_warn_rewind`) and ``""``;
        ``([], "")`` without a remote tier; ``([], "Type: cause")`` when it cannot be listed (a warning: the
        local tiers go on, and :meth:`candidates` refuses a fresh start when they hold nothing), except when
        this start created the directory's owner record (a first run: ``([], "")``, it holds nothing of it)."""
        if self._remote is None or self._remote_only:
            return [], ""
        remove_download_leftovers(self.checkpoint_dir)  # of a download killed in an earlier run
        secs = self._answer_secs
        try:
            listed = self._list_remote()
            return [[c.step, c.dirname, c.manifest["world_size"],
                     c.manifest.get("requested_unix", c.manifest.get("created_unix", 0.0))] for c in listed], ""
        except Exception as e:
            cause = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if isinstance(e, NoAnswer):
                cause = f"the store did not answer within {secs:g} s (stalled, overloaded or unreachable)"
            if self._remote.claimed_new:  # this start made the owner record: nothing of this job can be there
                log.warning("remote tier %s cannot be listed (%s); it held no checkpoint of this job when it "
                            "started", self._remote.url, cause)
                return [], ""
            log.warning("remote tier %s cannot be listed (%s); loading from memory and %s only",
                        self._remote.url, cause, self.checkpoint_dir)
            return [], cause

    @property
    def _answer_secs(self) -> float:
        """Seconds a store request at load may take: half the coordination timeout, so that rank 0 answers
        (with an error) before the other ranks' wait for it ends."""
        return self.options.coordination_timeout_secs / 2

    def _list_remote(self) -> List[Any]:
        """Rank 0: the remote tier's committed checkpoints, given up after :attr:`_answer_secs` (``NoAnswer``)."""
        return call_bounded(self._remote.list_committed, self._answer_secs)

    def _remote_url(self) -> str:
        """``remote_dir`` for messages (rank 0 holds the store; every rank has the option)."""
        return self._remote.url if self._remote is not None else str(self.options.resolved_remote_dir)

    def _fetch_remote(self, remote: List[List[Any]], disk_all: List[List[Any]],
                      cands: List[Tuple[int, str, Optional[str]]], step: Optional[int]) -> Optional[Tuple[int, str]]:
        """When the remote tier holds steps of this world size newer than every memory and disk candidate (or
        ``step`` when no candidate is of ``step``) that ``checkpoint_dir`` has no directory of, rank 0
        downloads the newest of them into ``checkpoint_dir`` (checksums verified, committed the local way)
        while the other ranks wait; a step whose download fails (damaged in the store, unreachable) is a
        warning and the next newest is tried. Return ``(step, dirname)`` once every rank knows it is there,
        ``None`` when nothing was fetched; the steps that failed are added to the damaged list (so that no
        checkpoint at all is an error, never a silent fresh start, when the remote tier held some)."""
        local = {d[1] for d in disk_all}
        # load(step=N): N is fetched when no tier here holds it, however old (a rewind's advice names it)
        floor = max((c[0] for c in cands if step is None or c[0] == step), default=-1)
        pick = sorted((r for r in remote if r[2] == self.world_size and r[1] not in local and r[0] > floor
                       and (step is None or r[0] == step)), key=lambda r: r[0], reverse=True)
        if not pick:
            return None
        got: Optional[List[Any]] = None
        failed: List[str] = []
        if self.rank == 0:
            committed = {c.dirname: c for c in self._list_remote()}
            for best in pick:
                try:
                    t0 = time.perf_counter()
                    c = committed[best[1]]
                    self._download(c)
                    log.info("rank 0: step %d downloaded from %s in %.3f s", best[0], c.url, time.perf_counter() - t0)
                    got = [best[0], best[1]]
                    break
                except Exception as e:
                    error = f"{type(e).__name__}: {str(e)[:500]}"
                    failed.append(f"{self._remote.url}/{best[1]}: {error}")
                    log.warning("downloading step %d (%s) from the remote tier failed: %s; trying the next newest "
                                "checkpoint", best[0], best[1], error)
        agreed = self._coord.all_gather("remote fetch", {"got": got, "failed": failed},
                                        self.options.coordination_timeout_secs)[0]
        self._damaged = list(self._damaged) + agreed["failed"]
        return None if agreed["got"] is None else (agreed["got"][0], agreed["got"][1])

    def _download(self, c: Any) -> None:
        """Rank 0: download the remote checkpoint ``c`` into ``checkpoint_dir``. A local directory of that name
        (one found damaged: not listed as committed, or refused by a read) is replaced when its manifest names the
        same save (run and commit time) or is there but unreadable; a directory of another save, and one without a
        manifest file (not written by snapckpt: never touched), stays.

        Raises:
            FileExistsError: the local directory holds another save of the step, or no manifest file.
            CheckpointCorruptError / the store's errors: the download failed (the local directory untouched).
        """
        final = os.path.join(self.checkpoint_dir, c.dirname)
        replace = os.path.lexists(final)
        if replace:
            mpath = os.path.join(final, MANIFEST)
            if not os.path.lexists(mpath):
                raise FileExistsError(f"{final} exists without a snapckpt manifest; not replaced by {c.url}")
            try:
                here = _identity(parse_manifest(self._storage.read_bytes(mpath), c.dirname, source=mpath))
            except (OSError, ValueError, CheckpointCorruptError):
                here = None
            if here is not None and here != _identity(c.manifest):
                raise FileExistsError(f"{final} holds another save of step {c.step} (run {here[0]} committed at "
                                      f"{here[1]}) than {c.url}; not replaced")
        self._remote.download(c, self.checkpoint_dir, fsync=self.options.fsync, replace=replace)

    def _repair_from_remote(self, step: int, dirname: str, bad: Dict[int, Dict[str, Any]]) -> bool:
        """After the local copy ``dirname`` of ``step`` failed its read on the ranks ``bad`` as damaged: when the
        remote tier listed the same save of it, rank 0 replaces the local copy by a verified download while the
        other ranks wait. Return whether every rank may read it again (the same answer on every rank)."""
        if (dirname not in self._remote_dirs or dirname not in self._listed
                or any(p.get("vanished") for p in bad.values())):
            return False
        got, error = False, ""
        if self.rank == 0:
            try:
                c = {c.dirname: c for c in self._list_remote()}.get(dirname)
                if c is None:
                    error = "no longer committed in the remote tier"
                elif _identity(c.manifest) != self._listed[dirname]:
                    error = f"the remote tier holds another save of step {step}"
                else:
                    self._download(c)
                    got = True
            except Exception as e:
                error = f"{type(e).__name__}: {str(e)[:500]}"
            if got:
                log.warning("step %d (%s) failed its checks on ranks %s: replaced by the intact copy downloaded "
                            "from the remote tier %s; reading it again", step, dirname, sorted(bad), self._remote.url)
            else:
                log.warning("step %d (%s) failed its checks on ranks %s; its remote copy cannot replace it: %s",
                            step, dirname, sorted(bad), error)
        return bool(self._coord.all_gather("remote repair", {"got": got},
                                           self.options.coordination_timeout_secs)[0]["got"])

    def _warn_lost_memory(self, everyone: List[Dict[str, Any]], tier: MemoryTier,
                          cands: List[Tuple[int, str, Optional[str]]]) -> None:
        """Rank 0 names what a restart loses when some rank's part of a memory step newer than the newest
        step complete in any tier is held (own slots or peer replicas) but not every rank's: a warning and a
        ``steps_lost`` event (:func:`snapckpt.engine.agreement.lost_steps` words it)."""
        if self.rank != 0:
            return
        msg = lost_steps(everyone, tier, cands[0] if cands else None)
        if msg is None:
            return
        newest = max(s for s in tier.where if not cands or s > cands[0][0])
        key = (newest, cands[0][0] if cands else None)
        if key == self._warned_lost:  # latest_step() and load() of one restart: said once
            return
        self._warned_lost = key
        log.warning("%s", msg)
        if self._emit is not None:
            self._emit(Event("steps_lost", newest, StorageType.MEMORY, self.rank, reason=msg))

    def _warn_interrupted(self, held: Dict[str, Any], cands: List[Tuple[int, str, Optional[str]]]) -> None:
        """Name a memory snapshot of this rank that is newer than what will be loaded but was never complete (its
        copy into the arena was cut short: the process died or the copy failed). It is never loaded (its
        slot is INVALID); with a single slot per rank it also overwrote the previous memory snapshot."""
        best = cands[0][0] if cands else None
        torn = sorted({t["step"] for t in held.get("interrupted") or [] if best is None or t["step"] > best})
        if not torn:
            return
        one = (" (this rank has a single arena slot, slots_per_rank=1 or a host-memory budget: the copy was "
               "overwriting the previous memory snapshot, so memory holds no complete one)"
               if held.get("usable_slots") == 1 else "")
        log.warning("rank %d: the memory snapshot of step(s) %s is incomplete: its copy into the arena was "
                    "interrupted (the process died or the copy failed mid-way), so it is never loaded%s; loading "
                    "%s instead", self.rank, torn, one,
                    "nothing (a fresh start)" if best is None else f"step {best} ({cands[0][1]})")

    def latest_step(self) -> Optional[int]:
        """``Checkpointer.latest_step`` after its ``wait()`` (its docstring has the details)."""
        cands = self.candidates()
        if not cands and self._damaged:
            self._raise_nothing_loadable(None, [])
        return cands[0][0] if cands else None

    def verify(self, path: str, dirname: str) -> Dict[str, Any]:
        """Check this rank's files of the committed directory ``path`` against its manifest (sizes, and
        checksums unless ``verify_checksums=False``); return the manifest.

        Raises:
            CheckpointCorruptError: a file is missing, of the wrong size or fails its checksum.
        """
        if self._remote_only:
            m, _ = self._read_remote(dirname)
            return m
        m = self._manifest(path, dirname)
        if int(m.get("world_size", self.world_size)) != self.world_size:
            # saved by another world size: the ranks' files do not map to this job's ranks; each rank checks a
            # share of every file (the framework's loader may read any of them on any rank)
            share = dict(sorted(m["files"].items())[self.rank::self.world_size])
            checks = check_checksums if self.options.verify_checksums else check_sizes
            checks(self._storage, path, {**m, "files": share})
            return m
        if self.options.verify_checksums:
            mine = sum(int(r.get("nbytes", 0)) for r in m["files"].values() if r.get("rank") == self.rank)
            # A bar for a long read (>= 1 GiB), on local rank 0 only, when its stderr is a terminal.
            show = None if mine >= (1 << 30) and self._topology.local_rank == 0 else False
            with byte_bar(mine, f"verifying {dirname}", show) as bar:
                check_checksums(self._storage, path, m, rank=self.rank, progress=bar.update)
        else:
            check_sizes(self._storage, path, m, rank=self.rank)
        return m

    def _manifest(self, path: str, dirname: str) -> Dict[str, Any]:
        """The manifest of the committed directory ``path``, checked to be the copy rank 0 listed when the ranks
        agreed on the candidates.

        Raises:
            CheckpointCorruptError: unreadable or invalid, or another copy: the job saving there committed
                ``dirname`` again (a save after a rewind) since the listing. Each copy is whole, so without this
                check some ranks could load the old copy and others the new one, with no error anywhere.
        """
        mpath = os.path.join(path, MANIFEST)
        return self._as_listed(parse_manifest(self._storage.read_bytes(mpath), dirname, source=mpath), dirname, path)

    def _as_listed(self, m: Dict[str, Any], dirname: str, where: str) -> Dict[str, Any]:
        """``m`` if it is the commit of ``dirname`` that rank 0 listed (see :meth:`_manifest`); else raises
        :class:`CheckpointCorruptError` naming ``where``."""
        listed = self._listed.get(dirname)
        if listed is not None and _identity(m) != listed:
            err = CheckpointCorruptError(
                f"{where} was committed again while this load read it (the ranks agreed on the copy of run "
                f"{listed[0]} committed at {listed[1]}, this rank found run {m.get('run_id')} committed at "
                f"{m.get('created_unix')}: the job saving there saved step {m.get('step')} again); refused on "
                "every rank so that no rank loads another copy than the others (load it again to get the new copy)")
            err.recommitted = True  # told by this flag, not by the words (see _is_recommit)
            raise err
        return m

    def read(self, cand: LoadCandidate, views: bool = False, slot: Optional[MappedSlot] = None) -> Dict[str, Any]:
        """This rank's files of ``cand`` (what :meth:`LoadCandidate.files` returns).

        Args:
            views: MEMORY: views of the arena slot instead of copies; DISK: memory-mapped torch files.
            slot: MEMORY: the slot's mapping when the caller has it (:meth:`memory_slot`), so that the persister
                is not asked again which slot holds the step.

        Raises:
            CheckpointNotFoundError: the memory snapshot is no longer held.
            CheckpointCorruptError: the slot holds another step, or a file fails its checks.
            UnsafeCheckpointError: ``weights_only=True`` met pickled objects.
        """
        if cand.tier == StorageType.MEMORY:
            return self._read_memory(cand, views, slot)
        if self._remote_only:
            m, files = self._read_remote(cand.dirname)
            cand._modes = _modes(m["files"].items(), self.rank)
            return files
        path = cand.path
        m = self.verify(path, cand.dirname)
        cand._modes = _modes(m["files"].items(), self.rank)
        weights_only = self.options.weights_only

        def read(name: str, rec: Dict[str, Any]) -> Any:
            if rec.get("kind", "torch") == "bytes":
                return self._storage.read_bytes(os.path.join(path, name))
            try:
                return torch.load(os.path.join(path, name), map_location="cpu", weights_only=weights_only,
                                  mmap=views)
            except Exception as e:
                if weights_only and "weights_only" in str(e):
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

    def read_into(self, cand: LoadCandidate, dst: Any) -> Tuple[Any, Any]:
        """This rank's object of a DISK candidate written by ``save`` (one torch file per rank), its large tensors
        read straight into the live tensors of ``dst`` with the checksum computed on the way
        (:func:`~snapckpt.engine.disk_restore.read_into`): ``(object, ids of the dst tensors filled)``. Other
        layouts (several files of this rank) are read as :meth:`read` does, nothing filled.

        Raises:
            CheckpointCorruptError: a file is missing, of the wrong size or fails its checksum.
            UnsafeCheckpointError: ``weights_only=True`` met pickled objects.
        """
        from snapckpt.engine.disk_restore import read_into

        name = layout.rank_filename(self.rank)
        if self._remote_only:  # read into memory from the store, then copied into dst by the caller
            return self.read(cand)[name], frozenset()
        m = self._manifest(cand.path, cand.dirname)
        mine = [n for n, rec in m["files"].items() if rec["rank"] == self.rank]
        rec = m["files"].get(name)
        if mine != [name] or rec.get("kind", "torch") != "torch":
            return self.read(cand, views=True)[name], frozenset()
        obj, filled = read_into(os.path.join(cand.path, name), int(rec["nbytes"]), rec, dst,
                                weights_only=self.options.weights_only, verify=self.options.verify_checksums)
        return obj, filled

    def _read_remote(self, dirname: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Remote-only mode: ``(manifest, this rank's files)`` of the committed prefix ``dirname``, each file
        read into memory by parallel ranged GETs, its size and checksum verified (always: the bytes come
        over the network), then unpickled (``weights_only`` as configured).

        Raises:
            CheckpointCorruptError: the manifest is missing or damaged, or a file is missing, of the wrong
                size or fails its checksum (named).
            UnsafeCheckpointError: ``weights_only=True`` met pickled objects.
        """
        import io

        store = self._store()
        where = store.display(dirname, MANIFEST)
        try:
            data = store.read_bytes(f"{store.url}/{dirname}/{MANIFEST}")
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{where} is missing (the checkpoint was deleted, or is being "
                                         "replaced)") from e
        m = self._as_listed(parse_manifest(data, dirname, source=where), dirname, where)
        out: Dict[str, Any] = {}
        for name, rec in sorted(m["files"].items()):
            if rec.get("rank") != self.rank:
                continue
            raw = store.read_verified(dirname, name, rec)
            if rec.get("kind", "torch") == "bytes":
                out[name] = bytes(raw)
                continue
            try:
                out[name] = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=self.options.weights_only)
            except Exception as e:
                if self.options.weights_only and "weights_only" in str(e):
                    raise UnsafeCheckpointError(
                        f"{store.display(dirname, name)} holds objects that weights_only=True refuses; if you "
                        "trust this checkpoint location pass weights_only=False to the Checkpointer") from e
                raise CheckpointCorruptError(f"{store.display(dirname, name)} cannot be read as a torch "
                                             f"file: {type(e).__name__}: {e}") from e
            del raw
        return m, out

    def _read_memory(self, cand: LoadCandidate, views: bool, slot: Optional[MappedSlot]) -> Dict[str, Any]:
        m = slot if slot is not None else self.memory_slot(cand)
        index = read_index(m.buf, m.path)
        got_step, files = read_slot(m.buf, m.tensor, weights_only=self.options.weights_only, source=m.path,
                                    copy=not views, index=index)
        cand._modes = _modes(((f["path"], f) for f in index["files"]), None)
        if got_step != cand.step:
            raise CheckpointCorruptError(f"memory slot of rank {self.rank} holds step {got_step}, "
                                         f"not {cand.step}")
        return files

    def memory_slot(self, cand: LoadCandidate) -> MappedSlot:
        """The mapping of the slot that holds this rank's part of the MEMORY candidate ``cand`` (fetched from a
        peer's memory first when this node does not hold it).

        Raises:
            CheckpointNotFoundError: the memory snapshot is no longer held.
        """
        held = self._session.request("held")["slots"]
        mine = [s for s in held if s["step"] == cand.step and s["run_id"] == cand.run_id]
        if not mine:
            self._fetch(cand.step, cand.run_id)
            held = self._session.request("held")["slots"]
            mine = [s for s in held if s["step"] == cand.step and s["run_id"] == cand.run_id]
        else:
            self._fetched = None
        if not mine:
            raise CheckpointNotFoundError(f"rank {self.rank} no longer holds step {cand.step} in memory")
        s = max(mine, key=lambda x: x["seq"])
        return self._maps.get(s["slot"], s["path"], s["nbytes"])

    def load_with(self, fn: Callable[[LoadCandidate], Any], step: Optional[int] = None, *,
                  dirname: Optional[str] = None, check: Optional[Callable[[LoadCandidate], Any]] = None,
                  any_world_size: bool = False) -> Tuple[Any, LoadCandidate]:
        """``Checkpointer.load_with`` after its checks and ``wait()`` (its docstring has the details)."""
        t0 = time.perf_counter()
        cands = all_cands = self.candidates(step, any_world_size=any_world_size)
        if step is not None:
            cands = [c for c in cands if c[0] == step]
        if dirname is not None:
            cands = [c for c in cands if c[1] == "disk" and c[2] == dirname]
        errors: List[str] = []
        vanished = 0  # of errors: candidates refused only because their directory went away while read
        t_agreed = time.perf_counter()
        for cstep, tier, key in cands:
            cand = LoadCandidate(self, cstep, StorageType.MEMORY if tier == "memory" else StorageType.DISK, key)
            result, bad = self._try(cand, check, fn)
            if bad and tier == "disk" and self._repair_from_remote(cstep, key, bad):
                result, bad = self._try(cand, check, fn)
            if not bad:
                t1 = time.perf_counter()
                self.last_load = LoadInfo(cstep, cand.tier, t1 - t0, tuple(errors),
                                          self._fetched if cand.tier == StorageType.MEMORY else None,
                                          agree_secs=t_agreed - t0, read_secs=t1 - t_agreed)
                log.info("rank %d: loaded step %d from %s in %.3f s", self.rank, cstep, cand.tier.value,
                         self.last_load.seconds)
                if step is None and dirname is None:
                    self._warn_rewind(cstep)
                self._warn_world_size(cand)
                if errors:
                    log.warning("rank %d: loaded step %d (%s), not the newest: %d newer checkpoint(s) refused: "
                                "%s; `snapckpt verify %s` checks them all", self.rank, cstep, cand.tier.value,
                                len(errors), " | ".join(errors), self.checkpoint_dir)
                return result, cand
            where = f"{tier}, {key}" if tier == "disk" else tier
            msg = f"step {cstep} ({where}) unreadable on ranks {sorted(bad)}: " + "; ".join(
                f"rank {r}: {p['error']}" for r, p in sorted(bad.items()))
            log.warning("%s; trying the next newest checkpoint", msg)
            errors.append(msg)
            vanished += all(p.get("vanished", False) for p in bad.values())
        held = sorted({c[0] for c in all_cands} | {d[0] for d in self._disk_saved})
        if (step is not None or dirname is not None) and errors and vanished == len(errors) and not self._damaged:
            # the one asked for was retired after the listing: gone, as when retired before it, not damage
            what = f"step {step}" if step is not None else dirname
            raise CheckpointNotFoundError(f"no complete checkpoint of {what} in memory or in {self.checkpoint_dir}: "
                                          f"{'; '.join(errors)}")
        self._raise_nothing_loadable(step, errors, held)

    def _warn_world_size(self, cand: LoadCandidate) -> None:
        """Rank 0 warns when ``cand`` (loaded) was saved by another world size (``any_world_size``)."""
        saved_by = self._saved_by.get(cand.dirname or "", self.world_size) if cand.tier == StorageType.DISK else None
        if self.rank == 0 and saved_by is not None and saved_by != self.world_size:
            log.warning("loaded step %d from %s, saved by world size %d; this job has %d: the framework's own "
                        "loader read it (memory snapshots of that world are not used)", cand.step, cand.path,
                        saved_by, self.world_size)

    def _try(self, cand: LoadCandidate, check: Optional[Callable[[LoadCandidate], Any]],
             fn: Callable[[LoadCandidate], Any]) -> Tuple[Any, Dict[int, Dict[str, Any]]]:
        """Run ``check`` then ``fn`` on ``cand``, each agreed on by every rank: ``(fn's result, {rank:
        record})``, the records of the ranks that failed the first phase that failed on some rank (``{}``: it
        loaded everywhere). A record is ``{"ok": False, "error": "Type: message", "vanished": bool}``;
        ``vanished``: the rank's read failed because the candidate's directory is gone (retired while it was
        read), told by the directory's absence, never by the error's text."""
        result = None
        bad: Dict[int, Dict[str, Any]] = {}
        for phase, call in (("checked", check), ("loaded", fn)):
            if call is None:
                continue
            try:
                out = call(cand)
                if phase == "loaded":
                    result = out
                    # The files were opened by path after the manifest was checked: a re-commit in between gave
                    # this rank the new copy's files (whole, their own checksums). Still the listed commit now, it
                    # was then too (a commit never puts a listed copy back), so every file read was of that copy.
                    self._still_listed(cand)
                mine = {"ok": True, "error": "", "vanished": False}
            except Exception as e:
                mine = {"ok": False, "error": f"{type(e).__name__}: {e}", "vanished": False}
                if isinstance(e, UnsafeCheckpointError):  # a trust decision, not damage: no fallback
                    raise
                if (isinstance(e, (FileNotFoundError, CheckpointCorruptError)) and cand.path is not None
                        and not self._remote_only and not os.path.isdir(cand.path)):
                    mine["vanished"] = True
                    mine["error"] += _VANISHED
                elif not _is_recommit(e) and self._recommitted(cand):
                    mine["error"] += (" (the step was committed again while it was read, by the job saving there: "
                                      "its files changed under the read; not damage)")
            everyone = self._coord.all_gather(phase, mine, self.options.coordination_timeout_secs)
            bad = {r: p for r, p in enumerate(everyone) if not p["ok"]}
            if bad:
                break
        return result, bad

    def _still_listed(self, cand: LoadCandidate) -> None:
        """DISK: check that ``cand``'s directory still holds the commit rank 0 listed, after this rank read it.

        Raises:
            CheckpointCorruptError: another commit is there now (see :meth:`_manifest`), or no valid manifest.
            FileNotFoundError: the directory is gone (retired while it was read): which copy was read is unknown.
        """
        if cand.tier != StorageType.DISK or cand.dirname not in self._listed:
            return
        if self._remote_only:
            store = self._store()
            where = store.display(cand.dirname, MANIFEST)
            data = store.read_bytes(f"{store.url}/{cand.dirname}/{MANIFEST}")
            self._as_listed(parse_manifest(data, cand.dirname, source=where), cand.dirname, where)
            return
        self._manifest(cand.path, cand.dirname)

    def _recommitted(self, cand: LoadCandidate) -> bool:
        """Whether ``cand``'s directory now holds another commit than the listed one (a read that failed its
        checks on the new copy's files is a re-commit, not damage); ``False`` when that cannot be told."""
        try:
            self._still_listed(cand)
        except CheckpointCorruptError as e:
            return _is_recommit(e)
        except Exception:
            return False
        return False

    def _raise_nothing_loadable(self, step: Optional[int], errors: List[str],
                                held: Sequence[int] = ()) -> None:
        """Raise why nothing (of ``step``) can be loaded: :class:`CheckpointCorruptError` when checkpoints
        exist but every one was refused (``errors``, one per candidate) or skipped as damaged
        (``self._damaged``), :class:`CheckpointNotFoundError` only when there is truly nothing. Never "not
        found" for damage: integrations and users rightly read that as "start afresh" or "let the
        framework's own loader read the directory". ``held``: the steps that can be loaded (memory or disk),
        named in the "not found" message."""
        what = f"step {step}" if step is not None else "any step"
        if errors or self._damaged:
            raise all_damaged_error(self.checkpoint_dir, errors, what=what, skipped=self._damaged,
                                    note=" (memory tier included)")
        steps = f" (loadable steps: {list(held)})" if held else ""
        raise CheckpointNotFoundError(f"no complete checkpoint of {what} in memory or in {self.checkpoint_dir}"
                                      f"{steps}")

    def _warn_rewind(self, loaded: int) -> None:
        """Warn when a lower step than ``loaded`` was saved to disk after it (a rewind): load() picks the
        highest step, retention keeps the most recently saved ones. Only disk saves carry a time (their
        manifest's ``requested_unix``), the remote tier's too (a fresh node downloads its highest step): a step
        loaded from memory with no disk copy at or above it is the ordinary resume after a crash, never
        reported as a rewind."""
        saved = self._disk_saved + self._remote_saved
        since = [e[2] for e in saved if e[0] >= loaded]
        if not since:
            return
        later = [d for d in saved if d[0] < loaded and d[2] > max(since)]
        if later and self.rank == 0:
            newest = max(later, key=lambda d: d[2])
            log.warning("loaded step %d, the highest step; step %d (%s) was saved after it (a rewind?). To "
                        "resume from it pass load(step=%d), or delete the abandoned higher steps", loaded,
                        newest[0], newest[1], newest[0])

    def verify_directory(self, path: str, dirname: str, present_only: bool = False) -> str:
        """``Checkpointer.verify_directory`` (its docstring has the details): this rank's share of the files
        checked, the errors agreed on; ``""`` or every failing rank's error, ``"; "``-joined."""
        mpath = os.path.join(path, MANIFEST)
        error: Optional[str] = None
        if os.path.exists(mpath):
            try:
                m = parse_manifest(self._storage.read_bytes(mpath), dirname, source=mpath)
                if present_only:
                    m = present_files(self._storage, path, m)
                share = dict(sorted(m["files"].items())[self.rank::self.world_size])
                check_checksums(self._storage, path, {**m, "files": share})
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        bad = self._coord.agree(f"verify {dirname}", error)
        return "; ".join(bad[r] for r in sorted(bad))


def _is_recommit(e: BaseException) -> bool:
    """Whether ``e``, or an error it was raised from (``raise ... from``: its ``__cause__``, not an error that
    merely occurred while another was handled), is :meth:`Loader._as_listed`'s refusal of a copy committed again
    since the listing (its ``recommitted`` flag)."""
    for _ in range(8):
        if getattr(e, "recommitted", False):
            return True
        if e.__cause__ is None:
            return False
        e = e.__cause__
    return False


# the words only: whether a refusal was a vanish is the try record's "vanished" flag (Loader._try)
_VANISHED = (" (the directory was deleted or renamed while it was read: retention of the job saving there, or by "
             "hand; not damage)")


def _identity(manifest: Dict[str, Any]) -> List[Any]:
    """Which commit of a directory a manifest is: ``[run_id, created_unix]`` (a re-commit of the same step, even
    by the same run, has another commit time)."""
    return [manifest.get("run_id"), manifest.get("created_unix")]


def _modes(records: Iterable[Tuple[str, Dict[str, Any]]], rank: Optional[int]) -> Dict[str, int]:
    """``{name: mode}`` of the file records (manifest records of ``rank``, or slot index entries with ``rank``
    None) that hold permission bits."""
    return {name: rec["mode"] for name, rec in records
            if rec.get("mode") is not None and (rank is None or rec.get("rank") == rank)}
