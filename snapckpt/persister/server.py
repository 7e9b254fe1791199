"""The node persister: one OS process per node and job, shared by every local rank.

It owns the arena (:class:`~snapckpt.persister.arena.SlotFiles`) and every slot's state, answers the control
requests of :mod:`snapckpt.persister.protocol`, writes parts on a thread pool, commits on the committer
node, and outlives the training processes:

- a client that disconnects without ``bye`` crashed: the slot it was writing becomes INVALID (case C8);
  once no rank of that run is connected, the newest step held in memory by every local rank is written
  to disk and committed if it is newer than the last commit (``flush_on_crash``, case B8);
- restarted ranks of the same job find this process through the socket in the job's runtime directory
  and read the READY slots (memory-tier restore);
- it exits when every client closed cleanly and no work is pending, or after ``idle_timeout_secs``
  without a client; the arena files, socket and token are removed on exit.

Startup: ``python -m snapckpt.persister --runtime-dir D --arena-dir A --job KEY --idle-timeout-secs S``.
The process holds an exclusive ``flock`` on ``D/persister.pid`` while alive, writes the secret
``D/token`` (0600) that clients must present, then listens on ``D/persister.sock`` (0600, in a 0700
directory); connections from another uid are refused (``SO_PEERCRED``); a connection must present the token
in a ``hello`` within ``HELLO_TIMEOUT_SECS`` and gets one refusal if it sends anything else first.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import secrets
import selectors
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from snapckpt.persister.arena import SlotFiles, SlotState, map_slot
from snapckpt.errors import PersisterError, SlotBusyError
from snapckpt.ondisk.manifest import MANIFEST, list_committed, partial_dirname, validate_dirname
from snapckpt.engine.stager import read_index
from snapckpt.storage.factory import open_storage
from snapckpt.persister import protocol as P
from snapckpt.persister.client import lock_file
from snapckpt.persister.commit import CommitRequest, commit, watch_commit
from snapckpt.persister.writer import write_failure_marker, write_part

log = logging.getLogger("snapckpt.persister")

__all__ = ["Server", "main", "HELLO_TIMEOUT_SECS"]

HELLO_TIMEOUT_SECS = 10.0  # a connection that has not authenticated by then is dropped


@dataclass
class Slot:
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
    mapping: Any = None  # the writers' read mapping of the slot file, kept across persists (see _slot_map)


@dataclass
class RankEntry:
    rank: int
    slots: List[Slot]
    conn: Optional[socket.socket] = None
    run_id: str = ""


@dataclass
class Run:
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
    connected: Set[int] = field(default_factory=set)
    crashed: bool = False


@dataclass
class Result:
    state: str = "pending"  # pending | committed | failed
    error: Optional[Dict[str, Any]] = None
    part_errors: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    parts_done: Set[int] = field(default_factory=set)
    rank_seq: Dict[int, int] = field(default_factory=dict)  # slot seq each local rank's part comes from
    writers: int = 0  # this node's writer tasks of the step still running


class _WarningSeen(logging.Handler):
    """Records that the persister logged a warning or an error (which is then kept in ``persister.log``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


class Server:
    """The persister's event loop and state (see the module docstring)."""

    def __init__(self, runtime_dir: str, arena_dir: str, job: str, idle_timeout_secs: float) -> None:
        self.runtime_dir = runtime_dir
        self.job = job
        self.idle_timeout_secs = idle_timeout_secs
        self.arena = SlotFiles(arena_dir)
        self.token = secrets.token_hex(16)
        self.lock = threading.RLock()
        self.ranks: Dict[int, RankEntry] = {}
        self.runs: Dict[str, Run] = {}
        self.results: Dict[Tuple[str, int, str], Result] = {}  # (run, step, dirname)
        self.commits_started: Set[Tuple[str, int, str]] = set()
        self.commit_seq = 0  # order of persist requests, for the tracker gate
        self.tracker_seq: Dict[Tuple[str, str], int] = {}
        self.tracker_lock = threading.Lock()
        self.conn_rank: Dict[socket.socket, int] = {}
        self.buffers: Dict[socket.socket, bytearray] = {}
        self.pending = 0  # writer and commit tasks not finished
        self.crashed_since_empty = False
        self.empty_since: Optional[float] = time.monotonic()
        self.seq = 0
        self.pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapckpt-writer")
        self.commit_pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapckpt-commit")
        # Reserves the pages of a rank's other slots while it trains, so that the first snapshot into
        # each of them does not pay for zeroing fresh shared memory (about 0.3 s per GiB) on the training
        # path.
        self.grow_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-grow")
        self.sel = selectors.DefaultSelector()
        self.stop = False
        self.files_removed = False
        self.keep_log = False  # a crash or a failure happened: leave persister.log for the user
        # any warning (a damaged step replaced, an interrupted re-commit restored...) keeps the log too
        self._warned = _WarningSeen()
        logging.getLogger("snapckpt").addHandler(self._warned)
        self.conn_pid: Dict[socket.socket, int] = {}
        self.conn_since: Dict[socket.socket, float] = {}  # accept time of connections not yet authenticated
        self.sock_path = os.path.join(runtime_dir, "persister.sock")

    # ----------------------------------------------------------------------------------- lifecycle
    def serve(self) -> None:
        """Bind, serve until the job is over, clean up."""
        token_path = os.path.join(self.runtime_dir, "token")
        fd = os.open(token_path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, self.token.encode())
        os.close(fd)
        os.replace(token_path + ".tmp", token_path)
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600 (owner-only, as the token)
        try:
            listener.bind(self.sock_path)
        finally:
            os.umask(old)
        listener.listen(256)
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)
        log.info("persister pid %d serving job %s at %s", os.getpid(), self.job, self.sock_path)
        try:
            while not self.stop:
                for key, _ in self.sel.select(timeout=0.2):
                    if key.data is None:
                        self._accept(listener)
                    else:
                        self._readable(key.fileobj)
                self._drop_silent_connections()
                if self._should_exit(listener):
                    break
        finally:
            self.pool.shutdown(wait=True)
            self.commit_pool.shutdown(wait=True)
            self.grow_pool.shutdown(wait=True)
            for s in list(self.conn_rank) + [c for c in self.buffers if c not in self.conn_rank]:
                try:
                    s.close()
                except OSError:
                    pass
            self._remove_files()
            log.info("persister pid %d exiting", os.getpid())

    def _remove_files(self) -> None:
        """Delete the socket, the token and the arena (once); after a clean life, the whole runtime
        directory too (its lock files included: lockers re-check the inode they locked, see
        :func:`snapckpt.persister.client.lock_file`), so nothing of the job outlives it."""
        if self.files_removed:
            return
        self.files_removed = True
        self.keep_log = self.keep_log or self._warned.seen
        # the pid file goes in every case: once this process is gone its pid may be reused, and the README
        # tells users to kill the pid it names
        names = ["persister.sock", "token", "persister.pid"]
        if not self.keep_log:
            names += ["persister.log", "spawn.lock"]
        for name in names:
            try:
                os.unlink(os.path.join(self.runtime_dir, name))
            except FileNotFoundError:
                pass
        if not self.keep_log:
            try:
                os.rmdir(self.runtime_dir)
            except OSError:
                pass
        self.arena.remove_all()

    def _should_exit(self, listener: socket.socket) -> bool:
        with self.lock:
            if self.buffers or self.pending:
                return False
            if self.empty_since is None:
                self.empty_since = time.monotonic()
            idle = time.monotonic() - self.empty_since
            if self.crashed_since_empty and idle < self.idle_timeout_secs and not self.stop:
                return False
            if not self.crashed_since_empty and not self.runs and idle < self.idle_timeout_secs:
                return False  # nobody ever came yet
        # Take the clients' spawn lock so no client is between "found the socket" and "connected".
        lock_fd = lock_file(os.path.join(self.runtime_dir, "spawn.lock"), time.monotonic() + 3600.0,
                            "a client starting up")
        try:
            ready = selectors.DefaultSelector()
            ready.register(listener, selectors.EVENT_READ)
            if ready.select(timeout=0):
                return False  # a client is knocking: keep serving
            self.sel.unregister(listener)
            listener.close()
            self._remove_files()
            return True
        finally:
            os.close(lock_fd)

    # --------------------------------------------------------------------------------- connections
    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            log.warning("refused a connection from uid %d", uid)
            conn.close()
            return
        conn.setblocking(True)
        with self.lock:
            self.buffers[conn] = bytearray()
            self.conn_pid[conn] = pid
            self.conn_since[conn] = time.monotonic()
            self.empty_since = None
        self.sel.register(conn, selectors.EVENT_READ, "client")

    def _drop_silent_connections(self) -> None:
        """Disconnect connections that said no valid ``hello`` within :data:`HELLO_TIMEOUT_SECS` (a real
        client says it right after connecting): a stray connection must not keep the persister alive."""
        now = time.monotonic()
        with self.lock:
            silent = [c for c, t in self.conn_since.items() if c not in self.conn_rank and now - t > HELLO_TIMEOUT_SECS]
        for conn in silent:
            log.warning("dropped a connection (pid %s) that sent no valid hello within %g s", self.conn_pid.get(conn),
                        HELLO_TIMEOUT_SECS)
            self._disconnect(conn, clean=True)

    def _readable(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 16)
        except (ConnectionResetError, OSError):
            data = b""
        if not data:
            self._disconnect(conn, clean=False)
            return
        buf = self.buffers[conn]
        buf += data
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            bye = self._handle_line(conn, line)
            if bye:
                self._disconnect(conn, clean=True)
                return
        if len(buf) > P.MAX_MESSAGE_NBYTES:
            self._disconnect(conn, clean=False)

    def _send(self, conn: socket.socket, msg: Dict[str, Any]) -> None:
        try:
            conn.sendall(P.encode(msg))
        except OSError:
            pass

    def _handle_line(self, conn: socket.socket, line: bytes) -> bool:
        """Answer one request line; return whether to close the connection (``bye``, or any failed request
        of a connection that has not said a valid ``hello`` yet: an intruder gets one error, not a stream
        of them that it might never read)."""
        rank = self.conn_rank.get(conn)
        try:
            msg = P.decode(line)
            op = P.validate_request(msg)
            if op != "hello" and rank is None:
                raise P.ProtocolError("the first request must be hello")
            if op == "bye":
                self._send(conn, P.ok())
                return True
            handler = getattr(self, f"_op_{op}")
            with self.lock:
                reply = handler(conn, rank, msg) if op == "hello" else handler(self.ranks[rank], msg)
        except Exception as e:  # every error goes back to the client, the loop goes on
            if not isinstance(e, (P.ProtocolError, PersisterError, SlotBusyError, OSError, ValueError)):
                log.exception("error handling a request")
            reply = P.fail(e)
        self._send(conn, reply)
        if not reply["ok"] and self.conn_rank.get(conn) is None:
            log.warning("refused a client (pid %s) before a valid hello: %s", self.conn_pid.get(conn),
                        reply["error"]["message"][:200])
            return True
        return False

    def _disconnect(self, conn: socket.socket, clean: bool) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        with self.lock:
            self.buffers.pop(conn, None)
            self.conn_pid.pop(conn, None)
            self.conn_since.pop(conn, None)
            rank = self.conn_rank.pop(conn, None)
            if rank is not None:
                entry = self.ranks[rank]
                entry.conn = None
                run = self.runs.get(entry.run_id)
                for s in entry.slots:
                    if s.state == SlotState.WRITING:
                        log.warning("rank %d left while writing step %d into slot %d: slot marked INVALID",
                                    rank, s.step, s.index)
                        s.state = SlotState.INVALID
                if run is not None:
                    run.connected.discard(rank)
                    if not clean:
                        run.crashed = True
                        self.crashed_since_empty = True
                        self.keep_log = True
                        log.warning("rank %d (run %s) disconnected without close()", rank, run.run_id)
                    if not run.connected and run.crashed and run.flush_on_crash:
                        self._flush(run)
            if not self.buffers:
                self.empty_since = time.monotonic()

    # ---------------------------------------------------------------------------------- operations
    def _op_hello(self, conn: socket.socket, _rank: Optional[int], msg: Dict[str, Any]) -> Dict[str, Any]:
        if not secrets.compare_digest(msg["token"], self.token) or msg["job"] != self.job:
            raise PersisterError("authentication failed: wrong job or token")
        rank, world = msg["rank"], msg["world_size"]
        if not (0 <= rank < world):
            raise P.ProtocolError(f"rank {rank} outside world size {world}")
        entry = self.ranks.get(rank)
        if entry is not None and entry.conn is not None and self.conn_pid.get(entry.conn) == self.conn_pid.get(conn):
            # The same process reconnects (it gave up on a request that timed out): its old stream is
            # abandoned; a slot it was writing through it is not trusted.
            log.warning("rank %d reconnected from pid %s; dropping its previous connection", rank,
                        self.conn_pid.get(conn))
            self._disconnect(entry.conn, clean=True)
        if entry is not None and entry.conn is not None:
            raise PersisterError(
                f"rank {rank} of this job is already connected (run {entry.run_id}). Under torchrun or "
                "another launcher, call torch.distributed.init_process_group() before creating the "
                "Checkpointer, so that each process knows its rank; if another job writes to the same "
                "checkpoint_dir, give each job its own checkpoint_dir")
        run = self.runs.get(msg["run_id"])
        if run is None:
            run = Run(msg["run_id"], world, list(msg["local_ranks"]), False, msg["checkpoint_dir"],
                      None if msg["keep_last"] < 0 else msg["keep_last"], float(msg["commit_timeout_secs"]),
                      msg["flush_on_crash"], msg["fsync"], msg["dir_id"])
            self.runs[run.run_id] = run
            log.info("job %s run %s: checkpoint directory %s (world size %d, local ranks %s)", self.job,
                     run.run_id, run.checkpoint_dir, world, run.local_ranks)
        if msg["committer"]:
            run.committer = True
            self._clean_stale_partials(run)
        run.connected.add(rank)
        if entry is None:
            entry = RankEntry(rank, [Slot(i, self.arena.path(rank, i)) for i in range(msg["slots_per_rank"])])
            self.ranks[rank] = entry
        while len(entry.slots) < msg["slots_per_rank"]:
            entry.slots.append(Slot(len(entry.slots), self.arena.path(rank, len(entry.slots))))
        entry.conn = conn
        entry.run_id = run.run_id
        self.conn_rank[conn] = rank
        self.crashed_since_empty = False
        return P.ok(persister_pid=os.getpid(), slots=[self._slot_info(s) for s in entry.slots])

    def _slot_info(self, s: Slot) -> Dict[str, Any]:
        return {"slot": s.index, "path": s.path, "nbytes": s.nbytes, "state": s.state.value, "step": s.step,
                "index_offset": s.index_offset, "index_nbytes": s.index_nbytes, "run_id": s.run_id,
                "seq": s.seq, "world_size": self.runs[s.run_id].world_size if s.run_id in self.runs else -1,
                "dir_id": self.runs[s.run_id].dir_id if s.run_id in self.runs else ""}

    def _op_ping(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        return P.ok(persister_pid=os.getpid())

    def _op_acquire(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        ready = [s for s in entry.slots if s.state == SlotState.READY]
        newest = max(ready, key=lambda s: s.seq) if ready else None
        free = [s for s in entry.slots if s.state in (SlotState.FREE, SlotState.INVALID)]
        reusable = sorted((s for s in ready if s is not newest), key=lambda s: s.seq)
        candidates = free + reusable
        if not candidates:
            held = ", ".join(f"slot {s.index}: {s.state.value}({s.step})" for s in entry.slots)
            return P.ok(busy=True, detail=held)
        slot = candidates[0]
        self._grown(slot)
        reserve = sum(max(0, msg["nbytes"] - s.nbytes) for s in entry.slots if s is not slot)
        slot.nbytes = self.arena.ensure_size(entry.rank, slot.index, msg["nbytes"], slot.nbytes, reserve)
        slot.state, slot.step, slot.run_id = SlotState.WRITING, msg["step"], entry.run_id
        for other in entry.slots:  # reserve the other slots' pages now, off the training path
            if (other is not slot and other.growing is None and other.nbytes < msg["nbytes"]
                    and other.state in (SlotState.FREE, SlotState.INVALID)):
                other.growing = self.grow_pool.submit(self.arena.ensure_size, entry.rank, other.index,
                                                      msg["nbytes"], other.nbytes)
        return P.ok(busy=False, **self._slot_info(slot))

    def _grown(self, slot: Slot) -> None:
        """Wait for a background growth of ``slot`` and take its size (called with the lock; the growth
        never takes it). A growth that failed is dropped: the caller's own ``ensure_size`` retries it and
        raises with the rank's full capacity need."""
        if slot.growing is None:
            return
        try:
            slot.nbytes = max(slot.nbytes, slot.growing.result())
        except Exception as e:
            log.info("slot %d: reserving its pages in the background failed: %s", slot.index, e)
        slot.growing = None

    def _slot(self, entry: RankEntry, index: int) -> Slot:
        if not (0 <= index < len(entry.slots)):
            raise P.ProtocolError(f"no slot {index} for rank {entry.rank}")
        return entry.slots[index]

    def _op_ready(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        s = self._slot(entry, msg["slot"])
        if s.state != SlotState.WRITING or s.step != msg["step"]:
            raise PersisterError(f"slot {s.index} of rank {entry.rank} is {s.state.value}({s.step}), "
                                 f"not WRITING({msg['step']})")
        validate_dirname(msg["dirname"])
        if msg["tracker_name"]:
            validate_dirname(msg["tracker_name"])
        self.seq += 1
        s.state, s.seq = SlotState.READY, self.seq
        s.index_offset, s.index_nbytes = msg["index_offset"], msg["index_nbytes"]
        s.dirname, s.tracker_name, s.tracker_content = msg["dirname"], msg["tracker_name"], msg["tracker_content"]
        s.persistable = msg["persistable"]
        if msg["persist"]:  # a DISK save: hand it to the writers in the same round trip
            self._persist(entry, msg["step"], self.runs[entry.run_id])
        return P.ok()

    def _op_abort(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        s = self._slot(entry, msg["slot"])
        if s.state == SlotState.WRITING:
            s.state = SlotState.INVALID
        return P.ok()

    def _op_fail(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        """A rank's DISK save of ``(step, dirname)`` failed before it reached the persister (a preflight such
        as the free-space check): record it and drop a failure marker, so that the commit fails at once on
        every node with the cause instead of waiting for this rank's part until the timeout."""
        run = self.runs[entry.run_id]
        step, dirname = msg["step"], validate_dirname(msg["dirname"])
        key = (run.run_id, step, dirname)
        rec = {"type": msg["type"], "message": msg["message"]}
        with self.lock:
            res = self.results.setdefault(key, Result())
            res.part_errors[entry.rank] = rec
        if run.world_size == 1:
            return P.ok()  # nobody else waits for this save
        if len(run.local_ranks) < run.world_size:  # ranks on other nodes learn it from a failure marker
            partial = os.path.join(run.checkpoint_dir, partial_dirname(dirname, run.run_id))
            write_failure_marker(open_storage(fsync=run.fsync), partial, rank=entry.rank, run_id=run.run_id,
                                 step=step, exc=P.error_from_record(rec))
        if key not in self.commits_started:
            self.commits_started.add(key)
            req = CommitRequest(checkpoint_dir=run.checkpoint_dir, dirname=dirname, step=step, run_id=run.run_id,
                                world_size=run.world_size, timeout_secs=run.commit_timeout_secs,
                                keep_last=run.keep_last, tracker_name="", tracker_content="",
                                local_failure=self._local_failure(key))
            self.pending += 1
            self.commit_pool.submit(self._commit_task, req, run)
        return P.ok()

    def _op_persist(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        self._persist(entry, msg["step"], self.runs[entry.run_id])
        return P.ok()

    def _op_status(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        res = self.results.get((entry.run_id, msg["step"], msg["dirname"]))
        if res is None:
            held = any(s.step == msg["step"] and s.state in (SlotState.READY, SlotState.PERSISTING)
                       for s in entry.slots)
            return P.ok(state="held" if held else "unknown")
        if entry.rank in res.part_errors:
            return P.ok(state="failed", error=res.part_errors[entry.rank], where="part")
        return P.ok(state=res.state, error=res.error, where="commit")

    def _op_held(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        held = [self._slot_info(s) for s in entry.slots
                if s.state in (SlotState.READY, SlotState.PERSISTING)]
        return P.ok(slots=held)

    # ------------------------------------------------------------------------------ persist/commit
    def _persist(self, entry: RankEntry, step: int, run: Run) -> None:
        cands = [s for s in entry.slots if s.step == step and s.state in (SlotState.READY, SlotState.PERSISTING)]
        if not cands:
            raise PersisterError(f"rank {entry.rank} holds no snapshot of step {step} to persist")
        s = max(cands, key=lambda x: x.seq)
        key = (run.run_id, step, s.dirname)
        res = self.results.get(key)
        if res is not None and res.rank_seq.get(entry.rank, s.seq) != s.seq:
            # this rank saved the same step under the same directory again
            if res.state == "pending":
                raise PersisterError(
                    f"step {step} ({s.dirname}) of rank {entry.rank} is still being persisted; a second save of "
                    "the same step to the same directory must wait for the first (Checkpointer.wait())")
            self.results.pop(key)  # the earlier save ended: this one is a new save that replaces it
            self.commits_started.discard(key)
            res = None
        if res is None:
            res = self.results.setdefault(key, Result())
        if s.state == SlotState.PERSISTING or entry.rank in res.parts_done:
            return
        res.rank_seq[entry.rank] = s.seq
        s.state = SlotState.PERSISTING
        res.writers += 1
        self.pending += 1
        self.pool.submit(self._write_part_task, entry.rank, s, run, step)
        if key not in self.commits_started:
            self.commits_started.add(key)
            self.commit_seq += 1
            req = CommitRequest(checkpoint_dir=run.checkpoint_dir, dirname=s.dirname, step=step,
                                run_id=run.run_id, world_size=run.world_size,
                                timeout_secs=run.commit_timeout_secs, keep_last=run.keep_last,
                                tracker_name=s.tracker_name, tracker_content=s.tracker_content,
                                tracker_gate=self._tracker_gate(run.checkpoint_dir, s.tracker_name,
                                                                self.commit_seq),
                                local_failure=self._local_failure(key))
            self.pending += 1
            self.commit_pool.submit(self._commit_task, req, run)

    def _local_failure(self, key):
        """For the commit of ``key``: the error of a local rank whose part of that save failed, if any."""

        def failure() -> Optional[BaseException]:
            with self.lock:
                res = self.results.get(key)
                if res is None or not res.part_errors:
                    return None
                rank, rec = sorted(res.part_errors.items())[0]
            exc = P.error_from_record(rec)
            exc.snapckpt_rank = rank  # read by the commit's message
            return exc

        return failure

    def _tracker_gate(self, checkpoint_dir: str, tracker_name: str, seq: int):
        """A gate that lets the commit of request ``seq`` write its tracker only if no later request of the
        same tracker file has written it already (commits run in parallel and may finish out of order)."""
        key = (checkpoint_dir, tracker_name)

        def gate(write) -> None:
            with self.tracker_lock:
                if self.tracker_seq.get(key, 0) > seq:
                    log.info("%s not moved back to an older save (request %d)", tracker_name, seq)
                    return
                write()
                self.tracker_seq[key] = seq

        return gate

    def _write_part_task(self, rank: int, s: Slot, run: Run, step: int) -> None:
        storage = open_storage(fsync=run.fsync, part=(rank, step))
        # once on_data_read released the slot, the rank may fill it with a newer snapshot: never read the
        # slot's fields after that (they describe the new one)
        key, seq = (run.run_id, step, s.dirname), s.seq
        partial = os.path.join(run.checkpoint_dir, partial_dirname(s.dirname, run.run_id))
        log.debug("rank %d step %d: writing the part", rank, step)
        try:
            buf = self._slot_map(s)
            try:
                index = read_index(buf, s.path)
                if index["step"] != step:
                    raise PersisterError(f"slot {s.index} of rank {rank} holds step {index['step']}, not {step}")
                t0 = time.monotonic()
                files = write_part(storage, buf, index, partial, rank=rank, run_id=run.run_id, step=step,
                                   on_data_read=lambda: self._release(s))
                log.info("rank %d step %d: part written, %d bytes in %.3f s", rank, step,
                         sum(f["nbytes"] for f in files.values()), time.monotonic() - t0)
            finally:
                del buf
            with self.lock:
                self.results[key].parts_done.add(rank)
        except BaseException as e:
            log.error("rank %d step %d: writing the part failed: %s", rank, step, e)
            self.keep_log = True
            with self.lock:  # recorded before the marker: the commit it ends must not win the race to the trainer
                self.results[key].part_errors[rank] = P.error_record(e)
            write_failure_marker(storage, partial, rank=rank, run_id=run.run_id, step=step, exc=e)
        finally:
            with self.lock:
                if s.state == SlotState.PERSISTING and s.seq == seq:
                    s.state = SlotState.READY
                res = self.results.get(key)
                if res is not None:
                    res.writers -= 1
                    self._remove_failed_partial(run, res, partial)
                self.pending -= 1

    @staticmethod
    def _slot_map(s: Slot):
        """The writers' mapping of slot ``s``, made once per slot size and kept: mapping it afresh for every
        persist costs a page fault per 4 KiB page read (about 0.3-0.7 s per GiB on this VM). Only the writer
        of ``s`` calls this (one at a time: the slot is PERSISTING)."""
        if s.mapping is None or len(s.mapping) != s.nbytes:
            if s.mapping is not None:
                try:
                    s.mapping.close()
                except BufferError:  # a view is still alive; it goes with its last reference
                    pass
            s.mapping = map_slot(s.path, s.nbytes)
        return s.mapping

    def _release(self, s: Slot) -> None:
        """The persister is done reading slot ``s``: PERSISTING -> READY."""
        with self.lock:
            if s.state == SlotState.PERSISTING:
                s.state = SlotState.READY

    def _commit_task(self, req: CommitRequest, run: Run) -> None:
        storage = open_storage(fsync=run.fsync, part=(None, req.step))
        retired: List[str] = []
        try:
            if run.committer:
                commit(storage, storage, req, remove_partial_on_failure=False, defer_deletion=retired)
            else:
                watch_commit(storage, req)
            state, err = "committed", None
        except BaseException as e:
            log.error("step %d: commit failed: %s", req.step, e)
            self.keep_log = True
            state, err = "failed", P.error_record(e)
        with self.lock:
            res = self.results[(req.run_id, req.step, req.dirname)]
            res.state, res.error = state, err
            self._remove_failed_partial(run, res, req.partial_dir)
        for path in retired:  # after the commit is reported: deleting GiBs takes a while
            try:
                storage.remove_tree(path)
            except OSError as e:
                log.warning("retention: could not delete %s: %s", path, e)
        with self.lock:
            self.pending -= 1

    def _remove_failed_partial(self, run: Run, res: Result, partial: str) -> None:
        """On the committer, once a step's commit failed and this node's writers of it are done, delete
        its partial directory (called with the lock)."""
        if not run.committer or res.state != "failed" or res.writers > 0:
            return
        try:
            open_storage().remove_tree(partial)
        except OSError as e:
            log.warning("could not remove %s after a failed commit: %s", partial, e)

    def _flush(self, run: Run) -> None:
        """Write the newest step held by every local rank of a crashed run (called with the lock)."""
        steps: Optional[Set[int]] = None
        for r in run.local_ranks:
            entry = self.ranks.get(r)
            held = {s.step for s in entry.slots if s.state in (SlotState.READY, SlotState.PERSISTING)
                    and s.run_id == run.run_id and s.persistable} if entry else set()
            steps = held if steps is None else steps & held
        if not steps:
            log.info("run %s crashed; no step is held by every local rank, nothing to flush", run.run_id)
            return
        step = max(steps)
        newest = max((s for s in self.ranks[run.local_ranks[0]].slots if s.step == step and s.persistable
                      and s.state in (SlotState.READY, SlotState.PERSISTING)), key=lambda s: s.seq)
        res = self.results.get((run.run_id, step, newest.dirname))
        if res is not None and res.state != "failed":
            return
        storage = open_storage()
        committed = list_committed(storage, run.checkpoint_dir)
        if committed and committed[-1].step >= step:
            return
        log.warning("run %s crashed; flushing step %d from memory to disk", run.run_id, step)
        self.results.pop((run.run_id, step, newest.dirname), None)
        self.commits_started.discard((run.run_id, step, newest.dirname))
        for r in run.local_ranks:
            try:
                self._persist(self.ranks[r], step, run)
            except PersisterError as e:
                log.error("flush of step %d failed for rank %d: %s", step, r, e)

    def _clean_stale_partials(self, run: Run) -> None:
        """Remove partial directories left by earlier runs of this job that this persister does not know
        (crashed runs), and restore interrupted re-commits.

        A commit replacing step directory ``X`` renames ``X`` to ``.X.replaced-R``, then ``.X.partial-R``
        to ``X``; a crash between the two leaves no ``X``, and ``.X.replaced-R`` is the committed
        (intact) checkpoint: it is renamed back to ``X`` and the interrupted ``.X.partial-R`` is removed (a
        warning says so, and keeps ``persister.log``).
        That holds for any job's leftover that has a manifest (a directory moved or copied since has another
        job key). Only one job writes a directory (:mod:`snapckpt.ondisk.dirclaim`); should another job's live
        commit be between its two renames at this very moment (microseconds), its rename fails and its
        commit raises ``CommitError``, its old copy restored: nothing is lost. Other leftovers are removed
        only when their run id starts with this job's key: another job sharing the directory (another ``job_id``) has its own
        persister, and its directories in flight are never touched."""
        storage = open_storage()
        known = set(self.runs)
        names = storage.listdir(run.checkpoint_dir)
        for name in sorted(n for n in names if n.startswith(".") and ".replaced-" in n):
            rid = name.rsplit("-", 1)[-1]
            dirname = name[1:name.rindex(".replaced-")]
            src, final = os.path.join(run.checkpoint_dir, name), os.path.join(run.checkpoint_dir, dirname)
            if rid in known or not dirname or os.path.lexists(final) or not self._restorable(src):
                continue
            storage.rename(src, final)
            storage.fsync_dir(run.checkpoint_dir)
            storage.remove_tree(os.path.join(run.checkpoint_dir, partial_dirname(dirname, rid)))
            log.warning("restored %s from %s: a commit replacing it was interrupted between its two renames "
                        "(the persister died); the interrupted new copy is discarded", final, name)
        for name in storage.listdir(run.checkpoint_dir):
            rid = name.rsplit("-", 1)[-1]
            if (name.startswith(".") and any(k in name for k in (".partial-", ".replaced-", ".deleted-"))
                    and rid not in known and rid.startswith(self.job)):
                storage.remove_tree(os.path.join(run.checkpoint_dir, name))

    @staticmethod
    def _restorable(path: str) -> bool:
        """Whether the moved-aside directory ``path`` is to be renamed back: it holds a manifest (a commit
        record: it was a committed checkpoint)."""
        return os.path.isfile(os.path.join(path, MANIFEST))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m snapckpt.persister``."""
    import argparse

    from snapckpt._internal import env as _env

    p = argparse.ArgumentParser(prog="snapckpt.persister")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--arena-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--idle-timeout-secs", type=float, required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=_env.log_level(),
                        format="%(asctime)s snapckpt-persister[%(process)d] %(levelname)s %(message)s")
    try:  # a previous persister of this job may still be finishing its exit
        pid_fd = lock_file(os.path.join(a.runtime_dir, "persister.pid"), time.monotonic() + 30.0,
                           "another persister of this job")
    except PersisterError as e:
        log.error("%s; exiting", e)
        return 1
    os.ftruncate(pid_fd, 0)
    os.write(pid_fd, str(os.getpid()).encode())
    server = Server(a.runtime_dir, a.arena_dir, a.job, a.idle_timeout_secs)

    def on_term(signum, frame):
        server.stop = True
        server.crashed_since_empty = False

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.serve()
    return 0
