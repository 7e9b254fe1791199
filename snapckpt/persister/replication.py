"""Peer replicas: each node persister keeps a copy of other nodes' newest snapshots (the peer-memory tier).

Data path (over the authenticated TCP channel of :mod:`snapckpt.persister.channel`):

- **Send.** When a local rank's slot becomes READY (:meth:`Replicator.on_ready`, called by the server),
  the snapshot is queued for each target node of its run (the ``replicas`` next nodes in ring order by
  node index, set by the ranks at start: ``replica_peers``). One sender thread per target sends one
  snapshot at a time: the slot is pinned (never handed out for a new snapshot) only while its bytes are
  sent, straight from the slot's mapping. A newer snapshot of the same rank that arrives while a send is
  in flight waits in a one-deep queue; one that replaces a still-queued snapshot makes the replaced one
  *lagging* (never sent). Training never waits for any of it.
- **Receive.** A peer's snapshot is received into ``p<rank>.part`` in this node's arena directory and
  renamed over ``p<rank>`` only once every byte arrived and its XXH3-64 checksum matches: one replica slot
  per peer rank, and a half-received replica never replaces a complete one (while one is received the
  rank briefly holds two).
- **Serve and fetch.** A rank that must load a step its own node does not hold (its node was replaced,
  or it moved to another node) asks its persister to ``fetch`` it: the persister gets the bytes from the
  persister holding them (a replica, or that node's own slot of the rank), checksum verified, into a
  slot of the rank's own arena, which then reads as any memory snapshot.
- **Notes.** ``replicated`` / ``replica_lagging`` notes per run and local rank, drained by the rank's next
  ``acquire`` (the rank turns them into events).

Locking: the server's lock guards the slot table; :attr:`Replicator.lock` guards this module's records.
Methods documented "with the server lock" are called with it held; the threads take it as needed.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import xxhash

from snapckpt._internal import faultpoints
from snapckpt.errors import PersisterError
from snapckpt.persister import channel
from snapckpt.persister.commit_notices import NOTICE_OPS
from snapckpt.persister.arena import map_slot
from snapckpt.persister.slots import HELD, RankEntry, Run, Slot, SlotTable

log = logging.getLogger("snapckpt.persister")

__all__ = ["Replica", "Replicator", "replica_file_name"]

_META = ("step", "run_id", "world_size", "dir_id", "index_offset", "index_nbytes", "dirname", "tracker_name",
         "tracker_content", "persistable")


def replica_file_name(rank: int) -> str:
    """File name of the replica slot of peer ``rank`` in a job's arena directory."""
    return f"p{rank:05d}"


@dataclass
class Replica:
    """A complete replica of peer ``rank``'s snapshot of ``step`` (``nbytes``: used bytes of the slot)."""

    rank: int
    path: str
    nbytes: int
    checksum: str
    meta: Dict[str, Any]


