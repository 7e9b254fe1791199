"""Commit notices: the node persisters of a job tell each other when the commit path moves, over the
authenticated peer channel (:mod:`snapckpt.persister.channel`), so no persister polls the shared
filesystem to learn it.

Two small frames (JSON header only, no payload, never answered):

- ``{"op": "part_done", "run_id", "step", "dirname", "gen", "ranks"}``: sent by a node persister to the committer's
  node (the persister serving global rank 0) each time every part of the save it has accepted so far has
  ended: written and durable (files, part marker and its directory fsynced: :mod:`~snapckpt.persister.part_sync`),
  or failed with its failure marker written. ``ranks``: the local ranks whose part ended. The committer's
  wait for the parts (:func:`~snapckpt.persister.commit.wait_for_parts`) then lists the partial directory
  at once.
- ``{"op": "commit_ended", "run_id", "step", "dirname", "gen", "state"}``: sent by the committer's persister to
  every other node once the commit of the save ended (``committed``: the tracker is written; ``failed``:
  the commit was abandoned; ``removed``: the deletion of a failed commit's partial directory ended, after
  which the other nodes' next saves of that directory may write into it: ``Scheduler._await_removal_task``). Each
  node's :func:`~snapckpt.persister.commit.watch_commit` then reads the manifest (or sees the partial
  directory gone) at once. A save that a rank skipped (``on_slot_busy="skip"``) ends ``failed`` with
  ``"error"``, its :class:`~snapckpt.errors.SaveSkippedError` record, so that the ranks of every node hear it
  was skipped (and which rank skipped it), not that it failed.

``gen`` names which save of ``(run_id, step, dirname)`` the notice is about (``Result.gen`` of
:mod:`~snapckpt.persister.scheduler`: 1, then one more for each save of it again in the run, counted alike on
every node): a step saved again under the same directory (a retry once its save failed, a crash flush) must
not take the notices still on their way about the earlier save (its abort, ``committed``, ``removed``) for
its own. All persisters of a job run the same version: a notice without ``gen`` is malformed.

A notice only wakes a waiter: the filesystem stays the source of truth (the woken side reads the markers,
the manifest or the partial directory itself, and validates them). A notice that is lost (the peer's
connection broke twice, the peer has no channel, a job whose persister could not listen) costs only
latency: the waits re-check the filesystem every :data:`~snapckpt.persister.commit.BACKSTOP_SECS` anyway.
Sending never blocks the caller: each target node has one sender thread with its own queue and one kept
connection (reconnected once per notice when it broke), per run; :meth:`CommitNotices.forget` ends them once
the run is over on this node.

The addresses come from the ranks at start (``replica_peers``, :mod:`snapckpt.engine.replicas`): every
node's persister listens on the peer channel when the job spans several nodes, with or without replicas.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from snapckpt.persister import channel

log = logging.getLogger("snapckpt.persister")

__all__ = ["CommitNotices", "NOTICE_OPS"]

NOTICE_OPS = ("part_done", "commit_ended")
_MAX_QUEUED = 4096  # notices waiting for one target (a peer that never reads: the oldest are dropped)


class _Link(threading.Thread):
    """Sends the queued notices of one run to one target node, on one kept connection."""

    def __init__(self, run_id: str, node: int, addr: str, port: int, secret_of: Callable[[str], Optional[bytes]]):
        super().__init__(name=f"snapckpt-notice-{node}", daemon=True)
        self.run_id, self.node, self.addr, self.port, self.secret_of = run_id, node, addr, port, secret_of
        self.cv = threading.Condition()
        # (notice, its delivery callback or None); a notice dropped here never calls its callback
        self.queue: Deque[Tuple[Dict[str, Any], Optional[Callable[[bool], None]]]] = collections.deque(
            maxlen=_MAX_QUEUED)
        self.sock: Optional[socket.socket] = None
        self.stopping = False
        self.sent = 0
        self.lost = 0

    def offer(self, header: Dict[str, Any], done: Optional[Callable[[bool], None]] = None) -> None:
        """Queue ``header``; ``done(sent)`` is called on this link's thread once it was sent or lost."""
        with self.cv:
            self.queue.append((header, done))
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()

    def run(self) -> None:  # noqa: D401 (thread body)
        while True:
            with self.cv:
                while not self.queue and not self.stopping:
                    self.cv.wait()
                if not self.queue:
                    break
                header, done = self.queue.popleft()
            sent = self._send(header)
            if done is not None:
                done(sent)
        self._close()

    def _send(self, header: Dict[str, Any]) -> bool:
        """Send ``header``; return whether it was sent (``False``: lost)."""
        for attempt in (0, 1):  # a kept connection may have been dropped by the peer: once more
            try:
                if self.sock is None:
                    secret = self.secret_of(self.run_id)
                    if secret is None:
                        raise channel.AuthError(f"no secret for run {self.run_id}")
                    self.sock = channel.connect(self.addr, self.port, self.run_id, secret, timeout_secs=5.0)
                    self.sock.settimeout(5.0)  # a peer that stops reading must not hold this link forever
                channel.send_frame(self.sock, header)
                self.sent += 1
                return True
            except Exception as e:  # OSError, a bad address: the notice is lost, the backstop covers it
                self._close()
                if attempt or not isinstance(e, OSError) or isinstance(e, channel.AuthError):
                    self.lost += 1
                    log.log(logging.WARNING if isinstance(e, channel.AuthError) else logging.INFO,"commit notice %s of step %s to node %d (%s:%d) not delivered: %s: %s; that node "
                             "re-checks the filesystem on its own", header.get("op"), header.get("step"), self.node,
                             self.addr, self.port, type(e).__name__, e)
                    return False
        return False

    def _close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


