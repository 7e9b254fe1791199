"""The crash flush from peer replicas: survivors commit the newest step although a node is gone.

Data path: the crash flush (:mod:`snapckpt.persister.flush`) of a persister writes its own local ranks'
parts of the newest step ``N`` they hold. With peer replicas, it also holds other nodes' ranks' snapshots
(:mod:`snapckpt.persister.replication`). For each replica of step ``N`` (same run and directory) it calls
:func:`stand_in`, which

1. records a claim, ``replica_<rank>`` in the run's peer directory (:mod:`snapckpt.persister.peers`), so
   that every persister waiting for the commit awaits that part instead of abandoning the step when the
   rank's node is found lost;
2. on a thread of its own, waits until either the rank's own node wrote the part (its part marker is in
   the partial directory: that node is alive and flushed), or that node will never write it (its lease
   went stale: the node is lost; or its gone record is final without the save), or the save ended;
3. in the second case writes the part from the replica, exactly as the rank's own node would have
   (the same files, checksums and part marker: :func:`snapckpt.persister.writer.write_part`), or, when
   that fails, that rank's failure marker, so that the commit fails at once with the cause
   (:func:`write_or_fail`).

So when the whole job dies and a node is gone, the survivors still commit the newest step.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Tuple

import xxhash

from snapckpt.ondisk.manifest import part_marker_name, partial_dirname
from snapckpt.persister import peers
from snapckpt.persister.commit import stale_marker
from snapckpt.persister.arena import map_slot
from snapckpt.persister.replication import Replica
from snapckpt.persister.scheduler import Scheduler
from snapckpt.persister.slot_index import read_index
from snapckpt.persister.slots import Run
from snapckpt.persister.writer import write_failure_marker, write_part
from snapckpt.storage.factory import open_storage

log = logging.getLogger("snapckpt.persister")

__all__ = ["stand_in", "write_or_fail"]

POLL_SECS = 0.25


def stand_in(run: Run, rep: Replica, step: int, dirname: str, scheduler: Scheduler, host: str) -> None:
    """Steps 1-2 of the module docstring for peer rank ``rep.rank``'s part of ``(step, dirname)`` (called
    with the server's lock; the wait runs on a thread, counted in ``scheduler.pending`` so that the
    persister does not exit before it ends)."""
    rec = {"rank": rep.rank, "run_id": run.run_id, "pending": [[step, dirname]], "host": host,
           "holder_ranks": sorted(run.local_ranks), "since_unix": time.time()}
    d = peers.peers_dir(run.checkpoint_dir, run.run_id)
    try:
        storage = open_storage(fsync=False)
        storage.makedirs(d)
        storage.write_atomic(os.path.join(d, peers.claim_name(rep.rank)), json.dumps(rec).encode())
    except OSError as e:
        log.warning("could not record the replica of rank %d for the flush of step %d: %s", rep.rank, step, e)
        return
    scheduler.pending += 1
    threading.Thread(target=_wait_and_write, args=(run, rep, step, dirname, scheduler),
                     name=f"snapckpt-standin-{rep.rank}", daemon=True).start()
    log.info("run %s: standing in for rank %d's part of step %d from its replica, should its node be lost",
             run.run_id, rep.rank, step)


def _wait_and_write(run: Run, rep: Replica, step: int, dirname: str, scheduler: Scheduler) -> None:
    partial = os.path.join(run.checkpoint_dir, partial_dirname(dirname, run.run_id))
    marker = os.path.join(partial, part_marker_name(rep.rank))
    watch = peers.PeerWatch(open_storage(), run.checkpoint_dir, run.run_id, run.peer_timeout_secs,
                            own_lease=peers.lease_name(min(run.local_ranks)) if run.local_ranks else None)
    deadline = time.monotonic() + run.commit_timeout_secs
    try:
        while time.monotonic() < deadline:
            if _part_there(marker, scheduler, (run.run_id, step, dirname)):
                log.info("rank %d's own node wrote its part of step %d: the replica is not needed", rep.rank, step)
                return
            with scheduler.lock:
                res = scheduler.result((run.run_id, step, dirname))
                ended = res is not None and res.state != "pending"
            if ended:
                return
            why = watch.lost(rep.rank, step, dirname)
            if why is not None:
                write_or_fail(run, rep, step, partial, why)
                scheduler.part_done(run.run_id, step, dirname, [rep.rank])  # the committer looks at once
                return
            time.sleep(POLL_SECS)
    except Exception as e:
        log.error("writing rank %d's part of step %d from its replica failed: %s: %s", rep.rank, step,
                  type(e).__name__, e)
    finally:
        with scheduler.lock:
            scheduler.pending -= 1


def _part_there(marker: str, scheduler: Scheduler, key: Tuple[str, int, str]) -> bool:
    """Whether the part marker ``marker`` is in the partial directory of the flush ``key`` and counts for its
    commit: not a stale marker of an earlier failed save of the step (:func:`~snapckpt.persister.commit.stale_marker`:
    a part written on its node after the committer had deleted the directory), which the commit skips. A marker
    that cannot be read counts (it is renamed into place whole: being replaced, as before)."""
    try:
        with open(marker, "rb") as f:
            rec = json.loads(f.read())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    with scheduler.lock:
        res = scheduler.results.get(key)
        gen = res.gen if res is not None else None
    return not (isinstance(rec, dict) and stale_marker(rec, gen, scheduler._failed_gens(key)))


def write_or_fail(run: Run, rep: Replica, step: int, partial: str, why: str) -> bool:
    """Write rank ``rep.rank``'s part of ``step`` into ``partial`` from the replica; if that fails (the
    replica no longer matches its checksum, the disk is full...), leave that rank's failure marker instead,
    so that the committer fails the step at once, naming the cause, rather than awaiting the claimed part
    until ``commit_timeout_secs``. Returns whether the part was written."""
    try:
        _write(run, rep, step, partial, why)
        return True
    except Exception as e:
        log.error("writing rank %d's part of step %d from its replica failed: %s: %s", rep.rank, step,
                  type(e).__name__, e)
        write_failure_marker(open_storage(fsync=run.fsync), partial, rank=rep.rank, run_id=run.run_id, step=step,
                             exc=e)
        return False


def _write(run: Run, rep: Replica, step: int, partial: str, why: str) -> None:
    t0 = time.monotonic()
    buf = map_slot(rep.path, rep.nbytes)
    try:
        got = xxhash.xxh3_64(memoryview(buf)[:rep.nbytes]).hexdigest()
        if got != rep.checksum:  # damaged while held here: never committed as if intact
            raise ValueError(f"the replica of rank {rep.rank} step {step} in {rep.path} no longer matches the "
                             f"checksum taken when it arrived ({got} != {rep.checksum})")
        index = read_index(buf, rep.path)
        if index["step"] != step:
            raise ValueError(f"the replica of rank {rep.rank} holds step {index['step']}, not {step}")
        files = write_part(open_storage(fsync=run.fsync, part=(rep.rank, step)), buf, index, partial,
                           rank=rep.rank, run_id=run.run_id, step=step)
    finally:
        try:
            buf.close()
        except BufferError:  # a view is still alive; the mapping goes with its last reference
            pass
    log.warning("rank %d step %d: part written from the peer replica (%s): %d bytes in %.3f s", rep.rank, step,
                why, sum(f["nbytes"] for f in files.values()), time.monotonic() - t0)
