"""A watcher node's late part of a save whose commit the committer already aborted (contract 4).

Every node shares the checkpoint directory; only the committer's node deletes the partial directory of a
failed commit (``Scheduler._remove_failed_partial``) and guards its own writers with ``discarding``. A part
of another node that only starts once the committer aborted and deleted the directory (a straggling rank's
request, a part queued behind others, a rank's failure reported late through ``fail_part``) must not
re-create it: nobody would delete it again, and a later save of the same step in the same run (a crash
flush, a retried save) would count that stale part marker, or fail at once on that stale failure marker.
"""
from __future__ import annotations

import json
import os
import re
import threading

import pytest

from snapckpt.errors import CommitError, CommitTimeoutError
from snapckpt.ondisk.manifest import CHECKSUM, SIDECAR, ChecksumWriter, partial_dirname
from snapckpt.persister import peers
from snapckpt.persister import scheduler as sched_mod
from snapckpt.persister.arena import SlotState
from snapckpt.persister.commit import CommitRequest, commit
from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.slots import Run, Slot, SlotTable
from snapckpt.storage.posix import PosixStorage

RUN = "a" * 16 + "0123456789ab"
STEP, DIRNAME = 7, "step_00000007"


def _req(ckpt: str, watch: peers.PeerWatch, timeout: float) -> CommitRequest:
    return CommitRequest(checkpoint_dir=ckpt, dirname=DIRNAME, step=STEP, run_id=RUN, world_size=4,
                         timeout_secs=timeout, keep_last=None, tracker_name="latest", tracker_content=str(STEP),
                         peer_check=watch.check, peer_tick_secs=watch.tick_secs)


def _part(ckpt: str, rank: int) -> None:
    """Rank ``rank``'s part of the save: one small file and its part marker, as the writer leaves them."""
    d = os.path.join(ckpt, partial_dirname(DIRNAME, RUN))
    os.makedirs(os.path.join(d, SIDECAR), exist_ok=True)
    name = f"rank{rank}.bin"
    with open(os.path.join(d, name), "wb") as f:
        cw = ChecksumWriter(f)
        cw.write(bytes([rank]) * 100)
    marker = {"rank": rank, "run_id": RUN, "step": STEP,
              "files": {name: {"nbytes": cw.nbytes, CHECKSUM: cw.hexdigest, "kind": "bytes"}}}
    with open(os.path.join(d, SIDECAR, f"part_{rank:05d}.json"), "w") as f:
        json.dump(marker, f)


def _beat(ckpt: str, ranks, stop: threading.Event) -> None:
    """A live node persister's lease: refreshed every 0.1 s until ``stop``."""
    def run():
        seq = 0
        while not stop.wait(0.1):
            seq += 1
            peers.write_lease(PosixStorage(fsync=False), ckpt, RUN, list(ranks), seq, create=True)

    threading.Thread(target=run, daemon=True).start()


def _watcher(ckpt: str, committer: bool = False):
    """Node 1's scheduler (ranks 2 and 3 of 4, not the committer) whose watch of step 7 ended failed on the
    committer's abort notice; the committer has deleted the partial directory. ``committer``: node 0's
    instead (ranks 0 and 1), whose commit of step 7 failed and whose deletion of the directory has ended."""
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    run = Run(run_id=RUN, world_size=4, local_ranks=[0, 1] if committer else [2, 3], committer=committer,
              checkpoint_dir=ckpt, keep_last=None, commit_timeout_secs=600.0, flush_on_crash=False, fsync=False)
    key = (RUN, STEP, DIRNAME)
    res = sched.results[key] = Result()
    sched.commits_started.add(key)
    if not committer:
        sched.on_notice(*key, 1, aborted=True)  # the committer's commit_ended "failed"
    res.state = "failed"  # this node's commit (or watch) ended failed
    return sched, run, key


def _retry_commits(ckpt: str, first=(0, 1, 2, 3)) -> None:
    """The same step saved again in the same run: the ranks ``first`` write their part anew, and the
    committer must wait for the others (a 1 s timeout, naming them), not count a stale part of the aborted
    save; once they wrote theirs too, it commits. A stale failure marker must not fail it either."""
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=30)
    rest = [r for r in range(4) if r not in first]
    stop = threading.Event()
    _beat(ckpt, [0, 1], stop)
    _beat(ckpt, [2, 3], stop)
    try:
        for r in first:
            _part(ckpt, r)
        if rest:
            with pytest.raises(CommitTimeoutError, match=re.escape(f"ranks {rest} did not write their part")):
                commit(PosixStorage(fsync=False), PosixStorage(), _req(ckpt, watch, timeout=1.0),
                       remove_partial_on_failure=False)
        for r in rest:
            _part(ckpt, r)
        m = commit(PosixStorage(fsync=False), PosixStorage(), _req(ckpt, watch, timeout=5.0))
    finally:
        stop.set()
    assert m["step"] == STEP and len(m["files"]) == 4


