"""Dead peers: a commit that can never finish is abandoned in seconds, not at the commit timeout.

A commit waits for a part of every rank (:mod:`snapckpt.persister.commit`). When a rank's process dies
before it handed its part of step ``N`` to its node's persister, or a whole node is lost with its
persister, that part never comes: without this module the committer (and every ``close()`` behind it)
would wait ``commit_timeout_secs`` (600 s by default). Two records, in a place every node already shares
(the checkpoint directory), tell the waiting persisters instead::

    <checkpoint_dir>/.snapckpt.peers-<run_id>/
        gone_00003.json    rank 3's process is gone (written by its node's persister)
        lease_00002.json   the persister serving ranks 2 and 3 is alive (named by its first local rank)

- **A rank's process gone.** A local rank that disconnects from its node's persister without ``close()``
  (``kill -9``, a crash) is gone: its persister writes ``gone_<rank>`` at once, for the whole run (steps
  it knows and steps the rank never requested), with the rank's pid and host and ``pending``: the saves
  ``[step, dirname]`` whose part that persister will still write for the dead rank (the DISK saves the
  rank handed over before it died, and, until the node's last rank has left and the crash flush has
  decided, the snapshots the rank holds in memory, which that flush may write; ``final`` is true once it
  has). A rank that connects again to the same run (same rank, new connection) removes its record.
- **A node's persister gone.** Each persister of a run that spans several nodes writes
  ``lease_<first local rank>`` at the run's first ``hello`` and refreshes it every :data:`LEASE_SECS`
  (its pid, host, the ranks it serves and a counter). A waiting persister remembers, on its own monotonic clock, when it last saw each lease's
  counter change (never comparing clocks of two hosts); a lease unchanged for ``peer_timeout_secs``
  (option, ``SNAPCKPT_PEER_TIMEOUT_SECS``, default 10 s) means that node is lost. A lease that is absent
  (never written yet, or removed at a clean exit) proves nothing: the commit timeout still covers it.
  Should the waiting persister itself stall (no check for half the peer timeout), it judges no lease
  on that round (everyone else's lease looks stale after its own pause).

The committer (:func:`~snapckpt.persister.commit.commit`) abandons step ``N`` with
:class:`~snapckpt.errors.PeerLostError` (a ``CommitError``) when a rank whose part is missing is gone and
``[N, dirname]`` is not in its ``pending``, or the lease of the node serving it went stale; the message
names the step, the rank(s), the pid and host. A non-committing persister
(:func:`~snapckpt.persister.commit.watch_commit`) runs the same check on the missing parts and on the
committer's own node (rank 0's lease), so it stops waiting too, even when the committer died with its
node. The survivors' ``wait()``/``close()`` then raise that error at once; the previous checkpoint and the
tracker are untouched (nothing is renamed), and later saves of the run commit normally as long as no rank
they need is gone.

- **A lost node's part written from a replica.** When the crash flush of a persister that holds peer
  replicas (:mod:`snapckpt.persister.replica_flush`) may write a peer rank's part of ``[N, dirname]`` from
  its replica, it first writes ``replica_<rank>`` (the rank, ``pending``, and ``holder_ranks``: the local
  ranks of the holder's node). A waiting persister then waits for that part as for a pending one: the
  rank's own node may still write it, or the holder will once that node is judged lost; the holder's
  node takes the rank's place in the lease check (its loss abandons the commit).

- **A later run of the job started.** Its committer removes this run's directory here with the run's other
  leftovers (its partial directories included: :func:`~snapckpt.persister.commit.recover_interrupted_commits`),
  which it does whenever its persister does not serve this run (the committer moved to another node). A
  waiting persister that saw the directory and finds it gone abandons the commit at its next check (nothing
  it awaits can still arrive: a crash flush of this run would otherwise wait ``commit_timeout_secs``), and a
  replica holder writes nothing. The same holds when the directory goes at the committer's clean exit (below):
  a watch of a commit that did end committed still ends committed (on that error it reads the manifest, or
  has the committer's notice).

A job on one node writes no file here: its committer is the persister that saw the rank go, and reads
the same record from memory (``local_gone``). The directory of a run that ended cleanly is removed by the
committer's persister at exit; after a crash it stays (the records say who died) until the next run of
the job starts (:func:`~snapckpt.persister.commit.recover_interrupted_commits`).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from snapckpt.errors import PeerLostError
from snapckpt.storage.base import StorageReader, StorageWriter

__all__ = ["PEERS_PREFIX", "LEASE_SECS", "peers_dir", "gone_name", "claim_name", "lease_name", "gone_record", "write_gone",
           "remove_gone", "write_lease", "remove_lease", "PeerWatch"]

log = logging.getLogger(__name__)

PEERS_PREFIX = ".snapckpt.peers-"
LEASE_SECS = 1.0  # how often a persister refreshes its lease (seconds)
CHECK_SECS = 0.25  # a waiting persister reads the records at most this often (seconds)

SaveId = Tuple[int, str]  # (step, dirname)


def peers_dir(checkpoint_dir: str, run_id: str) -> str:
    """The run's directory of peer records: ``<checkpoint_dir>/.snapckpt.peers-<run_id>``."""
    return os.path.join(checkpoint_dir, f"{PEERS_PREFIX}{run_id}")


