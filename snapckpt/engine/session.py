"""PersisterSession: one rank's conversation with its node persister, as the saver and the loader see it.

It wraps the socket client (:class:`~snapckpt.persister.client.PersisterClient`) with what every request
of a Checkpointer needs: refuse once the Checkpointer is closed, reconnect (and re-introduce this rank
with its ``hello`` fields) after a persister restart, and name rank, step and persister pid in errors.

Sequence: :meth:`connect` once in the Checkpointer's constructor, then :meth:`request` (``acquire``,
``ready``, ``status``, ``held``, ``abort``, ``fail``) from the save and load paths, then :meth:`detach`.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

from snapckpt.dist.topology import Topology
from snapckpt.engine.slot_maps import SlotMaps
from snapckpt.errors import CheckpointerClosedError, PersisterDiedError, SnapckptError
from snapckpt.options import CheckpointOptions
from snapckpt.persister.client import PersisterClient, job_dirs

#: The message of a call to a closed Checkpointer.
CLOSED = "this Checkpointer is closed: create a new Checkpointer over the same directory to save or load again"

__all__ = ["PersisterSession"]

log = logging.getLogger(__name__)


class PersisterSession:
    """This rank's session with the node persister of job ``job``.

    Args:
        options: the Checkpointer's options (persister timeouts, slots, retention, fsync).
        job: the job key (:func:`~snapckpt.persister.client.job_key`).
        checkpoint_dir: absolute path of the checkpoint directory.
        run_id: this launch attempt's run id.
        topology: rank, world size and local ranks of this process.
        dir_id: the checkpoint directory's identity (``""`` where it has none).
        maps: the rank's slot mappings, dropped on every (re)connect: a new persister has new segments.

    Attributes:
        client: the socket client (its ``persister_pid``).
        closed: set True by the Checkpointer's ``close()`` (after :meth:`detach`): every later request raises.
    """

    def __init__(self, options: CheckpointOptions, job: str, checkpoint_dir: str, run_id: str,
                 topology: Topology, dir_id: str, maps: SlotMaps) -> None:
        self._options, self._checkpoint_dir, self._run_id = options, checkpoint_dir, run_id
        self._topology, self._dir_id, self._maps = topology, dir_id, maps
        rt, arena = job_dirs(options.resolved_runtime_dir, options.resolved_shm_dir, job)
        self.client = PersisterClient(
            rt, arena, job, startup_timeout_secs=options.persister_startup_timeout_secs,
            request_timeout_secs=options.request_timeout_secs,
            idle_timeout_secs=options.persister_idle_timeout_secs)
        self.closed = False

    @property
    def topology(self) -> Topology:
        """This rank's topology (rank, local ranks, nodes)."""
        return self._topology

    @property
    def arena_dir(self) -> str:
        """The job's arena directory in the shared-memory directory (the persister creates it)."""
        return self.client.arena_dir

    @property
    def persister_pid(self) -> Optional[int]:
        """Process id of the node persister (``None`` before the first connect)."""
        return self.client.persister_pid

    def connect(self) -> None:
        """(Re)connect to the node persister, starting it if needed, and introduce this rank.

        Raises:
            PersisterError: it could not be started or refused this rank.
        """
        o, topo = self._options, self._topology
        self._maps.drop()
        self.client.connect({
            "run_id": self._run_id, "rank": topo.rank, "world_size": topo.world_size,
            "local_ranks": list(topo.local_ranks), "committer": topo.rank == 0,
            "pid": os.getpid(), "checkpoint_dir": self._checkpoint_dir, "slots_per_rank": o.slots_per_rank,
            "keep_last": -1 if o.keep_last is None else o.keep_last,
            "commit_timeout_secs": o.commit_timeout_secs, "peer_timeout_secs": o.resolved_peer_timeout_secs,
            "flush_on_crash": o.flush_on_crash,
            "fsync": o.fsync, "dir_id": self._dir_id, "remote_dir": o.resolved_remote_dir or ""})

    def reserve(self, nbytes: int, slots: int) -> bool:
        """Before the first save: have the persister grow this rank's free slots (the first ``slots`` it may
        use: :meth:`Saver.slot_limit <snapckpt.engine.saver.Saver.slot_limit>`) to ``nbytes`` bytes and map them here, both on background threads; return whether any
        slot is being grown. Best effort: a failure (too little shared memory) is left for the first save's
        own ``acquire`` to raise, with its full message."""
        try:
            reply = self.request("reserve", nbytes=nbytes, slots=slots)
        except SnapckptError as e:
            log.info("rank %d: reserving the arena ahead of the first save failed: %s", self._topology.rank, e)
            return False
        for s in reply.get("slots", []):
            self._maps.prefault(s["slot"], s["path"], s["nbytes"])
        return bool(reply.get("slots"))

    def hold_reserve(self, hold: bool) -> None:
        """Hold back (``hold``) or resume the reservation of :meth:`reserve`, here (the prefaults) and in the
        persister (the growth), while this rank reads a checkpoint. Best effort: a failure is logged (a
        persister that died has no reservation left to hold)."""
        if hold:
            self._maps.pause(True)
        try:
            self.request("reserve_hold", hold=hold)
        except SnapckptError as e:
            log.info("rank %d: %s the arena reservation failed: %s", self._topology.rank,
                     "holding" if hold else "resuming", e)
        finally:
            if not hold:
                self._maps.pause(False)

    def request(self, op: str, **fields: Any) -> Dict[str, Any]:
        """Send one request (reconnecting first if the persister went away); return its reply.

        Raises:
            CheckpointerClosedError: the Checkpointer is closed.
            PersisterDiedError / PersisterTimeoutError: the persister died or hangs; its own error records.
        """
        if self.closed:
            raise CheckpointerClosedError(CLOSED)
        if not self.client.connected:
            self.connect()
        return self.client.request(op, **fields)

    def post(self, op: str, check: bool = False, **fields: Any) -> None:
        """Send one request without waiting for its answer (:meth:`PersisterClient.post`; ``check``: the next
        request raises its refusal); as :meth:`request` otherwise."""
        if self.closed:
            raise CheckpointerClosedError(CLOSED)
        if not self.client.connected:
            self.connect()
        self.client.post(op, check=check, **fields)

    def status(self, step: int, dirname: str, wait_secs: float = 0.0, seq: int = -1) -> Dict[str, Any]:
        """The persister's state of the save of ``step`` as ``dirname`` (``{"state": ...}``); with
        ``wait_secs`` > 0, answered once the save is no longer pending or after ``wait_secs`` seconds (at most
        half the request timeout), whichever comes first. ``seq``: the snapshot the save handed over (its
        ``ready`` answer's), which tells it from another save of the same step and directory (-1: unknown)."""
        if wait_secs > 0:
            wait = min(wait_secs, self._options.request_timeout_secs / 2)
            return self.request("await", step=step, dirname=dirname, seq=seq, wait_secs=float(wait))
        return self.request("status", step=step, dirname=dirname, seq=seq)

    def context(self, step: int) -> str:
        """``"rank R, step N, persister pid P"``: what every error of a save carries."""
        return f"rank {self._topology.rank}, step {step}, persister pid {self.client.persister_pid}"

    def lost_error(self, step: int) -> Exception:
        """The error of a save the persister no longer knows (it was restarted)."""
        return PersisterDiedError(f"the persister no longer knows step {step} (it was restarted); that save is "
                                  "lost, committed checkpoints are intact; the next call uses the new persister: "
                                  f"repeat that save; {self.context(step)}")

    def detach(self, clean: bool = True) -> None:
        """Disconnect from the persister. ``clean``: say goodbye first (a clean end: the persister exits when
        the last rank has closed cleanly); otherwise just drop the connection, as a crashed rank would (the
        persister keeps the memory snapshots and runs the crash flush once every rank has left). A refusal of a
        posted request still unread (a MEMORY save's ``ready``) is logged, not raised."""
        if clean and self.client.connected:
            try:
                self.client.settle()
            except (SnapckptError, OSError, ValueError) as e:
                log.warning("rank %d: the persister refused an earlier request: %s", self._topology.rank, e)
        self.client.close(bye=clean)