class CommitNotices:
    """A node persister's sender and receiver of commit notices (see the module docstring).

    Args:
        secret_of: the secret of a run id (the peer channel's, :class:`~snapckpt.persister.replication.Replicator`),
            ``None`` for a run without a channel.
        on_notice: ``on_notice(run_id, step, dirname, gen, aborted=False, committed=False)``, called on a
            receiving thread for every valid notice (it wakes the waiter of that save; it must not block); ``aborted``
            is true for the committer's ``commit_ended`` of a failed commit, ``committed`` for a committed one;
            a ``removed`` one also passes ``removed=True``, one with an error record ``error=<record>``.
    """

    def __init__(self, secret_of: Callable[[str], Optional[bytes]],
                 on_notice: Callable[..., None]) -> None:
        self.secret_of = secret_of
        self.on_notice = on_notice
        self.lock = threading.Lock()
        # run id -> (this node, the committer's node, {node: (addr, port)} of the other nodes)
        self.runs: Dict[str, Tuple[int, int, Dict[int, Tuple[str, int]]]] = {}
        self.unreachable: Dict[str, int] = {}  # run id -> other nodes without a channel (no notice reaches them)
        self.links: Dict[Tuple[str, int], _Link] = {}
        self.retired: List[_Link] = []  # links of forgotten runs, possibly still sending their last notices
        self.received = 0

    def configure(self, run_id: str, node: int, committer_node: int, addrs: Dict[int, Tuple[str, int]]) -> None:
        """Take run ``run_id``'s node map: this node's index, the committer's node and every node's listening
        address (port 0: that node has no channel). Idempotent (every local rank sends the same)."""
        with self.lock:
            if run_id not in self.runs:
                others = {n: a for n, a in addrs.items() if n != node and a[1] > 0}
                self.runs[run_id] = (node, committer_node, others)
                self.unreachable[run_id] = sum(1 for n, a in addrs.items() if n != node and a[1] <= 0)

    def _offer(self, run_id: str, nodes: List[int], header: Dict[str, Any],
               done: Optional[Callable[[bool], None]] = None) -> None:
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                return
            for n in nodes:
                if n not in run[2]:
                    continue
                link = self.links.get((run_id, n))
                if link is None:
                    addr, port = run[2][n]
                    link = self.links[(run_id, n)] = _Link(run_id, n, addr, port, self.secret_of)
                    link.start()
                link.offer(header, done)

    def part_done(self, run_id: str, step: int, dirname: str, gen: int, ranks: List[int]) -> None:
        """This node's parts of ``ranks`` of generation ``gen`` of the save ended (durable, or failed with a
        marker): tell the committer's node (at once when that is this node). Never blocks."""
        with self.lock:
            run = self.runs.get(run_id)
        if run is None:
            return
        node, committer, _ = run
        if node == committer:  # a replica holder on the committer's node wrote a peer's part
            self.on_notice(run_id, step, dirname, gen)
            return
        self._offer(run_id, [committer], {"op": "part_done", "run_id": run_id, "step": step, "dirname": dirname,
                                          "gen": gen, "ranks": sorted(ranks)})

    def commit_ended(self, run_id: str, step: int, dirname: str, gen: int, state: str,
                     delivered: Optional[Callable[[bool], None]] = None,
                     error: Optional[Dict[str, Any]] = None) -> None:
        """The committer's commit of generation ``gen`` of the save ended (``state``: committed | failed), or
        the deletion of its partial directory after it failed ended (``removed``): tell every other node.
        ``error``: the failed commit's error record, sent along (a skipped save's).
        ``delivered(all_sent)``, when given, is called once (on a sending thread, or here), ``True`` only if the
        notice was sent to every other node of the run (a node without a channel, a lost or dropped notice:
        ``False``, or never called for a dropped one)."""
        with self.lock:
            run = self.runs.get(run_id)
            unreachable = self.unreachable.get(run_id, 0)
        if run is None or (delivered is not None and (unreachable or not run[2])):
            if delivered is not None:
                delivered(False)
            if run is None:
                return
            delivered = None
        done = None
        if delivered is not None:
            left, lock, report = [len(run[2])], threading.Lock(), delivered

            def done(sent: bool) -> None:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] = left[0] - 1 if sent else 0
                    last = left[0] == 0
                if last:
                    report(sent)

        header = {"op": "commit_ended", "run_id": run_id, "step": step, "dirname": dirname, "gen": gen, "state": state}
        if error is not None:
            header["error"] = error
        self._offer(run_id, sorted(run[2]), header, done)

    def receive(self, run_id: str, header: Dict[str, Any]) -> None:
        """A notice from a peer authenticated for ``run_id`` (the peer channel's serving thread). A notice
        naming another run, or malformed, is logged and ignored (it only ever wakes a waiter)."""
        step, dirname, gen = header.get("step"), header.get("dirname"), header.get("gen")
        if (header.get("run_id") != run_id or not isinstance(step, int) or not isinstance(dirname, str)
                or not isinstance(gen, int)):
            log.warning("ignored a malformed commit notice from a peer of run %s: %s", run_id, str(header)[:200])
            return
        self.received += 1
        log.debug("peer notice of run %s: %s of step %d (%s, save %d)%s", run_id, header.get("op"), step, dirname,
                  gen, f", {header.get('state')}" if header.get("state") else "")
        ended = header.get("op") == "commit_ended"
        state = header.get("state") if ended else None
        more: Dict[str, Any] = {"removed": True} if state == "removed" else {}
        err = header.get("error")
        if ended and isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str):
            more["error"] = {"type": err["type"], "message": err["message"]}
        self.on_notice(run_id, step, dirname, gen, aborted=state in ("failed", "removed"),
                       committed=state == "committed", **more)

    def forget(self, run_id: str) -> None:
        """Run ``run_id`` is over on this node: its links send what they have queued, then close their
        connection and end their thread (without waiting for them: never blocks). Its node map is kept: a
        notice of the run sent later (a rank of it reconnected) opens a new link."""
        with self.lock:
            links = [self.links.pop(k) for k in [k for k in self.links if k[0] == run_id]]
            self.retired = [link for link in self.retired if link.is_alive()] + links
        for link in links:
            link.stop()

    def shutdown(self) -> None:
        """Send what is queued, then stop (at exit; a peer that does not answer delays it 5 s at most)."""
        with self.lock:
            links = list(self.links.values()) + self.retired
        for link in links:
            link.stop()
        for link in links:
            link.join(timeout=6)