class _Sender(threading.Thread):
    """Sends the queued snapshots of this node's ranks to one target node, one at a time."""

    def __init__(self, owner: "Replicator", run: Run, node: int, addr: str, port: int) -> None:
        super().__init__(name=f"snapckpt-replica-{node}", daemon=True)
        self.owner, self.job_run, self.node, self.addr, self.port = owner, run, node, addr, port
        self.queue: Dict[int, Tuple[Slot, int, int]] = {}  # rank -> (slot, seq, step) waiting to be sent
        self.cv = threading.Condition(owner.lock)
        self.sock: Optional[socket.socket] = None
        self.stopping = False

    def offer(self, rank: int, slot: Slot) -> None:
        """Queue ``slot`` (READY) of ``rank``; a snapshot still queued for that rank is dropped (lagging)."""
        with self.cv:
            old = self.queue.get(rank)
            self.queue[rank] = (slot, slot.seq, slot.step)
            self.cv.notify()
        if old is not None:
            self.owner.note(self.job_run.run_id, rank, "replica_lagging", old[2], f"not replicated to node {self.node}: the previous "
                            f"snapshot's send was still in flight when step {slot.step} came")

    def run(self) -> None:  # noqa: D401 (thread body)
        while True:
            with self.cv:
                while not self.queue and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    break
                rank = min(self.queue)
                slot, seq, step = self.queue.pop(rank)
            try:
                faultpoints.point("replica.before_send", step=step, rank=rank)
                self._send(rank, slot, seq)
            except Exception as e:
                log.warning("replica of rank %d to node %d (%s:%d) failed: %s: %s", rank, self.node, self.addr,
                            self.port, type(e).__name__, e)
                self._close()
        self._close()

    def _close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _send(self, rank: int, slot: Slot, seq: int) -> None:
        owner = self.owner
        with owner.server_lock:
            if slot.state not in HELD or slot.seq != seq:
                return  # reused already: a newer snapshot of the rank is queued or sent
            slot.pins += 1
            meta = owner.slot_meta(slot)
            path, nbytes = slot.path, slot.index_offset + slot.index_nbytes
        t0 = time.monotonic()
        try:
            m = map_slot(path, nbytes)
            try:
                for attempt in (0, 1):  # a kept connection may have been dropped by the peer: once more
                    try:
                        if self.sock is None:
                            self.sock = channel.connect(self.addr, self.port, self.job_run.run_id,
                                                        owner.secrets[self.job_run.run_id])
                        checksum = _put(self.sock, rank, meta, memoryview(m)[:nbytes])
                        break
                    except (channel.AuthError, PersisterError):
                        raise
                    except OSError:
                        self._close()
                        if attempt:
                            raise
            finally:
                m.close()
        finally:
            with owner.server_lock:
                slot.pins -= 1
        secs = time.monotonic() - t0
        log.info("rank %d step %d replicated to node %d (%s:%d): %d bytes in %.3f s (xxh3 %s)", rank,
                 meta["step"], self.node, self.addr, self.port, nbytes, secs, checksum)
        owner.note(self.job_run.run_id, rank, "replicated", meta["step"], f"to node {self.node} in {secs:.3f} s", secs=secs,
                   nbytes=nbytes)


def _put(sock: socket.socket, rank: int, meta: Dict[str, Any], view: memoryview) -> str:
    """Send one snapshot; return its checksum once the peer confirmed it complete.

    Raises:
        PersisterError: the peer refused it (its message); OSError: the channel broke.
    """
    hasher = xxhash.xxh3_64()
    channel.send_frame(sock, {"op": "put", "rank": rank, **meta}, len(view))
    channel.send_payload(sock, view, hasher)
    checksum = hasher.hexdigest()
    channel.send_frame(sock, {"checksum": checksum})
    reply, _ = channel.recv_header(sock)
    if not reply.get("ok"):
        raise PersisterError(f"the peer refused the replica: {reply.get('error')}")
    return checksum