@pytest.mark.parametrize("committer", [False, True], ids=["watcher", "committer"])
def test_a_late_failure_after_the_abort_leaves_no_stale_failure_marker(tmp_path, committer):
    """Rank 3's (rank 1's on the committer's node) save fails before it reached its node's persister
    (``fail_part``), after the committer aborted step 7 and deleted its partial directory. Right: no failure
    marker re-creates the directory, and the step saved again in the same run commits (before the fix: the
    retry failed at once with the rank's old error, read from the stale ``fail_<rank>.json``)."""
    ckpt = str(tmp_path)
    sched, run, key = _watcher(ckpt, committer)
    partial = os.path.join(ckpt, partial_dirname(DIRNAME, RUN))
    rank = 1 if committer else 3
    sched.fail_part(rank, run, STEP, DIRNAME, {"type": "OSError", "message": "the old failure", "errno": 5})
    left = sorted(os.listdir(os.path.join(partial, ".snapckpt"))) if os.path.exists(partial) else None
    assert sched.results[key].part_errors[rank]["message"] == "the old failure"  # still known in memory
    _retry_commits(ckpt)
    assert left is None, left  # the directory the committer deleted was not re-created


def test_a_late_writer_on_a_watcher_after_the_abort_writes_nothing(tmp_path, monkeypatch):
    """Rank 2's writer on node 1 starts only after the committer aborted step 7 and deleted its partial
    directory (a straggling rank). Right: it writes nothing there (its part ends without a failure marker,
    and without an error of its own: its rank is answered with the commit's), and the step saved again in
    the same run commits with rank 2's new part only (before the fix: the writer re-created the directory
    with its part marker and files, and the retry's committer counted that stale part before rank 2's new
    part was written)."""
    ckpt = str(tmp_path)
    sched, run, key = _watcher(ckpt)
    partial = os.path.join(ckpt, partial_dirname(DIRNAME, RUN))
    res = sched.results[key]
    index = {"step": STEP, "files": [{"path": "late_rank2.bin", "kind": "bytes", "chunks": [[0, 64]]}]}
    monkeypatch.setattr(sched_mod, "_slot_map", lambda s: bytearray(b"x" * 64))
    monkeypatch.setattr(sched_mod, "read_index", lambda buf, path: index)
    s = Slot(index=0, path=str(tmp_path / "slot0"), nbytes=64, state=SlotState.PERSISTING, step=STEP, run_id=RUN,
             dirname=DIRNAME, seq=1)
    with sched.lock:
        res.rank_seq[2] = 1
        res.writers += 1
        sched.pending += 1
    sched._write_part_task(2, s, run, STEP, 0.0)
    sched.syncer.shutdown()  # the part's fsyncs and marker, if it got that far, are done
    left = sorted(os.listdir(partial)) if os.path.exists(partial) else None
    _retry_commits(ckpt, first=(0, 1, 3))  # rank 2's new part comes last
    assert left is None, left  # the directory the committer deleted was not re-created
    # the part ended, neither done nor an error of its own: rank 2 gets the commit's error (the cause)
    assert 2 not in res.part_errors and 2 not in res.parts_done and res.writers == 0


def test_a_watcher_whose_commit_is_pending_still_writes_its_failure_marker(tmp_path):
    """The guard is the abort only: while the commit is pending a failure on a watcher still reaches the
    committer as a failure marker (it ends the commit at once), and the committer fails on it."""
    ckpt = str(tmp_path)
    sched, run, key = _watcher(ckpt)
    res = sched.results[key]
    res.state, res.aborted_at = "pending", None
    sched.fail_part(3, run, STEP, DIRNAME, {"type": "OSError", "message": "disk gone", "errno": 5})
    assert os.path.exists(os.path.join(ckpt, partial_dirname(DIRNAME, RUN), ".snapckpt", "fail_00003.json"))
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=30)
    with pytest.raises(CommitError, match="rank 3 failed to write its part"):
        commit(PosixStorage(fsync=False), PosixStorage(), _req(ckpt, watch, timeout=5.0))
