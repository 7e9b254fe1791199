"""The node persister: one OS process per node and job, shared by every local rank.

This module is the process's front: the socket loop, authentication and ``hello``, the dispatch of the
control requests of :mod:`snapckpt.persister.protocol`, disconnects, and the process's life and exit.
The work sits beside it, one job per module: the slot records and their state machine
(:mod:`snapckpt.persister.slots`), persist scheduling on thread pools (:mod:`snapckpt.persister.scheduler`,
over :mod:`~snapckpt.persister.writer` and :mod:`~snapckpt.persister.commit`), and the crash flush
(:mod:`snapckpt.persister.flush`). The process owns the arena (:class:`~snapckpt.persister.arena.SlotFiles`)
and outlives the training processes:

- a client that disconnects without ``bye`` crashed: the slot it was writing becomes INVALID (case C8);
  it is recorded as gone, so that commits waiting for a part it never handed over are abandoned at once,
  on this node and on others; while the job spans several nodes this process also refreshes a liveness
  lease, so that a lost node is detected in seconds (:mod:`snapckpt.persister.peers`);
  once no rank of that run is connected, the newest step held in memory by every local rank is written
  to disk and committed if it is newer than the last commit (``flush_on_crash``, case B8);
- restarted ranks of the same job find this process through the socket in the job's runtime directory
  and read the READY slots (memory-tier restore);
- it exits when every client closed cleanly and no work is pending, or after ``idle_timeout_secs``
  without a client; the arena files, socket and token are removed on exit;
- with peer replicas (a run on several nodes), it sends its ranks' READY snapshots to the persisters of
  the next nodes and holds theirs, over an authenticated TCP channel, and fetches a rank's snapshot from
  a peer on request (:mod:`snapckpt.persister.replication`, requests ``replica_listen``,
  ``replica_peers``, ``holdings``, ``fetch``);
- an operator (``snapckpt ps`` / ``snapckpt stop``, :mod:`snapckpt.persister.control`) may ask, on a
  connection of its own and with the same token, for a description of the job (``info``) or for the
  newest snapshot of each run that is newer than disk to be written and committed, after which the
  process exits whoever is still connected (``stop``).

Startup: ``python -m snapckpt.persister --runtime-dir D --arena-dir A --job KEY --idle-timeout-secs S``.
The process holds an exclusive ``flock`` on ``D/persister.pid`` while alive, writes the secret
``D/token`` (0600) that clients must present, then listens on ``D/persister.sock`` (0600, in a 0700
directory); connections from another uid are refused (``SO_PEERCRED``); a connection must present the token
in a ``hello`` within ``HELLO_TIMEOUT_SECS`` and gets one refusal if it sends anything else first.
"""
from __future__ import annotations

import logging
import os
import secrets
import selectors
import signal
import socket
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union

from snapckpt.errors import CheckpointDirInUseError, PersisterError, SlotBusyError
from snapckpt.ondisk.manifest import validate_dirname
from snapckpt.persister import protocol as P
from snapckpt.persister.arena import SlotFiles, SlotState
from snapckpt.persister.commit import recover_interrupted_commits
from snapckpt.persister.commit_notices import CommitNotices
from snapckpt.persister.control import pid_alive
from snapckpt.persister.flush import flush_crashed_run, flush_newest, unwritten_steps
from snapckpt.persister import peers, remote_only
from snapckpt.persister.replication import Replicator, check_secret
from snapckpt.persister.runtime_files import listen, lock_pid_file, lock_spawn, remove_runtime_files, write_token
from snapckpt.persister.scheduler import Scheduler
from snapckpt.persister.slots import HELD, RankEntry, Run, SlotTable
from snapckpt.storage.factory import open_storage

log = logging.getLogger("snapckpt.persister")

__all__ = ["Server", "main", "HELLO_TIMEOUT_SECS"]

HELLO_TIMEOUT_SECS = 10.0  # a connection that has not authenticated by then is dropped
MAX_AWAIT_SECS = 30.0  # the longest an ``await`` request is held before its answer (seconds)
_NOT_ENDED = ("pending", "held")  # status states an await is held in