def claim_name(rank: int) -> str:
    return f"replica_{rank:05d}.json"


def gone_name(rank: int) -> str:
    return f"gone_{rank:05d}.json"


def lease_name(first_rank: int) -> str:
    return f"lease_{first_rank:05d}.json"


def gone_record(*, rank: int, run_id: str, pid: Optional[int], host: str, since_unix: float,
                pending: Iterable[SaveId], final: bool) -> Dict[str, Any]:
    """The record of a gone rank (see the module docstring); ``pending``: ``(step, dirname)`` pairs."""
    return {"rank": rank, "run_id": run_id, "pid": pid, "host": host, "since_unix": since_unix,
            "pending": sorted([int(s), str(d)] for s, d in pending), "final": final}


def write_gone(storage: StorageWriter, checkpoint_dir: str, rec: Dict[str, Any]) -> None:
    """Write (or replace) the gone record ``rec``; best effort (a full disk only costs the timeout)."""
    d = peers_dir(checkpoint_dir, rec["run_id"])
    try:
        storage.makedirs(d)
        storage.write_atomic(os.path.join(d, gone_name(rec["rank"])), json.dumps(rec).encode())
    except OSError as e:
        log.warning("could not record that rank %d is gone in %s: %s", rec["rank"], d, e)


def remove_gone(checkpoint_dir: str, run_id: str, rank: int) -> None:
    """Remove rank ``rank``'s gone record (it connected again)."""
    try:
        os.unlink(os.path.join(peers_dir(checkpoint_dir, run_id), gone_name(rank)))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove the gone record of rank %d: %s", rank, e)


def write_lease(storage: StorageWriter, checkpoint_dir: str, run_id: str, ranks: List[int], seq: int,
                *, create: bool) -> None:
    """Refresh this persister's lease of ``run_id`` (serving ``ranks``), counter ``seq``.

    Args:
        create: make the run's directory first (the first lease of the run); afterwards a missing
            directory (removed at the end of the run) is left missing.

    Raises:
        OSError: the lease could not be written (the caller logs it and tries again next beat).
    """
    d = peers_dir(checkpoint_dir, run_id)
    if create:
        storage.makedirs(d)
    rec = {"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(), "ranks": sorted(ranks),
           "seq": seq, "beat_unix": time.time()}
    storage.write_atomic(os.path.join(d, lease_name(min(ranks))), json.dumps(rec).encode())


def remove_lease(checkpoint_dir: str, run_id: str, ranks: List[int]) -> None:
    """Remove this persister's lease (a clean exit: it is not lost)."""
    try:
        os.unlink(os.path.join(peers_dir(checkpoint_dir, run_id), lease_name(min(ranks))))
    except OSError:
        pass