class Replicator:
    """This persister's side of the peer-memory tier (see the module docstring).

    Args:
        arena_dir: the job's arena directory (replica files live beside the slot files).
        slots: the slot table (its slots are pinned while sent; fetched snapshots land in it).
        server_lock: the server's lock.
    """

    def __init__(self, arena_dir: str, slots: SlotTable, server_lock: threading.RLock) -> None:
        self.arena_dir, self.slots, self.server_lock = arena_dir, slots, server_lock
        self.lock = threading.Lock()
        self.replicas: Dict[int, Replica] = {}
        self.secrets: Dict[str, bytes] = {}  # run id -> the run's secret (never written anywhere)
        self.senders: Dict[Tuple[str, int], _Sender] = {}
        self.targets: Dict[str, List[int]] = {}  # run id -> target nodes
        self.notes: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
        self.listener: Optional[socket.socket] = None
        self.stopping = False
        # on_notice(run_id, header): a commit notice from a peer of that run (persister/commit_notices.py)
        self.on_notice: Optional[Callable[[str, Dict[str, Any]], None]] = None

    # ------------------------------------------------------------------------------- configuration
    def listen(self, addr: str) -> int:
        """Listen for peers on ``addr`` (once; later calls return the same port); return the TCP port."""
        with self.lock:
            if self.listener is None:
                sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addr, 0))
                sock.listen(64)
                self.listener = sock
                threading.Thread(target=self._accept_loop, name="snapckpt-replica-accept", daemon=True).start()
                log.info("peer channel listening on %s:%d", addr, sock.getsockname()[1])
            return self.listener.getsockname()[1]

    def configure(self, run: Run, secret: bytes, targets: List[Dict[str, Any]]) -> None:
        """Take ``run``'s secret and its target nodes (``[{"node", "addr", "port"}]``); idempotent: every
        local rank sends the same (called with the server lock)."""
        with self.lock:
            self.secrets[run.run_id] = secret
            if run.run_id in self.targets:
                return
            self.targets[run.run_id] = [t["node"] for t in targets]
            for t in targets:
                s = _Sender(self, run, int(t["node"]), str(t["addr"]), int(t["port"]))
                self.senders[(run.run_id, s.node)] = s
                s.start()
        if targets:
            log.info("run %s: replicating the snapshots of ranks %s to node(s) %s", run.run_id, run.local_ranks,
                     [t["node"] for t in targets])

    def shutdown(self) -> None:
        """Stop the senders and the listener (at exit); replica files go with the arena."""
        self.stopping = True
        with self.lock:
            senders = list(self.senders.values())
            listener, self.listener = self.listener, None
        for s in senders:
            with s.cv:
                s.stopping = True
                s.cv.notify()
        if listener is not None:
            try:
                listener.close()
            except OSError:
                pass
        for s in senders:
            s.join(timeout=5)

    # ---------------------------------------------------------------------------------- the rank side
    def on_ready(self, run: Run, entry: RankEntry, slot: Slot) -> None:
        """A local rank's ``slot`` became READY: queue it for every target node (with the server lock)."""
        for node in self.targets.get(run.run_id, ()):
            sender = self.senders.get((run.run_id, node))
            if sender is not None:
                sender.offer(entry.rank, slot)

    def note(self, run_id: str, rank: int, kind: str, step: int, reason: str, **extra: Any) -> None:
        """Record a ``replicated`` / ``replica_lagging`` note for local ``rank`` of run ``run_id`` (kept until
        that rank's next acquire in that run: a restarted job never reports an earlier run's notes)."""
        with self.lock:
            notes = self.notes.setdefault((run_id, rank), [])
            notes.append({"kind": kind, "step": step, "reason": reason, **extra})
            del notes[:-64]  # a rank that never acquires again must not grow this forever
        if kind == "replica_lagging":
            log.warning("rank %d step %d: %s", rank, step, reason)

    def drain_notes(self, run_id: str, rank: int) -> List[Dict[str, Any]]:
        """The notes of ``rank`` of run ``run_id`` since the last call; an earlier run's notes of any rank
        are dropped (their rank will not acquire in that run again)."""
        with self.lock:
            for key in [k for k in self.notes if k[0] != run_id]:
                del self.notes[key]
            return self.notes.pop((run_id, rank), [])

    def slot_meta(self, s: Slot) -> Dict[str, Any]:
        """What a peer needs to know about slot ``s``'s snapshot (with the server lock)."""
        info = self.slots.info(s)
        return {"step": s.step, "run_id": s.run_id, "world_size": info["world_size"], "dir_id": info["dir_id"],
                "index_offset": s.index_offset, "index_nbytes": s.index_nbytes, "dirname": s.dirname,
                "tracker_name": s.tracker_name, "tracker_content": s.tracker_content, "persistable": s.persistable}

    def holdings(self) -> List[Dict[str, Any]]:
        """Every complete snapshot this persister can serve: its own slots and its replicas, as
        ``{"rank", "step", "run_id", "world_size", "dir_id", "kind": "own"|"replica"}`` (with the server lock)."""
        out = []
        for entry in self.slots.ranks.values():
            for s in entry.slots:
                if s.state in HELD:
                    m = self.slot_meta(s)
                    out.append({"rank": entry.rank, "step": s.step, "run_id": s.run_id,
                                "world_size": m["world_size"], "dir_id": m["dir_id"], "kind": "own"})
        with self.lock:
            for r in self.replicas.values():
                out.append({"rank": r.rank, "step": r.meta["step"], "run_id": r.meta["run_id"],
                            "world_size": r.meta["world_size"], "dir_id": r.meta["dir_id"], "kind": "replica"})
        return out

    def replica_of(self, rank: int, step: int, run_id: str) -> Optional[Replica]:
        """The complete replica of ``rank``'s ``step`` of ``run_id``, or ``None``."""
        with self.lock:
            r = self.replicas.get(rank)
        return r if r is not None and r.meta["step"] == step and r.meta["run_id"] == run_id else None

    def replicas_of_step(self, run_id: str, step: int, dirname: str) -> List[Replica]:
        """The complete replicas of ``step`` saved as ``dirname`` by run ``run_id`` (persistable ones)."""
        with self.lock:
            return [r for r in self.replicas.values() if r.meta["run_id"] == run_id and r.meta["step"] == step
                    and r.meta["dirname"] == dirname and r.meta["persistable"]]

    # ----------------------------------------------------------------------------------------- fetch
    def fetch(self, entry: RankEntry, run: Run, rank: int, step: int, run_id: str, addr: str, port: int) -> Slot:
        """Get ``rank``'s snapshot of ``step`` (run ``run_id``) from the persister at ``addr:port`` into a
        slot of local rank ``entry`` (READY, checksum verified); blocking, off the socket loop.

        Raises:
            PersisterError: no secret for ``run`` (replication is not set up), the peer does not hold it, no
                slot is free, or the bytes do not match their checksum.
            OSError: the peer is unreachable or the channel broke.
        """
        secret = self.secrets.get(run.run_id)
        if secret is None:
            raise PersisterError("this persister has no peer channel for the run: replication is not set up")
        t0 = time.monotonic()
        sock = channel.connect(addr, port, run.run_id, secret)
        try:
            channel.send_frame(sock, {"op": "get", "rank": rank, "step": step, "run_id": run_id})
            header, nbytes = channel.recv_header(sock)
            if not header.get("ok"):
                raise PersisterError(f"peer {addr}:{port} cannot serve rank {rank} step {step}: {header.get('error')}")
            meta = {k: header[k] for k in _META}
            with self.server_lock:
                s = self.slots.acquire(entry, step, nbytes, entry.limit)
                if s is None:
                    raise PersisterError(f"rank {entry.rank} has no free slot to fetch step {step} into "
                                         f"({self.slots.describe(entry)})")
            ok = False
            try:
                m = map_slot(s.path, nbytes)
                try:
                    hasher = xxhash.xxh3_64()
                    channel.recv_payload_into(sock, memoryview(m)[:nbytes], hasher)
                finally:
                    m.close()
                trailer, _ = channel.recv_header(sock)
                if trailer.get("checksum") != hasher.hexdigest():
                    raise PersisterError(f"rank {rank} step {step} fetched from {addr}:{port} fails its checksum "
                                         f"({hasher.hexdigest()} != {trailer.get('checksum')})")
                with self.server_lock:
                    self.slots.ready(entry, s.index, step, index_offset=meta["index_offset"],
                                     index_nbytes=meta["index_nbytes"], dirname=meta["dirname"],
                                     tracker_name=meta["tracker_name"], tracker_content=meta["tracker_content"],
                                     persistable=meta["persistable"])
                    s.run_id = run_id
                    s.origin = {"world_size": meta["world_size"], "dir_id": meta["dir_id"]}
                ok = True
            finally:
                if not ok:
                    with self.server_lock:
                        self.slots.abort(entry, s.index)
        finally:
            sock.close()
        log.info("rank %d step %d fetched from %s:%d (%s): %d bytes in %.3f s, checksum verified", rank, step, addr,
                 port, header.get("kind"), nbytes, time.monotonic() - t0)
        return s

    # ---------------------------------------------------------------------------------- the peer side
    def _accept_loop(self) -> None:
        while not self.stopping:
            listener = self.listener
            if listener is None:
                return
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), name="snapckpt-replica-peer",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            try:
                run_id = channel.server_handshake(conn, self.secrets.get)
            except (channel.ChannelError, OSError) as e:
                log.warning("refused a peer connection from %s: %s", peer, e)
                return
            while not self.stopping:
                try:
                    header, plen = channel.recv_header(conn)
                except (channel.ChannelError, OSError):
                    return  # the peer closed its kept connection
                op = header.get("op")
                if op == "put":
                    self._receive(conn, header, plen)
                elif op == "get":
                    self._serve_get(conn, header)
                elif op in NOTICE_OPS and plen == 0 and self.on_notice is not None:
                    self.on_notice(run_id, header)
                else:
                    log.warning("peer %s (run %s) sent an unknown request %r; closing", peer, run_id, op)
                    return
        except Exception as e:
            log.warning("peer connection from %s ended: %s: %s", peer, type(e).__name__, e)
        finally:
            conn.close()

    def _receive(self, conn: socket.socket, header: Dict[str, Any], nbytes: int) -> None:
        rank = int(header["rank"])
        meta = {k: header[k] for k in _META}
        final = os.path.join(self.arena_dir, replica_file_name(rank))
        part = final + ".part"
        error = None
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        received = False
        try:
            hasher = xxhash.xxh3_64()
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as e:
                error = f"no room for a {nbytes}-byte replica in {self.arena_dir}: {e}"
            if error is None:
                import mmap
                m = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                try:
                    channel.recv_payload_into(conn, memoryview(m)[:nbytes], hasher)
                finally:
                    m.close()
            else:  # drain the payload so the connection stays usable
                scratch = bytearray(min(nbytes, channel.CHUNK_NBYTES) or 1)
                left = nbytes
                while left:
                    k = conn.recv_into(memoryview(scratch)[:min(left, len(scratch))])
                    if k == 0:
                        raise channel.ChannelError("peer closed the connection")
                    left -= k
            received = True
        finally:
            os.close(fd)
            if not received:  # the sender vanished mid-transfer: no half replica stays in shared memory
                os.unlink(part)
                log.warning("replica of rank %d step %d dropped: the sender went away mid-transfer", rank,
                            meta["step"])
        trailer, _ = channel.recv_header(conn)
        checksum = hasher.hexdigest()
        if error is None and trailer.get("checksum") != checksum:
            error = f"checksum mismatch ({checksum} != {trailer.get('checksum')})"
        if error is not None:
            os.unlink(part)
            log.warning("replica of rank %d step %d refused: %s", rank, meta["step"], error)
            channel.send_frame(conn, {"ok": False, "error": error})
            return
        os.replace(part, final)  # only now: a half-received replica never replaces a complete one
        with self.lock:
            self.replicas[rank] = Replica(rank, final, nbytes, checksum, meta)
        log.info("holding a replica of rank %d step %d (%d bytes, run %s)", rank, meta["step"], nbytes,
                 meta["run_id"])
        channel.send_frame(conn, {"ok": True})

    def _serve_get(self, conn: socket.socket, header: Dict[str, Any]) -> None:
        rank, step, run_id = int(header["rank"]), int(header["step"]), str(header["run_id"])
        pinned: Optional[Slot] = None
        with self.server_lock:
            entry = self.slots.ranks.get(rank)
            s = self.slots.newest_held(entry, step) if entry is not None else None
            if s is not None and s.run_id == run_id:
                s.pins += 1
                pinned = s
                meta, path, nbytes, kind = self.slot_meta(s), s.path, s.index_offset + s.index_nbytes, "own"
        try:
            stored = None
            if pinned is None:
                rep = self.replica_of(rank, step, run_id)
                if rep is None:
                    channel.send_frame(conn, {"ok": False, "error": f"no snapshot of rank {rank} step {step} here"})
                    return
                meta, path, nbytes, kind, stored = rep.meta, rep.path, rep.nbytes, "replica", rep.checksum
            m = map_slot(path, max(nbytes, 1))  # a replica renamed over meanwhile stays mapped whole
            try:
                hasher = xxhash.xxh3_64()
                channel.send_frame(conn, {"ok": True, "kind": kind, **meta}, nbytes)
                channel.send_payload(conn, memoryview(m)[:nbytes], hasher)
                # a replica goes out with the checksum taken when it arrived: the fetcher's own hash of what it
                # received then also catches bytes damaged while the replica sat here (no second pass)
                channel.send_frame(conn, {"checksum": stored or hasher.hexdigest()})
                if stored is not None and stored != hasher.hexdigest():
                    log.error("the replica of rank %d step %d in %s no longer matches its checksum (%s != %s): "
                              "served as damaged, the fetch is refused", rank, step, path, hasher.hexdigest(),
                              stored)
            finally:
                m.close()
            log.info("served rank %d step %d (%s, %d bytes) to a peer", rank, step, kind, nbytes)
        finally:
            if pinned is not None:
                with self.server_lock:
                    pinned.pins -= 1


def check_secret(secret_hex: str) -> bytes:
    """The run secret from its hex form (at least 16 bytes).

    Raises:
        PersisterError: not hex, or too short.
    """
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError as e:
        raise PersisterError("the peer channel's secret is not hex") from e
    if len(secret) < 16:
        raise PersisterError("the peer channel's secret is shorter than 16 bytes")
    return secret