class _WarningSeen(logging.Handler):
    """Records that the persister logged a warning or an error (which is then kept in ``persister.log``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


class Server:
    """The persister's event loop and connections (see the module docstring).

    Args:
        runtime_dir: the job's owner-only runtime directory (socket, token, pid file, log).
        arena_dir: the job's arena directory (slot files).
        job: the job key clients must name in their ``hello``.
        idle_timeout_secs: how long to wait for a client before exiting, in seconds.
    """

    def __init__(self, runtime_dir: str, arena_dir: str, job: str, idle_timeout_secs: float) -> None:
        self.runtime_dir = runtime_dir
        self.job = job
        self.idle_timeout_secs = idle_timeout_secs
        self.arena = SlotFiles(arena_dir)
        self.token = secrets.token_hex(16)
        self.lock = threading.RLock()  # one lock over every record: connections, slots, results
        self.slots = SlotTable(self.arena, self.lock)
        self.scheduler = Scheduler(self.slots, self.lock)
        self.replicator = Replicator(arena_dir, self.slots, self.lock)
        # commit notices over the peer channel (commit_notices.py): the commit path never polls across nodes
        self.notices = CommitNotices(self.replicator.secrets.get, self.scheduler.on_notice)
        self.scheduler.notices = self.notices
        self.replicator.on_notice = self.notices.receive
        self.conn_rank: Dict[socket.socket, int] = {}
        self.buffers: Dict[socket.socket, bytearray] = {}
        self.crashed_since_empty = False
        self.empty_since: Optional[float] = time.monotonic()
        self.sel = selectors.DefaultSelector()
        self.stop = False
        self.stop_requested = False  # an operator's stop: exit once the flush it started is done
        self.started_at = time.time()  # wall clock, for the age `snapckpt ps` shows
        self.files_removed = False
        self.keep_log = False  # a crash or a failure happened: leave persister.log for the user
        # any warning (a damaged step replaced, an interrupted re-commit restored...) keeps the log too
        self._warned = _WarningSeen()
        logging.getLogger("snapckpt").addHandler(self._warned)
        self.conn_pid: Dict[socket.socket, int] = {}
        self.conn_since: Dict[socket.socket, float] = {}  # accept time of connections not yet authenticated
        # pid -> (run id, rank) of a rank that gave up a timed-out request and has not reconnected yet
        self.abandoned: Dict[int, Tuple[str, int]] = {}
        self.sock_path = os.path.join(runtime_dir, "persister.sock")
        self.host = socket.gethostname()
        self.leases: Dict[str, Run] = {}  # run id -> run whose node lease this persister refreshes
        self.lease_seq = 0
        self.lease_stop = threading.Event()
        # await requests held until their save ends: connection -> (rank, request, monotonic deadline); the
        # commit tasks wake the loop through a socket pair (Scheduler.on_change), so no rank polls status
        self.waiters: Dict[socket.socket, Tuple[int, Dict[str, Any], float]] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.scheduler.on_change = self._poke

    # ----------------------------------------------------------------------------------- lifecycle
    def serve(self, ready_fd: Optional[int] = None) -> None:
        """Bind, serve until the job is over, clean up. ``ready_fd``: a pipe's write end, written to and closed
        once the socket listens (the client that started this process waits on it instead of polling)."""
        write_token(self.runtime_dir, self.token)
        listener = listen(self.sock_path)
        self.sel.register(listener, selectors.EVENT_READ, None)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if ready_fd is not None:
            try:
                os.write(ready_fd, b"1")
                os.close(ready_fd)
            except OSError:  # the client is gone or stopped waiting: it connects through the socket anyway
                pass
        log.info("persister pid %d serving job %s at %s", os.getpid(), self.job, self.sock_path)
        beat = threading.Thread(target=self._beat, name="snapckpt-lease", daemon=True)
        beat.start()
        try:
            while not self.stop:
                woken = False
                for key, _ in self.sel.select(timeout=self._select_timeout()):
                    if key.data is None:
                        self._accept(listener)
                    elif key.data == "wake":
                        self._drain_wakes()
                        woken = True
                    else:
                        self._readable(key.fileobj)
                if self.waiters and (woken or self._select_timeout() == 0.0):  # a save ended, or a wait is over
                    self._answer_waiters()
                self._drop_silent_connections()
                self._reap_abandoned()
                if self._should_exit(listener):
                    if self.stop_requested:
                        log.info("persister pid %d stopping at an operator's request", os.getpid())
                    break
        finally:
            if self.stop:  # SIGTERM: no request is taken from now on, so a part not handed over never comes
                self.scheduler.stop_accepting()
            self.replicator.shutdown()
            self.scheduler.shutdown()  # the lease still beats: other nodes may wait for these commits
            self.notices.shutdown()  # after the commits: their last notices are sent
            self.lease_stop.set()
            beat.join()
            self._end_leases()
            self.slots.shutdown()
            for s in list(self.conn_rank) + [c for c in self.buffers if c not in self.conn_rank]:
                try:
                    s.close()
                except OSError:
                    pass
            self._remove_files()
            for s in (self._wake_r, self._wake_w):
                s.close()
            log.info("persister pid %d exiting", os.getpid())

    # ------------------------------------------------------------------------ liveness (peers.py)
    def _beat(self) -> None:
        """Refresh this node's lease of every multi-node run it serves, every :data:`peers.LEASE_SECS`
        (a thread: the socket loop may be busy; writers and commits run on their own pools)."""
        while not self.lease_stop.wait(peers.LEASE_SECS):
            with self.lock:
                runs = list(self.leases.values())
            for run in runs:
                self._write_lease(run, create=False)

    def _write_lease(self, run: Run, create: bool) -> None:
        """Write this node's lease of ``run`` once (``create``: the run's first, at its first ``hello``, so
        that a node lost within its first second is still seen; the directory is made then)."""
        with self.lock:
            self.lease_seq += 1
            seq = self.lease_seq
        try:
            peers.write_lease(open_storage(fsync=False), run.checkpoint_dir, run.run_id, run.local_ranks, seq,
                              create=create)  # liveness, not durability: no fsync
        except FileNotFoundError:  # its directory was removed: that run is over
            with self.lock:
                self.leases.pop(run.run_id, None)
        except OSError as e:
            log.warning("could not refresh the node lease of run %s: %s", run.run_id, e)

    def _end_leases(self) -> None:
        """At exit: remove this node's leases (a clean exit is not a lost node); the committer's persister
        also removes the peer directory of each run that ended without a dead rank."""
        with self.lock:
            runs = list(self.slots.runs.values())
        for run in runs:
            if not run.multi_node:
                continue  # a one-node run wrote no peer records
            peers.remove_lease(run.checkpoint_dir, run.run_id, run.local_ranks)
            if run.committer and not run.crashed:
                try:
                    open_storage().remove_tree(peers.peers_dir(run.checkpoint_dir, run.run_id))
                except OSError as e:
                    log.warning("could not remove the peer records of run %s: %s", run.run_id, e)

    def _record_gone(self, run: Run) -> None:
        """(Re)write the gone records of ``run``'s dead local ranks (called with the lock): the saves each
        one's part will still be written for (accepted by the writers; until the node's last rank has
        left and the crash flush has decided, also the snapshots it holds in memory, which that flush
        may write). Files only for a multi-node run; a one-node committer reads ``run.gone``."""
        final = not run.connected
        storage = open_storage(fsync=False)
        for rank, info in run.gone.items():
            pending = self.scheduler.pending_parts(run, rank)
            entry = self.slots.ranks.get(rank)
            if not final and run.flush_on_crash and entry is not None:
                pending |= {(s.step, s.dirname) for s in entry.slots
                            if s.state in HELD and s.run_id == run.run_id and s.persistable}
            rec = peers.gone_record(rank=rank, run_id=run.run_id, pid=info["pid"], host=self.host,
                                    since_unix=info["since_unix"], pending=pending, final=final)
            run.gone[rank] = rec
            if run.multi_node:
                peers.write_gone(storage, run.checkpoint_dir, rec)

    def _remove_files(self) -> None:
        """Delete the socket, the token and the arena (once); after a clean life, the whole runtime
        directory too (see :func:`snapckpt.persister.runtime_files.remove_runtime_files`), so nothing of
        the job outlives it."""
        if self.files_removed:
            return
        self.files_removed = True
        # a background slot growth still running would recreate its slot file (O_CREAT) after the arena's removal
        self.slots.shutdown()
        self.keep_log = self.keep_log or self.scheduler.failed or self._warned.seen
        remove_runtime_files(self.runtime_dir, self.keep_log)
        self.arena.remove_all()

    def _should_exit(self, listener: socket.socket) -> bool:
        with self.lock:
            if self.scheduler.pending or (self.buffers and not self.stop_requested):
                return False
            if self.empty_since is None:
                self.empty_since = time.monotonic()
            idle = time.monotonic() - self.empty_since
            waiting = not self.stop and not self.stop_requested
            if self.crashed_since_empty and idle < self.idle_timeout_secs and waiting:
                return False
            if not self.crashed_since_empty and not self.slots.runs and idle < self.idle_timeout_secs and waiting:
                return False  # nobody ever came yet
        # Take the clients' spawn lock so no client is between "found the socket" and "connected".
        lock_fd = lock_spawn(self.runtime_dir)
        try:
            ready = selectors.DefaultSelector()
            ready.register(listener, selectors.EVENT_READ)
            if ready.select(timeout=0) and not self.stop_requested:
                return False  # a client is knocking: keep serving
            self.sel.unregister(listener)
            listener.close()
            if self.crashed_since_empty:  # no rank came back after a crash: its memory tier ends here
                self._warn_unwritten()
            self._remove_files()
            return True
        finally:
            os.close(lock_fd)

    def _warn_unwritten(self) -> None:
        """At exit: warn about snapshots of crashed runs that only this persister holds (memory-only ones
        the crash flush cannot write, or every one with ``flush_on_crash=False``): a restart from now on
        resumes from disk without them."""
        with self.lock:
            runs = list(self.slots.runs.values())
            lost = {run.run_id: (run, unwritten_steps(run, self.slots)) for run in runs}
        for run, steps in lost.values():
            if steps:
                log.warning("exiting with no rank back after run %s crashed: its memory snapshots of steps %s "
                            "are dropped (no flush wrote them to %s: memory-only records such as Megatron's, or "
                            "flush_on_crash=False); a restart from now on resumes from disk. Raise "
                            "persister_idle_timeout_secs (now %g s) if restarts take longer", run.run_id, steps,
                            run.checkpoint_dir, self.idle_timeout_secs)

    # ------------------------------------------------------------------------------ await (status)
    def _poke(self) -> None:
        """Wake the loop to answer the held ``await`` requests (any thread; never blocks)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # the pair is full (the loop is already woken) or closed (exiting)
            pass

    def _drain_wakes(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _select_timeout(self) -> float:
        """The socket loop's wait: 0.2 s, or less until the first held ``await`` is due."""
        if not self.waiters:
            return 0.2
        due = min(deadline for _, _, deadline in self.waiters.values())
        return min(0.2, max(0.0, due - time.monotonic()))

    def _answer_waiters(self, only: Optional[socket.socket] = None) -> None:
        """Answer the held ``await`` requests whose save is no longer pending or whose wait is over (``only``:
        that connection's, whatever its state: it sent another request)."""
        now = time.monotonic()
        out = []
        with self.lock:
            for conn, (rank, msg, deadline) in list(self.waiters.items()):
                if only is not None and conn is not only:
                    continue
                entry = self.slots.ranks.get(rank)
                try:
                    reply = self._op_status(entry, msg) if entry is not None else P.ok(state="unknown")
                except Exception as e:
                    reply = P.fail(e)
                if only is not None or reply.get("state") not in _NOT_ENDED or now >= deadline:
                    del self.waiters[conn]
                    out.append((conn, reply))
        for conn, reply in out:
            self._send(conn, reply)

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

    def _reap_abandoned(self) -> None:
        """A rank that gave up a timed-out request and then exited without reconnecting (its pid is gone) has
        crashed: it is recorded so, as if its connection had ended without close() (crash flush, gone
        record), instead of its snapshots being dropped at the idle timeout."""
        if not self.abandoned:
            return
        with self.lock:
            for pid, (run_id, rank) in list(self.abandoned.items()):
                run, entry = self.slots.runs.get(run_id), self.slots.ranks.get(rank)
                if run is None or rank in run.connected or (entry is not None and entry.conn is not None):
                    del self.abandoned[pid]  # the run is over, or the rank is back
                elif not pid_alive(pid):
                    del self.abandoned[pid]
                    log.warning("rank %d (run %s, pid %s), which gave up a request that timed out, exited "
                                "without reconnecting: taken for a crash", rank, run_id, pid)
                    self._rank_crashed(run, rank, pid)

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
            if bye == "abandoned":
                return
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

    def _handle_line(self, conn: socket.socket, line: bytes) -> Union[bool, str]:
        """Answer one request line; return whether to close the connection (``bye``, or any failed request
        of a connection that has not said a valid ``hello`` yet: an intruder gets one error, not a stream
        of them that it might never read), or ``"abandoned"`` when ``abandon`` already closed it."""
        rank = self.conn_rank.get(conn)
        if conn in self.waiters:  # a new request: its held await is answered first (replies stay in order)
            self._answer_waiters(only=conn)
        try:
            msg = P.decode(line)
            op = P.validate_request(msg)
            if op in P.OPERATOR_OPS:
                if rank is not None:
                    raise P.ProtocolError(f"{op!r} is an operator request: send it on a connection of its own")
                with self.lock:
                    reply = self._operator(op, msg)
                self._send(conn, reply)
                return True  # one request per operator connection
            if op != "hello" and rank is None:
                raise P.ProtocolError("the first request must be hello")
            if op == "bye":
                self._send(conn, P.ok())
                return True
            if op == "abandon":  # no reply: the client has stopped reading
                log.warning("rank %d (pid %s) gave up a request that timed out and closed its connection; "
                            "waiting up to %g s for it to reconnect", rank, self.conn_pid.get(conn),
                            self.idle_timeout_secs)
                self._disconnect(conn, clean=True, abandoned=True)
                return "abandoned"
            if op == "fetch":  # seconds of network I/O: on a thread of its own, it answers when done
                threading.Thread(target=self._fetch, args=(conn, rank, msg), name="snapckpt-fetch",
                                 daemon=True).start()
                return False
            handler = getattr(self, f"_op_{op}")
            with self.lock:
                reply = handler(conn, rank, msg) if op == "hello" else handler(self.slots.ranks[rank], msg)
            if reply is None:  # an await held until its save ends (answered by _answer_waiters)
                self.waiters[conn] = (rank, msg, time.monotonic() + min(msg["wait_secs"], MAX_AWAIT_SECS))
                return False
        except Exception as e:  # every error goes back to the client, the loop goes on
            if not isinstance(e, (P.ProtocolError, PersisterError, SlotBusyError, CheckpointDirInUseError, OSError,
                                  ValueError)):
                log.exception("error handling a request")
            reply = P.fail(e)
        self._send(conn, reply)
        if not reply["ok"] and self.conn_rank.get(conn) is None:
            log.warning("refused a client (pid %s) before a valid hello: %s", self.conn_pid.get(conn),
                        reply["error"]["message"][:200])
            return True
        return False

    def _disconnect(self, conn: socket.socket, clean: bool, abandoned: bool = False) -> None:
        """Forget ``conn``. ``clean``: the rank said ``bye`` (or is replaced by a new connection of its own
        process); otherwise its process is taken for dead (a crash). ``abandoned``: the rank's live process
        gave up the connection after a timeout; not a crash, and not a clean end either: the persister keeps
        its snapshots and waits up to its idle timeout for the rank to reconnect."""
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        self.waiters.pop(conn, None)
        with self.lock:
            self.buffers.pop(conn, None)
            pid = self.conn_pid.pop(conn, None)
            self.conn_since.pop(conn, None)
            rank = self.conn_rank.pop(conn, None)
            if rank is not None:
                self.slots.holds.set(rank, False)
                entry = self.slots.ranks[rank]
                entry.conn = None
                run = self.slots.runs.get(entry.run_id)
                self.slots.drop_writes(entry)
                if run is not None:
                    run.connected.discard(rank)
                    if abandoned:
                        self.crashed_since_empty = True  # keep serving (and the snapshots) for the idle timeout
                        if pid is not None:
                            self.abandoned[pid] = (run.run_id, rank)  # taken for a crash if it exits
                    if not clean:
                        log.warning("rank %d (run %s, pid %s) disconnected without close(): its process is "
                                    "gone; commits waiting for a part it never handed over are abandoned",
                                    rank, run.run_id, pid)
                    if clean:
                        self._after_leave(run)
                    else:
                        self._rank_crashed(run, rank, pid)
            if rank is not None and not self.conn_rank:
                self.empty_since = time.monotonic()

    def _rank_crashed(self, run: Run, rank: int, pid: Optional[int]) -> None:
        """Record that ``rank``'s process of ``run`` died (called with the lock): the run has crashed, the
        rank is gone (commits waiting for a part it never handed over are abandoned)."""
        run.crashed = True
        self.crashed_since_empty = True
        self.keep_log = True
        run.gone[rank] = {"pid": pid, "since_unix": time.time()}
        self._after_leave(run)

    def _after_leave(self, run: Run) -> None:
        """After a rank of ``run`` left (called with the lock): the crash flush once every rank of a crashed
        run has left, then the gone records."""
        if not run.connected and run.crashed and run.flush_on_crash:
            flush_crashed_run(run, self.slots, self.scheduler, self.replicator, self.host)
        if run.gone:  # after the flush: the parts it accepted are still coming
            self._record_gone(run)
            self.scheduler.wake_run(run.run_id)  # this node's commits of the run check their peers at once
        self.scheduler.release_if_over(run)  # its notice links, unless the flush or a commit still needs them

    # ---------------------------------------------------------------------------------- operations
    def _op_hello(self, conn: socket.socket, _rank: Optional[int], msg: Dict[str, Any]) -> Dict[str, Any]:
        if not secrets.compare_digest(msg["token"], self.token) or msg["job"] != self.job:
            raise PersisterError("authentication failed: wrong job or token")
        if self.stop_requested:
            raise PersisterError("this job's persister is stopping (`snapckpt stop` was run for its checkpoint "
                                 "directory); retry once it has exited: the next connection starts a new one")
        rank, world = msg["rank"], msg["world_size"]
        if not (0 <= rank < world):
            raise P.ProtocolError(f"rank {rank} outside world size {world}")
        entry = self.slots.ranks.get(rank)
        if entry is not None and entry.conn is not None and self.conn_pid.get(entry.conn) == self.conn_pid.get(conn):
            # The same process reconnects (it gave up on a request that timed out): its old stream is
            # abandoned; a slot it was writing through it is not trusted.
            log.warning("rank %d reconnected from pid %s; dropping its previous connection", rank,
                        self.conn_pid.get(conn))
            self._disconnect(entry.conn, clean=True)
        if entry is not None and entry.conn is not None:
            # Another live process holds this rank of the same job key: a second job on the same directory
            # (the directory claim of the first save would refuse it later) or ranks that do not know theirs.
            raise CheckpointDirInUseError(
                f"checkpoint_dir {msg['checkpoint_dir']!r} is in use: rank {rank} of another process (pid "
                f"{self.conn_pid.get(entry.conn)}, run {entry.run_id}) is saving into it. If that is another "
                "job, give each job its own checkpoint_dir (a job_id= of its own does not help: the directory "
                "admits one job at a time) or stop the other job first; under torchrun or another "
                "launcher, call torch.distributed.init_process_group() before creating the Checkpointer, so "
                "that each process knows its rank")
        run = self.slots.runs.get(msg["run_id"])
        fresh = run is None
        if run is None:
            # the node of global rank 0 commits, whichever of its ranks reaches it first (after a persister
            # restart, rank 1's save can arrive before rank 0's hello: a watcher would wait for nobody)
            run = Run(msg["run_id"], world, list(msg["local_ranks"]), 0 in msg["local_ranks"], msg["checkpoint_dir"],
                      None if msg["keep_last"] < 0 else msg["keep_last"], float(msg["commit_timeout_secs"]),
                      msg["flush_on_crash"], msg["fsync"], msg["dir_id"], msg["remote_dir"],
                      peer_timeout_secs=float(msg["peer_timeout_secs"]))
            self.slots.runs[run.run_id] = run
            if run.multi_node and run.local_ranks:
                self.leases[run.run_id] = run
                self._write_lease(run, create=True)
            log.info("job %s run %s: checkpoint directory %s (world size %d, local ranks %s)", self.job,
                     run.run_id, run.checkpoint_dir, world, run.local_ranks)
        # A run this persister has just met on one node has no save in flight here yet, and no other persister
        # serves it: in-flight directories of its run id were left by this job's previous persister, killed
        # while the training processes lived on (they reconnect with their run id). With several nodes,
        # another node's persister may still write into them; dead-peer checks and the commit timeout end those.
        orphaned = {run.run_id} if fresh and not run.multi_node and not run.remote_only else set()
        if msg["committer"] or orphaned:
            if msg["committer"]:
                run.committer = True
            if run.remote_only:  # before any save of this run: what killed persisters left in the store
                remote_only.clean_start(run.checkpoint_dir, list(self.slots.runs))
            else:
                recover_interrupted_commits(open_storage(), run.checkpoint_dir, job=self.job,
                                            known_runs=set(self.slots.runs) - orphaned,
                                            runtime_root=os.path.dirname(os.path.dirname(self.runtime_dir)),
                                            quiet_secs=max(run.commit_timeout_secs, 600.0))
            if run.remote_dir and run.committer:  # remove what an interrupted upload of an earlier persister left
                self.scheduler.clean_remote(run)
        if run.gone.pop(rank, None) is not None:  # the rank is back (a new connection of the same run)
            peers.remove_gone(run.checkpoint_dir, run.run_id, rank)
        run.connected.add(rank)
        entry = self.slots.attach(rank, run, conn, msg["slots_per_rank"])
        self.conn_rank[conn] = rank
        self.empty_since = None  # only a rank's connection restarts the idle timeout (not an operator's `ps`)
        self.crashed_since_empty = False
        return P.ok(persister_pid=os.getpid(), slots=[self.slots.info(s) for s in entry.slots])

    def _operator(self, op: str, msg: Dict[str, Any]) -> Dict[str, Any]:
        """Answer an operator's ``info`` or ``stop`` (called with the lock)."""
        if not secrets.compare_digest(msg["token"], self.token) or msg["job"] != self.job:
            raise PersisterError("authentication failed: wrong job or token")
        if op == "stop":
            flushing = []
            for run in list(self.slots.runs.values()):
                step = flush_newest(run, self.slots, self.scheduler, "stop requested", self.replicator, self.host)
                if step is not None:
                    flushing.append({"checkpoint_dir": run.checkpoint_dir, "run_id": run.run_id, "step": step})
            self.stop_requested = True
            log.warning("stop requested by an operator; flushing %s, then exiting (%d rank(s) connected)",
                        [f["step"] for f in flushing] or "nothing", len(self.conn_rank))
            return P.ok(flushing=flushing, connected_ranks=len(self.conn_rank), **self._info())
        return P.ok(**self._info())

    def _info(self) -> Dict[str, Any]:
        """This persister as ``snapckpt ps`` shows it: its runs (checkpoint directory, ranks), the snapshots
        it holds (per rank and slot) and the shared memory its arena holds, in bytes."""
        slots = []
        for rank, entry in sorted(self.slots.ranks.items()):
            for s in entry.slots:
                slots.append({"rank": rank, "slot": s.index, "state": s.state.value, "step": s.step,
                              "nbytes": s.nbytes, "run_id": s.run_id, "held": s.state in HELD,
                              "persistable": s.persistable})
        runs = [{"run_id": r.run_id, "checkpoint_dir": r.checkpoint_dir, "world_size": r.world_size,
                 "local_ranks": list(r.local_ranks), "connected_ranks": sorted(r.connected), "crashed": r.crashed}
                for r in self.slots.runs.values()]
        return {"pid": os.getpid(), "job": self.job, "started_at": self.started_at, "runs": runs, "slots": slots,
                "memory_bytes": sum(s["nbytes"] for s in slots),
                "steps_held": sorted({s["step"] for s in slots if s["held"]}),
                "pending_tasks": self.scheduler.pending, "stopping": self.stop_requested}

    def _op_ping(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        return P.ok(persister_pid=os.getpid())

    def _op_acquire(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        notes = self.replicator.drain_notes(entry.run_id, entry.rank)  # replicated / lagging, for the rank's events
        run = self.slots.runs.get(entry.run_id)
        if run is not None:
            self.slots.drop_moved_ranks(run)
        slot = self.slots.acquire(entry, msg["step"], msg["nbytes"], msg["slots"])
        if slot is None:
            return P.ok(busy=True, detail=self.slots.describe(entry), replication=notes)
        # the slots the rank prefaults at this size, once grown: those left ungrown for now too (SlotTable.acquire),
        # which grow once every local rank has asked for a slot
        usable = [s.index for s in self.slots.usable(entry, msg["slots"])]
        return P.ok(busy=False, replication=notes, usable=usable, **self.slots.info(slot))

    def _op_reserve(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        grown = self.slots.reserve(entry, msg["nbytes"], msg["slots"])
        return P.ok(slots=[{"slot": s.index, "path": s.path, "nbytes": msg["nbytes"]} for s in grown])

    def _op_reserve_hold(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        self.slots.holds.set(entry.rank, msg["hold"])
        return P.ok()

    def _op_stream(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        """A streamed DISK save starts (:mod:`snapckpt.persister.stream`): its writer and commit start now,
        while the rank copies; ``streaming`` False: they start at ``ready``, as for any save (the rank does not
        read the answer)."""
        s = self.slots.slot(entry, msg["slot"])
        dirname = validate_dirname(msg["dirname"])
        if msg["tracker_name"]:
            validate_dirname(msg["tracker_name"])
        started = self.scheduler.stream(entry, s, self.slots.runs[entry.run_id], msg["step"], dirname,
                                        msg["tracker_name"], msg["tracker_content"], msg["index_offset"],
                                        msg["index_nbytes"], msg["data_end"])
        return P.ok(streaming=started)

    def _op_ready(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        s = self.slots.slot(entry, msg["slot"])
        if s.stream is not None and not msg["persist"] and s.state == SlotState.WRITING:
            s.stream.cancel(f"rank {entry.rank} handed step {msg['step']} over as a memory snapshot, not for disk")
        slot = self.slots.ready(entry, msg["slot"], msg["step"], index_offset=msg["index_offset"],
                                index_nbytes=msg["index_nbytes"], dirname=msg["dirname"],
                                tracker_name=msg["tracker_name"], tracker_content=msg["tracker_content"],
                                persistable=msg["persistable"])
        run = self.slots.runs[entry.run_id]
        if msg["persist"]:  # a DISK save: hand it to the writers in the same round trip
            self.scheduler.persist(entry, msg["step"], run)
        self.replicator.on_ready(run, entry, slot)  # to the peer nodes, in the background
        return P.ok(seq=slot.seq)  # (the save's status requests name it)

    # ------------------------------------------------------------------ peer replicas (replication.py)
    def _op_replica_listen(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        return P.ok(port=self.replicator.listen(msg["addr"]))

    def _op_replica_peers(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        targets, nodes = msg["targets"], msg["nodes"]
        for name, lst in (("targets", targets), ("nodes", nodes)):
            if not all(isinstance(t, dict) and isinstance(t.get("node"), int) and isinstance(t.get("addr"), str)
                       and isinstance(t.get("port"), int) for t in lst):
                raise P.ProtocolError(f"replica_peers: {name} must be [{{node: int, addr: str, port: int}}]")
        run = self.slots.runs[entry.run_id]
        self.replicator.configure(run, check_secret(msg["secret"]), targets)
        self.notices.configure(run.run_id, msg["node"], msg["committer_node"],
                               {t["node"]: (t["addr"], t["port"]) for t in nodes})
        return P.ok()

    def _op_holdings(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        return P.ok(holdings=self.replicator.holdings())

    def _fetch(self, conn: socket.socket, rank: int, msg: Dict[str, Any]) -> None:
        """Answer a ``fetch`` (on its own thread): the rank's snapshot from a peer into its arena."""
        try:
            with self.lock:
                entry = self.slots.ranks[rank]
                run = self.slots.runs[entry.run_id]
            s = self.replicator.fetch(entry, run, rank, msg["step"], msg["run_id"], msg["addr"], msg["port"])
            with self.lock:
                reply = P.ok(**self.slots.info(s))
        except Exception as e:
            log.warning("rank %d: fetching step %d from %s:%s failed: %s: %s", rank, msg["step"], msg["addr"],
                        msg["port"], type(e).__name__, e)
            reply = P.fail(e)
        self._send(conn, reply)

    def _op_abort(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        self.slots.abort(entry, msg["slot"])
        return P.ok()

    def _op_fail(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        """A rank's DISK save of ``(step, dirname)`` failed before it reached the persister (a preflight such
        as the free-space check): see :meth:`Scheduler.fail_part`."""
        run = self.slots.runs[entry.run_id]
        dirname = validate_dirname(msg["dirname"])
        rec = {"type": msg["type"], "message": msg["message"]}
        self.scheduler.fail_part(entry.rank, run, msg["step"], dirname, rec)
        return P.ok()

    def _op_persist(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        self.scheduler.persist(entry, msg["step"], self.slots.runs[entry.run_id])
        return P.ok()

    def _op_status(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        res = self.scheduler.result((entry.run_id, msg["step"], msg["dirname"]), entry.rank, msg["seq"])
        if res is None:
            held = any(s.step == msg["step"] for s in self.slots.held(entry))
            return P.ok(state="held" if held else "unknown")
        if res.waiting:  # its save of the step again waits for the one before to be over (Scheduler.result)
            return P.ok(state="pending")
        if entry.rank in res.part_errors:
            res.told.add(entry.rank)  # (a record is pruned only once its ranks were told: Scheduler._prune)
            return P.ok(state="failed", error=res.part_errors[entry.rank], where="part")
        if res.state != "pending":
            res.told.add(entry.rank)
        base, notes = self.scheduler.uploader.notes_window(entry.run_id)
        return P.ok(state=res.state, error=res.error, where="commit", remote=notes, remote_base=base)

    def _op_await(self, entry: RankEntry, msg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """``status``, held (``None``: no reply yet) while the save is pending and ``wait_secs`` is positive:
        a rank waiting for its commit sends one request and is answered when the commit ends."""
        reply = self._op_status(entry, msg)
        return None if reply.get("state") in _NOT_ENDED and msg["wait_secs"] > 0 else reply

    def _op_held(self, entry: RankEntry, msg: Dict[str, Any]) -> Dict[str, Any]:
        # interrupted: slots whose copy never completed (the writer died or gave up): never loaded, but the
        # loader names them when it falls back to an older step
        torn = [{"slot": s.index, "step": s.step} for s in entry.slots if s.state == SlotState.INVALID]
        return P.ok(slots=[self.slots.info(s) for s in self.slots.held(entry)], interrupted=torn,
                    # the slots its last acquire used (those left ungrown not counted: SlotTable.acquire)
                    usable_slots=len([s for s in self.slots.usable(entry, entry.limit)
                                      if s.index not in entry.deferred]))


def batch_scheduling() -> bool:
    """Put this process, and the threads it starts later, under Linux's ``SCHED_BATCH`` policy.

    A batch task keeps its fair share of CPU but never preempts a running task when it wakes
    (``sched(7)``). Without it a rank's ``ready`` message woke the persister, which took the rank's
    CPU at once to start the disk write: the rank's ``sendall`` of a few hundred bytes then blocked for
    milliseconds (0.5 GiB DISK saves on 2 cores: 1.4-3.2 ms per save in ``sendall``, against 0.04 ms
    with the policy). Any user may select it. Returns ``False`` where the platform lacks it.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m snapckpt.persister``."""
    import argparse

    from snapckpt._internal import env as _env

    p = argparse.ArgumentParser(prog="snapckpt.persister")
    p.add_argument("--runtime-dir", required=True)
    p.add_argument("--arena-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--idle-timeout-secs", type=float, required=True)
    p.add_argument("--ready-fd", type=int, default=None, help="pipe written to once the socket listens")
    a = p.parse_args(argv)
    logging.basicConfig(level=_env.log_level(),
                        format="%(asctime)s snapckpt-persister[%(process)d] %(levelname)s %(message)s")
    batch_scheduling()
    try:  # a previous persister of this job may still be finishing its exit
        lock_pid_file(a.runtime_dir)  # its fd stays open, the lock held, until this process exits
    except PersisterError as e:
        log.error("%s; exiting", e)
        return 1
    server = Server(a.runtime_dir, a.arena_dir, a.job, a.idle_timeout_secs)

    def on_term(signum, frame):
        server.stop = True
        server.crashed_since_empty = False
        server.scheduler.stopping.set()  # (the lock may be held here: the waits are woken by stop_accepting)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.serve(a.ready_fd)
    return 0