class PeerWatch:
    """A waiting persister's view of one run's peers: which awaited ranks can never deliver their part.

    One per run, shared by the run's commit threads (thread-safe). A lease is judged by what this
    watcher saw while it was checking: a node lost before a commit starts is judged stale
    ``peer_timeout_secs`` after the first check that sees its lease.

    Args:
        reader: reads the run's peer directory.
        checkpoint_dir, run_id: the run.
        peer_timeout_secs: a lease unchanged this long (seconds, this host's monotonic clock) is stale.
        local_gone: ``rank -> gone record`` of this node's own gone ranks, known in memory (a job on one
            node writes no files); ``None``: files only.
        own_lease: the file name of this node's own lease, never judged (this process is alive; a
            stall of its lease thread must not make it declare its own node lost).
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, reader: StorageReader, checkpoint_dir: str, run_id: str, peer_timeout_secs: float,
                 local_gone: Optional[Callable[[], Dict[int, Dict[str, Any]]]] = None,
                 own_lease: Optional[str] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.reader = reader
        self.dir = peers_dir(checkpoint_dir, run_id)
        self.run_id = run_id
        self.peer_timeout_secs = float(peer_timeout_secs)
        self.local_gone = local_gone
        self.own_lease = own_lease
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: Dict[str, Tuple[Any, float]] = {}  # lease file -> (counter, when it last changed)
        self._last_check: Optional[float] = None
        self._last_read = -1e18
        self._gone: Dict[int, Dict[str, Any]] = {}
        self._claims: Dict[int, Dict[str, Any]] = {}
        self._leases: Dict[str, Dict[str, Any]] = {}
        self._dir_seen = False  # the run's record directory existed at a read
        # ...and was gone at a later one: the committer of a later run of the job removed this run's leftovers
        # (commit.recover_interrupted_commits), its partial directories included, or this run's committer's
        # persister exited cleanly (it removes them then) (sticky)
        self.removed = False

    @property
    def tick_secs(self) -> float:
        """How often (seconds) a waiting commit must call :meth:`check`: often enough that a pause between
        two calls is never taken for a stall of this process (half the peer timeout), and at most
        :data:`CHECK_SECS`, how often the records are read anyway."""
        return min(CHECK_SECS, self.peer_timeout_secs / 4)

    def _refresh(self, force: bool = False) -> bool:
        """Re-read the records (at most every :data:`CHECK_SECS` unless ``force``); return whether leases
        may be judged on this round (False after a pause of this process longer than half the peer
        timeout)."""
        now = self.clock()
        judge = self._last_check is None or now - self._last_check <= self.peer_timeout_secs / 2
        self._last_check = now
        if not judge:  # we were not running: nobody's lease can be judged against that pause
            self._seen = {k: (c, now) for k, (c, _) in self._seen.items()}
        if now - self._last_read < CHECK_SECS and judge and not force:
            return judge
        self._last_read = now
        gone: Dict[int, Dict[str, Any]] = {}
        claims: Dict[int, Dict[str, Any]] = {}
        leases: Dict[str, Dict[str, Any]] = {}
        names = self.reader.listdir(self.dir)
        if names or self.reader.isdir(self.dir):
            self._dir_seen = True
        elif self._dir_seen:
            self.removed = True
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            kind, _, num = name[:-5].partition("_")
            if kind not in ("gone", "lease", "replica") or not num.isdigit() or name == self.own_lease:
                continue
            try:
                rec = json.loads(self.reader.read_bytes(os.path.join(self.dir, name)))
            except (OSError, ValueError):
                continue  # being replaced, or just removed: next round
            if not isinstance(rec, dict) or rec.get("run_id") != self.run_id:
                continue
            if kind == "gone":
                gone[int(num)] = rec
            elif kind == "replica":
                claims[int(num)] = rec
            else:
                leases[name] = rec
                seen = self._seen.get(name)
                if seen is None or seen[0] != rec.get("seq"):
                    self._seen[name] = (rec.get("seq"), now)
        for name in list(self._seen):
            if name not in leases:
                del self._seen[name]  # removed at a clean exit: not lost
        if self.local_gone is not None:
            gone.update(self.local_gone())
        self._gone, self._leases, self._claims = gone, leases, claims
        return judge

    def _claimed(self, step: int, dirname: str, missing: List[int]) -> Tuple[List[int], List[int]]:
        """``(missing ranks nobody claimed, local ranks of the holders of the claimed ones)``: a rank whose part
        of ``[step, dirname]`` a replica holder may write is awaited through its holder's node instead."""
        free, holders = [], []
        for r in missing:
            rec = self._claims.get(r)
            if rec is not None and [step, dirname] in [list(p) for p in rec.get("pending", [])]:
                holders += [int(x) for x in rec.get("holder_ranks") or []]
            else:
                free.append(r)
        return free, holders

    def lost(self, rank: int, step: int, dirname: str) -> Optional[str]:
        """Why rank ``rank``'s own node will never write its part of ``[step, dirname]`` (its node's lease is
        stale, or its gone record is final without that save pending), or ``None`` while it still may. The
        replica holder's question before it writes that part itself; always ``None`` once the run's records
        were removed (:attr:`removed`: a later run took over, nothing of this run is to be written)."""
        with self._lock:
            judge = self._refresh()
            if self.removed:  # never re-create what the next run removed: the commit is abandoned (check())
                return None
            rec = self._gone.get(rank)
            if rec is not None and rec.get("final") and [step, dirname] not in [list(p) for p in rec.get("pending", [])]:
                return f"rank {rank}'s node persister will not write it (its gone record is final)"
            if not judge:
                return None
            now = self.clock()
            for name, lease in self._leases.items():
                if rank in (lease.get("ranks") or []) and now - self._seen[name][1] > self.peer_timeout_secs:
                    return (f"the lease of rank {rank}'s node ({lease.get('host')}) is {now - self._seen[name][1]:.1f} s "
                            "old: that node is lost")
            return None

    def _stale(self, needed: List[int], now: float) -> bool:
        return any(now - self._seen[name][1] > self.peer_timeout_secs
                   for name, rec in self._leases.items() if set(needed) & set(rec.get("ranks") or []))

    def check(self, step: int, dirname: str, missing: Iterable[int], persisters_of: Iterable[int] = ()) -> None:
        """Raise if a part of save ``(step, dirname)`` can never come.

        Args:
            missing: ranks whose part of the save has not arrived.
            persisters_of: ranks whose node's persister must stay alive for the save to finish although
                their part is not awaited (a watcher passes rank 0: the committer).

        Raises:
            PeerLostError: a rank in ``missing`` is gone and its persister will not write that part, or
                the lease of a node serving a rank in ``missing`` or ``persisters_of`` is stale (names
                the step, the ranks, the pid and host), or the run's record directory was removed (:attr:`removed`).
        """
        missing, persisters_of = sorted(set(missing)), sorted(set(persisters_of))
        if not missing and not persisters_of:
            return
        with self._lock:
            judge = self._refresh()
            if self.removed:
                raise PeerLostError(
                    f"step {step}: the peer records of run {self.run_id} ({self.dir}) were removed while its save "
                    f"of {dirname} was pending: a later run of this job has started in this checkpoint directory "
                    "and its committer removed what this run left in flight (this save's partial directory "
                    "included), or this run's committer ended (its persister removes them at a clean exit); "
                    f"either way nothing this commit awaits can come: the commit of step {step} is abandoned, "
                    "the committed checkpoints and the tracker are untouched")
            now = self.clock()
            missing, holders = self._claimed(step, dirname, missing)
            needed = sorted(set(missing) | set(persisters_of) | set(holders))
            for r in missing:
                rec = self._gone.get(r)
                if rec is None:
                    continue
                if [step, dirname] in [list(p) for p in rec.get("pending", [])]:
                    continue  # its persister writes that part from memory (or fails it with a marker)
                raise PeerLostError(
                    f"step {step}: rank {r} (pid {rec.get('pid')} on host {rec.get('host')}) died before handing "
                    f"over its part of {dirname} (its process left its node's persister without close()); "
                    f"the commit of step {step} is abandoned: the previous checkpoint and the tracker are "
                    "untouched. Restart the job (it resumes from the newest complete checkpoint or memory "
                    "snapshot); see the log of the dead rank for why it died")
            if not judge:
                return
            if self._stale(needed, now):
                judge = self._refresh(force=True)  # judge on what the files say now, not on a cached read
                now = self.clock()
                if not judge:
                    return
                missing, holders = self._claimed(step, dirname, missing)
                needed = sorted(set(missing) | set(persisters_of) | set(holders))
            for name, rec in sorted(self._leases.items()):
                ranks = rec.get("ranks") or []
                hit = sorted(set(needed) & set(ranks))
                if not hit:
                    continue
                age = now - self._seen[name][1]
                if age > self.peer_timeout_secs:
                    waited = [r for r in hit if r in missing]
                    what = (f"ranks {waited} can never deliver their part" if waited
                            else f"the committer (rank {hit[0]}'s persister) can never finish the commit")
                    raise PeerLostError(
                        f"step {step}: the node persister of ranks {ranks} (pid {rec.get('pid')} on host "
                        f"{rec.get('host')}) has not renewed its lease for {age:.1f} s (peer_timeout_secs="
                        f"{self.peer_timeout_secs:g}): that node is lost or its persister died; {what}; the "
                        f"commit of step {step} is abandoned: the previous checkpoint and the tracker are "
                        "untouched. Restart the job on healthy nodes (a persister that is alive but stalls "
                        "for longer, e.g. on a hung filesystem, needs a larger peer_timeout_secs / "
                        "SNAPCKPT_PEER_TIMEOUT_SECS)")
