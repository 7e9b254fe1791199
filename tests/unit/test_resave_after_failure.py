"""A save of a directory right after an earlier save of it, with real scheduler tasks (writer and commit).

Once a save failed, its partial directory (``.<dirname>.partial-<run>``) is deleted in the background, by the
committer's node only, once the commit failed and that node's writers of the save ended
(``Scheduler._remove_failed_partial``). A rank may hear "failed" before that: its own part failed while
another rank's writer goes on, or (on another node) a failure marker or the committer's abort notice ended its
watch. A next save of the same directory (a fixed tag such as DeepSpeed's ``tag="best"``, a retried step) that
wrote meanwhile lost its files to that deletion (``ENOENT``, and it failed too). A crash flush under a tag
whose DISK save is still in flight shared that save's partial directory the same way.

The tests drive the scheduler's own writer task on a thread (the slot's mapping and index are stubbed: one
64-byte file per part) and end the earlier save by hand where the test says so, with no sleeps: a writer that
writes at once (the bug) has written before the earlier save ends, one that waits writes after.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import os
import shutil
import threading
from typing import Optional

import pytest
from _harness import wait_until
from _sched_rig import NBYTES, node, stub_slot_reads, write_part

from snapckpt.ondisk.manifest import MANIFEST, SIDECAR, partial_dirname
from snapckpt.persister.arena import SlotState
from snapckpt.persister.commit import CommitRequest
from snapckpt.persister.commit_notices import CommitNotices
from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.flush import flush_newest
from snapckpt.persister.slots import RankEntry, Run, Slot
from snapckpt.persister.writer import write_failure_marker
from snapckpt.storage.posix import PosixStorage

RUN = "c" * 16 + "0123456789ab"
TAG = "best"


@pytest.fixture
def parts(monkeypatch):
    stub_slot_reads(monkeypatch)


def _node(ckpt: str, committer: bool = True, world_size: int = 2, local_ranks=(0, 1)):
    return node(RUN, ckpt, committer, world_size, local_ranks)


def _slot(ckpt: str, rank: int, step: int) -> Slot:
    return Slot(index=rank, path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES, state=SlotState.PERSISTING,
                step=step, run_id=RUN, dirname=TAG, seq=step)


def _save(sched: Scheduler, step: int, **fields) -> Result:
    """The record of a save of ``TAG`` at ``step`` whose commit has started (``fields``: its state)."""
    key = (RUN, step, TAG)
    with sched.lock:
        res = sched.results.setdefault(key, Result())
        sched.commits_started.add(key)
        for name, v in fields.items():
            setattr(res, name, v)
        sched.pending += res.writers
    return res


def _write(sched: Scheduler, run: Run, ckpt: str, rank: int, step: int) -> threading.Thread:
    """Rank ``rank``'s part of the save of ``TAG`` at ``step``, by the scheduler's writer task on a thread."""
    res = _save(sched, step)
    with sched.lock:
        res.rank_seq[rank] = step
        res.writers += 1
        sched.pending += 1
    t = threading.Thread(target=sched._write_part_task, args=(rank, _slot(ckpt, rank, step), run, step, 0.0),
                         daemon=True)
    t.start()
    t.join(1.0)  # (a writer that does not wait has written its data by now)
    return t


def _end_writer(sched: Scheduler, run: Run, ckpt: str, rank: int, step: int, slot: Optional[Slot] = None) -> None:
    """Rank ``rank``'s writer of the failed save at ``step`` ends (it failed too); ``slot``: the rank's slot
    it read (READY again), if the test holds one."""
    sched._part_ended((RUN, step, TAG), rank, slot or _slot(ckpt, rank, step), None if slot is None else slot.seq,
                      run, step, PosixStorage(fsync=False), os.path.join(ckpt, partial_dirname(TAG, RUN)), 0.0, None,
                      OSError(errno.EIO, "also failed"))


def _finish(sched: Scheduler, t: threading.Thread) -> None:
    t.join(30)
    assert not t.is_alive(), "the writer still waits"
    sched.syncer.shutdown()  # the part's fsyncs and marker are done
    sched.remove_pool.shutdown(wait=True)


def _assert_part(ckpt: str, directory: str, rank: int, step: int) -> None:
    """``directory`` holds rank ``rank``'s part of ``step``: its file (its bytes) and its part marker."""
    d = os.path.join(ckpt, directory)
    assert os.path.isdir(d), f"{directory} is gone: {sorted(os.listdir(ckpt))}"
    with open(os.path.join(d, f"rank{rank}.bin"), "rb") as f:
        assert f.read() == bytes([step]) * NBYTES
    with open(os.path.join(d, SIDECAR, f"part_{rank:05d}.json")) as f:
        assert json.load(f)["step"] == step


def _old_part(ckpt: str, rank: int, step: int) -> str:
    """What the failed save at ``step`` left in the partial directory: rank ``rank``'s file."""
    d = os.path.join(ckpt, partial_dirname(TAG, RUN))
    os.makedirs(os.path.join(d, SIDECAR), exist_ok=True)
    with open(os.path.join(d, f"rank{rank}.bin"), "wb") as f:
        f.write(bytes([step]) * 10)
    return d



def _committer_says(sched: Scheduler, step: int):
    """``ended(state, gen)``: the committer's ``commit_ended`` notice of generation ``gen`` of the save of
    ``step`` under TAG, received by ``sched`` through a real :class:`CommitNotices`."""
    notices = CommitNotices({}.get, sched.on_notice)

    def ended(state: str, gen: int) -> None:
        notices.receive(RUN, {"op": "commit_ended", "run_id": RUN, "step": step, "dirname": TAG, "gen": gen,
                              "state": state})
    return ended


def _end_pending(sched, key, rank: int = 0) -> None:
    """A test's teardown: a save of ``key`` still pending fails on ``rank``'s part (its commit task ends), and the
    pool stops."""
    with sched.lock:
        res = sched.results.get(key)
        if res is not None and res.state == "pending":
            res.part_errors.setdefault(rank, {"type": "OSError", "message": "test over"})
            res.part_ended.set()
        sched.ended.notify_all()
    sched.pool.shutdown(wait=False)


def test_a_resave_while_a_writer_of_the_failed_save_still_runs_keeps_its_files(tmp_path, parts):
    """The committer's node: rank 0's part of step 7 failed and so did the commit, while rank 1's writer of
    step 7 still writes; rank 0 has heard "failed" and saves the tag again (step 8). Right: rank 0's new
    part waits for rank 1's old writer and the deletion of step 7's partial directory that follows it, then is
    written (before the fix: it was written at once, then deleted with step 7's directory)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    _old_part(ckpt, 1, 7)
    _save(sched, 7, state="failed", writers=1, part_errors={0: {"type": "OSError", "message": "disk full"}})
    t = _write(sched, run, ckpt, 0, 8)
    _end_writer(sched, run, ckpt, 1, 7)  # the failed save is over: its partial directory is deleted
    _finish(sched, t)
    _assert_part(ckpt, partial_dirname(TAG, RUN), 0, 8)
    assert sched.results[(RUN, 8, TAG)].parts_done == {0}


def _other_node_failed_over(ckpt: str):
    """Node 1 (ranks 2 and 3 of 4): step 7's save of ``TAG`` failed (rank 0's failure marker in the partial
    directory, beside rank 1's file) and its last writer here ended: ``(scheduler, run, partial directory)``."""
    sched, run = _node(ckpt, committer=False, world_size=4, local_ranks=(2, 3))
    partial = _old_part(ckpt, 1, 7)
    write_failure_marker(PosixStorage(fsync=False), partial, rank=0, run_id=RUN, step=7,
                         exc=OSError(errno.ENOSPC, "disk full"))
    _save(sched, 7, state="failed", writers=1)
    _end_writer(sched, run, ckpt, 3, 7)
    return sched, run, partial


@pytest.mark.parametrize("notice", ["removed", "lost", "lost_and_recreated"])
def test_a_resave_on_another_node_waits_for_the_committers_deletion(tmp_path, parts, notice):
    """Node 1 (ranks 2 and 3 of 4): its watch of step 7 failed (rank 0's failure marker) and its last writer
    of step 7 ended, but the committer's node, which deletes the shared partial directory, has not yet.
    Rank 2 saves the tag again (step 8). Right: its part waits until the committer's node said it deleted
    the directory (``commit_ended`` ``removed``) or, that notice lost, until the directory is seen gone, or
    seen without step 7's markers (the committer's part of step 8 re-created it); then it is written
    (before the fix: it was written at once, then deleted by the committer)."""
    ckpt = str(tmp_path)
    sched, run, partial = _other_node_failed_over(ckpt)
    t = _write(sched, run, ckpt, 2, 8)
    shutil.rmtree(partial)  # the committer's node deletes step 7's partial directory, then says so
    if notice == "removed":
        CommitNotices({}.get, sched.on_notice).receive(RUN, {"op": "commit_ended", "run_id": RUN, "step": 7,
                                                              "dirname": TAG, "gen": 1, "state": "removed"})
    elif notice == "lost_and_recreated":
        write_part(ckpt, TAG, RUN, 0, 8)
    _finish(sched, t)
    _assert_part(ckpt, partial_dirname(TAG, RUN), 2, 8)


def test_a_crash_flush_under_a_tag_waits_for_the_tags_save_in_flight(tmp_path, parts):
    """One rank: its DISK save of ``best`` at step 5 has its part written and its commit not yet ended
    when the crash flush writes step 6 (the rank's newest snapshot, a MEMORY save under the same tag: the
    client waits only between DISK saves). Right: step 6's part waits for step 5's commit, which commits
    step 5's part, and is then written into a new partial directory (before the fix: step 6's part replaced
    step 5's file and marker in the shared partial directory, and step 5's commit failed)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt, world_size=1, local_ranks=(0,))
    write_part(ckpt, TAG, RUN, 0, 5)
    _save(sched, 5, parts_done={0})  # its commit: started, not yet ended
    t = _write(sched, run, ckpt, 0, 6)  # the crash flush's part of step 6
    req = CommitRequest(checkpoint_dir=ckpt, dirname=TAG, step=5, run_id=RUN, world_size=1, timeout_secs=5.0,
                        keep_last=None, tracker_name="", tracker_content="")
    with sched.lock:
        sched.pending += 1
    sched._commit_task(req, run, 1)  # step 5's commit
    assert sched.results[(RUN, 5, TAG)].state == "committed", sched.results[(RUN, 5, TAG)].error
    _finish(sched, t)
    _assert_part(ckpt, TAG, 0, 5)
    with open(os.path.join(ckpt, TAG, MANIFEST)) as f:
        assert json.load(f)["step"] == 5
    _assert_part(ckpt, partial_dirname(TAG, RUN), 0, 6)


def test_a_crash_flush_of_a_failed_step_whose_writer_still_runs_starts_once_that_save_is_over(tmp_path, parts):
    """Two local ranks: rank 0's part of step 7 (``best``) failed and so did the commit, rank 1's writer of
    it still runs, and the job dies: the crash flush writes step 7 again. Right: the flush starts once that
    save is over (rank 1's writer ended, its partial directory with rank 0's failure marker deleted) and
    commits both parts (before the fix: the flush replaced the failed save's record at once, rank 1's old
    writer then ended on the flush's record and failed its commit with its error, and the failed save's
    partial directory was never deleted)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    held = {r: _slot(ckpt, r, 7) for r in (0, 1)}
    held[0].state = SlotState.READY  # its writer ended; rank 1's still reads its slot
    for r in (0, 1):
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[held[r]], run_id=RUN)
    partial = _old_part(ckpt, 1, 7)
    write_failure_marker(PosixStorage(fsync=False), partial, rank=0, run_id=RUN, step=7,
                         exc=OSError(errno.ENOSPC, "disk full"))
    _save(sched, 7, state="failed", writers=1, part_errors={0: {"type": "OSError", "message": "disk full"}})
    with sched.lock:  # the job died: the crash flush
        assert flush_newest(run, sched.slots, sched, "crashed") == 7
    _end_writer(sched, run, ckpt, 1, 7, held[1])
    assert wait_until(lambda: sched.results[(RUN, 7, TAG)].state != "pending", timeout=30)
    res = sched.results[(RUN, 7, TAG)]
    assert res.state == "committed", res.error
    for r in (0, 1):
        _assert_part(ckpt, TAG, r, 7)


@pytest.mark.parametrize("heard", ["own_part", "commit"])
def test_a_save_of_the_same_step_again_while_a_writer_of_its_failed_save_still_runs_starts_once_it_is_over(
        tmp_path, parts, heard):
    """Two local ranks: step 7's save of ``best`` failed (``own_part``: rank 0's own part, the rank hears it at
    once; ``commit``: rank 1's part, and the commit failed) while rank 1's writer of it still runs, and rank 0
    saves step 7 again. Right: the new save waits for the failed one to be over (rank 0's status says pending
    meanwhile, not the old failure), then both ranks' new parts commit (before the fix: the new save replaced
    the failed save's record at once, rank 1's old writer ended on the new record with its error, and the new
    save failed)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    old1 = _slot(ckpt, 1, 7)  # rank 1's writer of the failed save still reads it
    new0 = Slot(index=10, path=os.path.join(ckpt, "rank0"), nbytes=NBYTES, state=SlotState.READY, step=7,
                run_id=RUN, dirname=TAG, seq=8)
    for r, s in ((0, new0), (1, old1)):
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[s], run_id=RUN)
    partial = _old_part(ckpt, 1, 7)
    failed_rank = 0 if heard == "own_part" else 1
    write_failure_marker(PosixStorage(fsync=False), partial, rank=failed_rank, run_id=RUN, step=7,
                         exc=OSError(errno.ENOSPC, "disk full"))
    old = _save(sched, 7, state="failed", writers=1, rank_seq={0: 7, 1: 7},
                part_errors={failed_rank: {"type": "OSError", "message": "disk full"}})
    with sched.lock:
        sched.persist(sched.slots.ranks[0], 7, run)  # rank 0 saves step 7 again
    assert sched.results[(RUN, 7, TAG)] is old and old.deferred == {0}  # not started: the old save goes on
    assert new0.pins == 1  # the slot is not handed out meanwhile (before: the rank's next snapshot took it)
    _end_writer(sched, run, ckpt, 1, 7, old1)  # the failed save is over: its partial directory is deleted
    assert wait_until(lambda: sched.results[(RUN, 7, TAG)] is not old
                      and sched.results[(RUN, 7, TAG)].parts_done == {0}, timeout=30)
    assert not old.deferred and new0.pins == 0
    with sched.lock:
        sched.persist(sched.slots.ranks[1], 7, run)  # rank 1 saves step 7 again (its slot is READY now)
    assert wait_until(lambda: sched.results[(RUN, 7, TAG)].state != "pending", timeout=30)
    res = sched.results[(RUN, 7, TAG)]
    assert res.state == "committed", res.error
    for r in (0, 1):
        _assert_part(ckpt, TAG, r, 7)


def test_a_save_of_the_same_step_again_while_its_first_save_is_in_flight_waits_for_it_on_every_rank(
        tmp_path, parts):
    """Two local ranks: step 7's save of ``best`` is in flight and will succeed (rank 0's part is written, rank
    1's writer still runs); rank 0 saves step 7 again at once (the engine no longer waits for the first save
    on the training thread), rank 1 only once the first save committed. Right: rank 0's save waits for the
    first one (its status says pending, its slot is pinned), then starts as the new save of step 7, which
    rank 1's save joins: both ranks' new parts commit (before the fix: rank 0's save was refused with
    PersisterError while rank 1's started a new save that waited for rank 0's part until its timeout)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    key = (RUN, 7, TAG)
    old1 = _slot(ckpt, 1, 7)  # rank 1's writer of the first save still reads it
    new0 = Slot(index=10, path=os.path.join(ckpt, "rank0"), nbytes=NBYTES, state=SlotState.READY, step=7,
                run_id=RUN, dirname=TAG, seq=8)
    new1 = Slot(index=11, path=os.path.join(ckpt, "rank1"), nbytes=NBYTES, state=SlotState.READY, step=7,
                run_id=RUN, dirname=TAG, seq=9)
    for r, s in ((0, new0), (1, old1)):
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[s], run_id=RUN)
    old = _save(sched, 7, writers=1, rank_seq={0: 7, 1: 7}, parts_done={0})
    with sched.lock:
        sched.persist(sched.slots.ranks[0], 7, run)  # rank 0 saves step 7 again
    assert sched.results[key] is old and old.deferred == {0} and new0.pins == 1
    with sched.lock:  # the deferred snapshot's save has no record yet: pending, not the first save's outcome
        assert sched.result(key, 0, 8).waiting and sched.result(key, 0, -1).waiting
        assert sched.result(key, 0, 7) is old and sched.result(key, 1, 7) is old and sched.result(key) is old
    _first_save_commits(sched, key, old)  # rank 1's writer ends, then the commit
    assert wait_until(lambda: sched.results[key] is not old and sched.results[key].parts_done == {0}, timeout=30)
    assert not old.deferred and new0.pins == 0
    sched.slots.ranks[1].slots.append(new1)
    with sched.lock:
        sched.persist(sched.slots.ranks[1], 7, run)  # rank 1 saves step 7 again: it joins the new save
    assert wait_until(lambda: sched.results[key].state != "pending", timeout=30)
    res = sched.results[key]
    assert res.state == "committed", res.error
    assert res.rank_seq == {0: 8, 1: 9}
    for r in (0, 1):
        _assert_part(ckpt, TAG, r, 7)
    # each save's status is asked by the rank's snapshot it handed over: the first save's is its own
    assert sched.result(key, 0, 7) is old and sched.result(key, 1, 7) is old and sched.result(key, 0, 8) is res
    assert sched.result(key) is res  # (the newest, for a caller that names no snapshot)


def test_a_deferred_save_that_cannot_start_fails_alone_and_the_committed_first_save_stands(tmp_path, parts):
    """Rank 0 saves step 7 again while its first save is in flight (deferred); by the time the first save
    commits, the deferred snapshot is no longer held (its slot was taken back: a rank that vanished in
    between). Right: the save of it again fails with why it could not start, asked by its snapshot; the first
    save's handles of both ranks still hear "committed" (before: the error went into the first save's
    part_errors, and rank 0's handle of the committed first save read it as failed)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    key = (RUN, 7, TAG)
    new0 = Slot(index=10, path=os.path.join(ckpt, "rank0"), nbytes=NBYTES, state=SlotState.READY, step=7,
                run_id=RUN, dirname=TAG, seq=8)
    sched.slots.ranks[0] = RankEntry(rank=0, slots=[new0], run_id=RUN)
    old = _save(sched, 7, writers=1, rank_seq={0: 7, 1: 7}, parts_done={0})
    with sched.lock:
        sched.persist(sched.slots.ranks[0], 7, run)  # rank 0 saves step 7 again: deferred
    assert old.deferred == {0}
    new0.state = SlotState.FREE  # the deferred snapshot is gone
    _first_save_commits(sched, key, old)
    assert wait_until(lambda: not old.deferred, timeout=30)
    with sched.lock:
        assert sched.results[key] is old and not old.part_errors
        assert sched.result(key, 0, 7) is old and sched.result(key, 1, 7) is old
        again = sched.result(key, 0, 8)
        assert again is not old and again.state == "failed", again
        assert "holds no snapshot of step 7" in again.error["message"], again.error


def test_writers_that_wait_for_their_directory_do_not_hold_the_writer_threads(tmp_path, parts):
    """Two local ranks, a tag saved at step 1 then at once at step 2 (the engine does not wait): rank 0 hands
    over both parts before rank 1 hands over its part of step 1 (the ranks reach their ``ready`` at different
    times), with one writer thread (the persister has 4, for up to 8 local ranks). Right: rank 0's part of
    step 2 waits off the writer thread, rank 1's part of step 1 is written, step 1 commits, then step 2 (before
    the fix: rank 0's step-2 writer waited on the only thread for step 1, whose last part was queued behind it:
    neither save ever ended)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    sched.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-writer")
    for r in (0, 1):
        sched.slots.ranks[r] = RankEntry(rank=r, run_id=RUN, slots=[
            Slot(index=10 * r + st, path=os.path.join(ckpt, f"rank{r}"), nbytes=NBYTES, state=SlotState.READY,
                 step=st, run_id=RUN, dirname=TAG, seq=st) for st in (1, 2)])

    def persist(rank: int, step: int) -> None:
        with sched.lock:
            sched.persist(sched.slots.ranks[rank], step, run)

    def ended(step: int) -> bool:
        res = sched.results.get((RUN, step, TAG))
        return res is not None and res.state != "pending"

    try:
        persist(0, 1)
        assert wait_until(lambda: sched.results[(RUN, 1, TAG)].parts_done == {0}, timeout=30)
        persist(0, 2)  # step 1 is still in flight: rank 1's part of it is not handed over yet
        persist(1, 1)
        assert wait_until(lambda: ended(1), timeout=30), "step 1's last part never ran"
        assert sched.results[(RUN, 1, TAG)].state == "committed", sched.results[(RUN, 1, TAG)].error
        persist(1, 2)
        assert wait_until(lambda: ended(2), timeout=30)
        assert sched.results[(RUN, 2, TAG)].state == "committed", sched.results[(RUN, 2, TAG)].error
        for r in (0, 1):
            _assert_part(ckpt, TAG, r, 2)
    finally:  # (a failed run: end what still waits, so that no thread outlives the test)
        with sched.lock:
            for res in sched.results.values():
                if res.state == "pending":
                    res.part_errors.setdefault(1, {"type": "OSError", "message": "test over"})
                    res.part_ended.set()
                res.writers = 0
            sched.ended.notify_all()
        sched.pool.shutdown(wait=False)


def _one_rank_refused(ckpt: str):
    """A one-rank node holding step 2 of ``TAG`` in a READY slot, whose free-space check refused that save
    (``fail_part``): ``(scheduler, run)``."""
    sched, run = _node(ckpt, world_size=1, local_ranks=(0,))
    s = Slot(index=0, path=os.path.join(ckpt, "rank0"), nbytes=NBYTES, state=SlotState.READY, step=2, run_id=RUN,
             dirname=TAG, seq=2)
    sched.slots.ranks[0] = RankEntry(rank=0, slots=[s], run_id=RUN)
    sched.fail_part(0, run, 2, TAG, {"type": "InsufficientDiskError", "message": "no room"})
    return sched, run


def test_a_one_rank_save_of_a_step_again_after_its_refused_part_starts_at_once(tmp_path, parts):
    """One rank: its free-space check refused step 2 (``fail_part``: nothing written, and in a one-rank run
    no commit started, so that save is over already), then it saves step 2 again. Right: the new save starts
    at once and commits (before the fix: it was deferred until the refused save was over, which never came:
    the rank's status said pending until its wait timed out)."""
    ckpt = str(tmp_path)
    sched, run = _one_rank_refused(ckpt)
    with sched.lock:
        sched.persist(sched.slots.ranks[0], 2, run)
    assert not sched.results[(RUN, 2, TAG)].deferred
    assert wait_until(lambda: sched.results[(RUN, 2, TAG)].state != "pending", timeout=30)
    res = sched.results[(RUN, 2, TAG)]
    assert res.state == "committed", res.error
    _assert_part(ckpt, TAG, 0, 2)


def _late_rank(ckpt: str, sched: Scheduler, rank: int, step: int) -> None:
    """Rank ``rank`` holds its READY snapshot of ``step`` (its copy ended late: it persists it only now)."""
    s = Slot(index=20 + rank, path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES, state=SlotState.READY,
             step=step, run_id=RUN, dirname=TAG, seq=step)
    sched.slots.ranks[rank] = RankEntry(rank=rank, slots=[s], run_id=RUN)


def test_a_late_part_of_a_failed_save_does_not_starve_the_writers_of_the_next_save(tmp_path, parts):
    """Three local ranks: step 7's commit of ``best`` failed at once on rank 0's part while rank 2's writer of
    it still runs; rank 0 heard it and saves the tag again (step 8): its writer takes the pool's thread and
    waits for step 7's save to be over. Then rank 1, whose copy of step 7 ended late, persists it. Right:
    rank 1's part of the failed save is not written (its commit is over) and step 8's part is written once
    rank 2's writer ended (before the fix: rank 1's writer was queued behind step 8's, which waited for it:
    the pool never ran again; the persister has 4 writer threads, so 4 local ranks saving the tag again
    did it, here the pool has 1)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt, world_size=3, local_ranks=(0, 1, 2))
    sched.pool = cf.ThreadPoolExecutor(max_workers=1)
    _old_part(ckpt, 2, 7)
    old = _save(sched, 7, state="failed", writers=1, rank_seq={0: 7, 2: 7},
                part_errors={0: {"type": "OSError", "message": "disk full"}})
    _late_rank(ckpt, sched, 0, 8)
    _late_rank(ckpt, sched, 1, 7)
    try:
        with sched.lock:
            sched.persist(sched.slots.ranks[0], 8, run)  # step 8: its writer waits for step 7's rank 2
        with sched.lock:
            sched.persist(sched.slots.ranks[1], 7, run)  # step 7's late part
        _end_writer(sched, run, ckpt, 2, 7)
        assert wait_until(lambda: sched.results[(RUN, 8, TAG)].parts_done == {0}, timeout=30), \
            "step 8's writer never ran"
        assert 1 not in old.parts_done and old.writers == 0
    finally:
        with sched.lock:  # (before the fix: unblock the pool, so that the test ends)
            old.writers = 0
            sched.ended.notify_all()
        sched.fail_part(1, run, 8, TAG, {"type": "OSError", "message": "ends step 8's commit"})
        sched.pool.shutdown(wait=True)
    sched.syncer.shutdown()
    sched.remove_pool.shutdown(wait=True)


def test_a_late_part_of_a_failed_save_does_not_delete_the_next_saves_files(tmp_path, parts):
    """The committer's node: step 7's save of ``best`` failed and is over (its partial directory deleted); rank 0
    has written its part of step 8 into a new partial directory; rank 1, whose copy of step 7 ended late,
    persists it now. Right: rank 1's part of step 7 is not written and step 8's part stays (before the fix:
    rank 1's writer ran, refused to write (the commit is over), and its end, the failed save's last writer
    again, deleted the partial directory a second time, with step 8's part in it)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    _save(sched, 7, state="failed", rank_seq={0: 7}, part_errors={0: {"type": "OSError", "message": "disk full"}})
    write_part(ckpt, TAG, RUN, 0, 8)
    _save(sched, 8, parts_done={0}, rank_seq={0: 8})
    _late_rank(ckpt, sched, 1, 7)
    with sched.lock:
        sched.persist(sched.slots.ranks[1], 7, run)
    sched.pool.shutdown(wait=True)
    sched.syncer.shutdown()
    sched.remove_pool.shutdown(wait=True)
    _assert_part(ckpt, partial_dirname(TAG, RUN), 0, 8)


def test_a_streamed_save_of_a_step_again_while_its_failed_save_is_not_over_does_not_replace_it(tmp_path, parts):
    """Two local ranks: step 7's save of ``best`` failed on rank 0's own part while rank 1's writer of it still
    runs, and rank 0 saves step 7 again as a streamed save. Right: the stream does not start (the rank's
    ``ready`` then defers the save until the failed one is over, as :meth:`Scheduler.persist` does) and the
    failed save's record stays (before the fix: the stream replaced it at once, and rank 1's old writer ended
    on the new record)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    old = _save(sched, 7, state="failed", writers=1, rank_seq={0: 7, 1: 7},
                part_errors={0: {"type": "OSError", "message": "disk full"}})
    s = Slot(index=10, path=os.path.join(ckpt, "rank0"), nbytes=4 * NBYTES, state=SlotState.WRITING, step=7,
             run_id=RUN, dirname=TAG, seq=8)
    entry = RankEntry(rank=0, slots=[s], run_id=RUN)
    with sched.lock:
        started = sched.stream(entry, s, run, 7, TAG, "", "", 2 * NBYTES, NBYTES, NBYTES)
    assert not started and sched.results[(RUN, 7, TAG)] is old and old.writers == 1


def test_a_streamed_late_part_of_a_failed_save_is_not_written(tmp_path, parts):
    """Step 7's save of ``best`` failed and is over on the committer's node; rank 1 streams its part of step 7
    late. Right: no stream and no writer (its ``ready`` then finds the commit over: nothing written), as a
    late part that is not streamed (before the fix: a writer started on the failed save's record)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    old = _save(sched, 7, state="failed", rank_seq={0: 7}, part_errors={0: {"type": "OSError", "message": "disk full"}})
    s = Slot(index=11, path=os.path.join(ckpt, "rank1"), nbytes=4 * NBYTES, state=SlotState.WRITING, step=7,
             run_id=RUN, dirname=TAG, seq=7)
    with sched.lock:
        started = sched.stream(RankEntry(rank=1, slots=[s], run_id=RUN), s, run, 7, TAG, "", "", 2 * NBYTES,
                               NBYTES, NBYTES)
    assert not started and old.writers == 0 and not old.streams


def test_another_nodes_wait_for_the_deletion_ends_on_its_notice_after_a_save_of_the_step_again(tmp_path, parts):
    """Node 1 (ranks 2 and 3 of 4): step 7's save of ``best`` failed and is over here; rank 2 saves step 7 again
    at once (a new record of the same save); the committer's node deletes the partial directory, its own save
    of step 7 again re-creates it with its part (a marker of step 7 again), then the ``removed`` notice of the
    deletion comes. Right: node 1's wait for the deletion ends on that notice (before the fix: the notice was
    set on the new record, the wait read the directory, saw only step-7 markers and waited the commit
    timeout, 600 s, holding every save of the tag on the node; and the notice marked the new save aborted:
    its parts were not written and its watch failed)."""
    ckpt = str(tmp_path)
    sched, run, partial = _other_node_failed_over(ckpt)  # step 7's save is over here: the wait for the deletion starts
    assert (ckpt, TAG) in sched.discarding
    with sched.lock:  # rank 2 saves step 7 again (the new save's record)
        sched._replace(run, (RUN, 7, TAG))
    shutil.rmtree(partial)  # the committer deletes it, its save of step 7 again re-creates it
    write_part(ckpt, TAG, RUN, 0, 7)
    CommitNotices({}.get, sched.on_notice).receive(RUN, {"op": "commit_ended", "run_id": RUN, "step": 7,
                                                          "dirname": TAG, "gen": 1, "state": "removed"})
    assert wait_until(lambda: (ckpt, TAG) not in sched.discarding, timeout=10), "still waits for the deletion"
    new = sched.results[(RUN, 7, TAG)]  # the notice is not the new save's: not aborted, nothing removed
    assert new.aborted_at is None and not new.removed.is_set() and not sched._commit_over(run, (RUN, 7, TAG))


def test_the_committers_abort_of_a_failed_save_does_not_abort_the_save_of_the_step_again(tmp_path, parts):
    """Node 1 (ranks 2 and 3 of 4): rank 2's part of step 7 failed, so step 7's save failed here at once and
    is over; rank 2 saves step 7 again (a new save of the same step), and only then the committer's node says
    that its commit of step 7 failed (``commit_ended`` ``failed``: it learned of rank 2's failure after node 1
    did). Right: that notice is the failed save's, the new save is not aborted (before the fix: it was
    marked aborted, its part was not written and its watch failed at once with "the committer's node reports
    that the commit failed"); an abort notice after it is the new save's."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt, committer=False, world_size=4, local_ranks=(2, 3))
    new2 = Slot(index=10, path=os.path.join(ckpt, "rank2"), nbytes=NBYTES, state=SlotState.READY, step=7,
                run_id=RUN, dirname=TAG, seq=8)
    sched.slots.ranks[2] = RankEntry(rank=2, slots=[new2], run_id=RUN)
    partial = _old_part(ckpt, 3, 7)
    write_failure_marker(PosixStorage(fsync=False), partial, rank=2, run_id=RUN, step=7,
                         exc=OSError(errno.ENOSPC, "disk full"))
    old = _save(sched, 7, state="failed", writers=1, rank_seq={2: 7, 3: 7},
                part_errors={2: {"type": "OSError", "message": "disk full"}})
    _end_writer(sched, run, ckpt, 3, 7)  # step 7's save is over here
    with sched.lock:
        sched.persist(sched.slots.ranks[2], 7, run)  # rank 2 saves step 7 again
    new = sched.results[(RUN, 7, TAG)]
    assert new is not old
    ended = _committer_says(sched, 7)

    ended("failed", 1)  # the committer's abort of the failed save
    assert new.aborted_at is None and not sched._commit_over(run, (RUN, 7, TAG))
    shutil.rmtree(partial)
    ended("removed", 1)
    assert wait_until(lambda: new.parts_done == {2}, timeout=30), new
    ended("failed", 2)  # the committer's abort of the new save (ends its watch here)
    assert wait_until(lambda: new.state == "failed", timeout=30)
    assert "reports that the commit" in new.error["message"], new.error


def test_a_crash_flush_of_a_one_rank_step_whose_free_space_check_refused_it_writes_it(tmp_path, parts):
    """One rank: its free-space check refused step 2 (``fail_part``: nothing written; a one-rank run starts no
    commit, so that save is over), then the job dies holding step 2 in memory. Right: the crash flush writes
    step 2 (before the fix: the refused save's record, pending forever, read as "its save is already pending",
    and the newest step was not flushed)."""
    ckpt = str(tmp_path)
    sched, run = _one_rank_refused(ckpt)
    with sched.lock:
        assert flush_newest(run, sched.slots, sched, "crashed") == 2
    assert wait_until(lambda: sched.results[(RUN, 2, TAG)].state != "pending", timeout=30)
    res = sched.results[(RUN, 2, TAG)]
    assert res.state == "committed", res.error
    _assert_part(ckpt, TAG, 0, 2)


STALE = [("part_done", None), ("commit_ended", "committed"), ("commit_ended", "failed"),
         ("commit_ended", "removed")]


@pytest.mark.parametrize("op,state", STALE, ids=[s or op for op, s in STALE])
def test_a_notice_about_an_earlier_save_of_the_step_does_not_touch_the_save_of_it_again(tmp_path, parts, op, state):
    """Step 7's save of ``best`` is over on this node and the step is saved again (a new record, its commit
    started); then a peer notice about the earlier save comes: ``part_done`` on the committer's node, the
    committer's ``commit_ended`` (committed, failed, removed) on node 1. Right: the new save is not touched (no
    wake, not aborted, not told committed, nothing removed), a ``removed`` ends node 1's wait for the earlier
    save's deletion, and the same notice about the new save does reach it (before the fix: every notice named
    only run, step and directory and landed on the new save's record: a stale ``committed`` ended its watch as
    committed, a stale abort made it fail and refuse its parts)."""
    ckpt = str(tmp_path)
    key = (RUN, 7, TAG)
    if op == "part_done":  # the committer's node: node 1's notice about its parts of the earlier save
        sched, run = _node(ckpt)
        _save(sched, 7, state="failed", part_errors={0: {"type": "OSError", "message": "disk full"}})
    else:  # node 1: the earlier save failed and is over here, its wait for the committer's deletion runs
        sched, run, partial = _other_node_failed_over(ckpt)
        assert (ckpt, TAG) in sched.discarding
    with sched.lock:
        old = sched.results[key]
        new = sched._replace(run, key)  # the step saved again
        sched.commits_started.add(key)
    assert (old.gen, new.gen) == (1, 2)
    told_committed, local_failure = sched._committed_notice(key), sched._local_failure(key)  # the new commit's
    notices = CommitNotices({}.get, sched.on_notice)

    def notice(gen: int) -> None:
        header = {"op": op, "run_id": RUN, "step": 7, "dirname": TAG, "gen": gen}
        notices.receive(RUN, dict(header, ranks=[2, 3]) if state is None else dict(header, state=state))

    notice(1)
    assert new.notices == 0 and not new.part_ended.is_set()
    assert new.aborted_at is None and new.committed_at is None and not new.removed.is_set()
    assert not sched._commit_over(run, key) and not told_committed() and local_failure() is None
    if state == "removed":  # it reached the earlier save's record, and ended its wait for the deletion
        assert old.removed.is_set()
        assert wait_until(lambda: (ckpt, TAG) not in sched.discarding, timeout=10), "still waits for the deletion"
        assert not old.awaiting_removal
    notice(2)  # the same notice about the save of the step again is its own
    assert new.notices == 1 and new.part_ended.is_set()
    assert (new.committed_at is not None) == (state == "committed") and told_committed() == (state == "committed")
    assert (new.aborted_at is not None) == (state in ("failed", "removed")) and new.removed.is_set() == (
        state == "removed")


def test_a_crash_flush_of_a_failed_save_is_the_next_generation_of_it(tmp_path, parts):
    """The crash flush of a step whose save failed and is over replaces that save's record with the next
    generation (``Scheduler.forget``), as a rank's save of it again does: the failed save's notices on their
    way do not touch the flush."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt, world_size=1, local_ranks=(0,))
    sched.slots.ranks[0] = RankEntry(rank=0, slots=[Slot(index=0, path=os.path.join(ckpt, "rank0"), nbytes=NBYTES,
                                                          state=SlotState.READY, step=7, run_id=RUN, dirname=TAG,
                                                          seq=7)], run_id=RUN)
    old = _save(sched, 7, state="failed", part_errors={0: {"type": "OSError", "message": "disk full"}})
    with sched.lock:
        assert flush_newest(run, sched.slots, sched, "crashed") == 7
    assert sched.results[(RUN, 7, TAG)] is not old and sched.results[(RUN, 7, TAG)].gen == 2
    assert wait_until(lambda: sched.results[(RUN, 7, TAG)].state != "pending", timeout=30)
    assert sched.results[(RUN, 7, TAG)].state == "committed", sched.results[(RUN, 7, TAG)].error


def test_the_committers_abort_of_a_failed_save_does_not_abort_its_crash_flush_on_another_node(tmp_path, parts):
    """Node 1 (ranks 2 and 3 of 4): rank 2's part of step 7 failed, so step 7's save failed here at once and is
    over; the job dies and node 1's crash flush writes step 7 again; only then the committer's abort of the
    failed save comes. Right: the flush is not aborted (its parts are written; the committer's abort of the
    flush, later, is its own). Before the fix the flush's record took that abort: the flush replaced the failed
    save's record without the ``stale_aborts`` mark that a rank's save of it again got, so the flush refused to
    write its parts."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt, committer=False, world_size=4, local_ranks=(2, 3))
    for r in (2, 3):
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[Slot(index=r, path=os.path.join(ckpt, f"rank{r}"),
                                                             nbytes=NBYTES, state=SlotState.READY, step=7, run_id=RUN,
                                                             dirname=TAG, seq=7)], run_id=RUN)
    _save(sched, 7, state="failed", part_errors={2: {"type": "OSError", "message": "disk full"}})
    with sched.lock:
        assert flush_newest(run, sched.slots, sched, "crashed") == 7
    flush = sched.results[(RUN, 7, TAG)]
    ended = _committer_says(sched, 7)

    ended("failed", 1)  # the committer's abort of the failed save
    assert flush.aborted_at is None and not sched._commit_over(run, (RUN, 7, TAG))
    assert wait_until(lambda: flush.parts_done == {2, 3}, timeout=30), flush
    ended("failed", 2)  # the committer's abort of the flush (ends its watch here)
    assert wait_until(lambda: flush.state == "failed", timeout=30)
    sched.pool.shutdown(wait=True)
    sched.syncer.shutdown()


def _first_save_commits(sched: Scheduler, key, first: Result) -> None:
    """The first save of ``key``, in flight with rank 1's writer running, ends committed: that writer ends,
    then the commit (its calls after the end run: deferred saves start)."""
    with sched.lock:
        first.parts_done.add(1)
        first.writers -= 1
        sched.pending -= 1
        first.state = "committed"
        sched._run_over_calls(key, first)


def _saves_of_step_7_again(sched: Scheduler, run: Run, ckpt: str):
    """Ranks 0 and 1 of a node whose first save of step 7 (``TAG``) is in flight, rank 1's slot still read by its
    writer. Returns ``slot(rank, seq)``, a READY snapshot of step 7, and ``persist(rank, slot)``: the rank hands
    it over (a save of step 7 again)."""
    def slot(rank: int, seq: int) -> Slot:
        return Slot(index=100 * rank + seq, path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES,
                    state=SlotState.READY, step=7, run_id=RUN, dirname=TAG, seq=seq)

    def persist(rank: int, s: Slot) -> None:
        with sched.lock:
            sched.slots.ranks[rank].slots.append(s)
            sched.persist(sched.slots.ranks[rank], 7, run)

    sched.slots.ranks[0] = RankEntry(rank=0, slots=[], run_id=RUN)
    sched.slots.ranks[1] = RankEntry(rank=1, slots=[_slot(ckpt, 1, 7)], run_id=RUN)
    return slot, persist


def _first_save_of_step_7_in_flight(ckpt: str):
    """Two connected local ranks (their handles may still ask: the saves they took part in are kept for them) whose
    first save of step 7 (``TAG``) is in flight: rank 0's part written, rank 1's writer runs. Returns ``(sched, run,
    key, slot, persist, first)`` (``slot``, ``persist``: :func:`_saves_of_step_7_again`; ``first``: that save)."""
    sched, run = _node(ckpt)
    run.connected = {0, 1}
    slot, persist = _saves_of_step_7_again(sched, run, ckpt)
    first = _save(sched, 7, writers=1, rank_seq={0: 7, 1: 7}, parts_done={0})
    return sched, run, (RUN, 7, TAG), slot, persist, first


def test_each_handle_of_a_step_saved_three_times_gets_its_own_saves_outcome(tmp_path, parts):
    """Two local ranks; step 7 of ``best`` saved three times back to back by rank 0, rank 1 slower: the first
    save fails (rank 1's part), rank 0's second save waits for it (deferred) and then starts, rank 0's third
    save waits for the second (deferred again), which commits once rank 1's part of it comes; then the third
    starts. Right: each handle (its status names its snapshot) hears its own save's outcome: the first save's
    failure, the second's commit, also for rank 1, which has not handed over its part of the third save yet.
    Before the fix the scheduler kept only the one save the newest had replaced, and took a rank absent from
    the newest save for one of it: the first handles, not polled meanwhile, were answered with the third save's
    state (the failure lost), and rank 1's second handle with the third save's ``pending``: a ``wait()`` on it
    before rank 1's next save blocks until the third save's commit times out, then raises that failure."""
    ckpt = str(tmp_path)
    sched, run, key, slot, persist, first = _first_save_of_step_7_in_flight(ckpt)
    try:
        persist(0, slot(0, 8))  # rank 0's second save: waits for the first
        assert sched.results[key] is first and first.deferred == {0}
        with sched.lock:  # the first save fails: rank 1's writer ends with an error, the commit fails
            first.part_errors[1] = {"type": "OSError", "message": "disk full"}
            first.writers -= 1
            sched.pending -= 1
            first.state = "failed"
            first.error = {"type": "OSError", "message": "disk full"}
            sched._run_over_calls(key, first)
        assert wait_until(lambda: sched.results[key] is not first and sched.results[key].parts_done == {0},
                          timeout=30)
        second = sched.results[key]
        persist(0, slot(0, 9))  # rank 0's third save: waits for the second (rank 1's part of it not there yet)
        assert sched.results[key] is second and second.deferred == {0}
        persist(1, slot(1, 8))  # rank 1's part of the second save: it commits, then the third save starts
        assert wait_until(lambda: sched.results[key] is not second and sched.results[key].parts_done == {0},
                          timeout=30)
        assert second.state == "committed", second.error
        third = sched.results[key]
        assert third.rank_seq == {0: 9}
        assert sched.result(key, 0, 9) is third and sched.result(key, 0, 8) is second
        assert sched.result(key, 1, 8) is second
        got = sched.result(key, 0, 7)
        assert got is first, f"the first save's handle is answered with {got.state!r} (gen {got.gen}), not its failure"
        assert sched.result(key, 1, 7) is first
        persist(1, slot(1, 9))
        assert wait_until(lambda: third.state != "pending", timeout=30)
        assert third.state == "committed", third.error
    finally:
        with sched.lock:
            for res in [sched.results.get(key)]:
                if res is not None and res.state == "pending":
                    res.part_errors.setdefault(1, {"type": "OSError", "message": "test over"})
                    res.part_ended.set()
            sched.ended.notify_all()
        sched.pool.shutdown(wait=False)


def test_a_rank_ahead_by_two_saves_of_a_step_does_not_mix_its_third_save_into_the_second(tmp_path, parts):
    """Two local ranks; step 7 of ``best`` saved three times back to back (the engine no longer waits on the
    training thread), rank 0 ahead: it hands over its second and third snapshot (seq 8, 9) while the first save
    is still in flight (rank 1's writer runs); rank 1 hands over its second and third (seq 18, 19) later. Right:
    the second save commits rank 0's second snapshot with rank 1's second, the third rank 0's third with rank
    1's third. Before the fix rank 0's waiting save took its newest snapshot (its third) when the first save
    ended: the second save committed rank 0's third part with rank 1's second (a mix of two saves), and rank
    1's third save then waited for a part of rank 0 that never comes (until the commit timeout, then failed)."""
    ckpt = str(tmp_path)
    sched, run, key, slot, persist, first = _first_save_of_step_7_in_flight(ckpt)
    try:
        persist(0, slot(0, 8))
        persist(0, slot(0, 9))  # rank 0 is two saves ahead
        assert sched.results[key] is first
        _first_save_commits(sched, key, first)  # rank 1's writer ends, then the commit
        assert wait_until(lambda: sched.results[key] is not first, timeout=30)
        second = sched.results[key]
        persist(1, slot(1, 18))  # rank 1's second save
        assert wait_until(lambda: second.state != "pending", timeout=30)
        assert second.rank_seq == {0: 8, 1: 18}, f"the second save committed the parts {second.rank_seq}"
        persist(1, slot(1, 19))  # rank 1's third save
        assert wait_until(lambda: sched.results[key] is not second
                          and sched.results[key].state != "pending", timeout=30), \
            f"the third save waits for rank 0: {sched.results[key]}"
        third = sched.results[key]
        assert third.state == "committed" and third.rank_seq == {0: 9, 1: 19}, third
        for r in (0, 1):
            assert sched.result(key, r, 7) is first
        assert sched.result(key, 0, 8) is second and sched.result(key, 0, 9) is third
    finally:
        with sched.lock:
            res = sched.results.get(key)
            if res is not None and res.state == "pending":
                res.part_errors.setdefault(1, {"type": "OSError", "message": "test over"})
                res.part_errors.setdefault(0, {"type": "OSError", "message": "test over"})
                res.part_ended.set()
            sched.ended.notify_all()
        sched.pool.shutdown(wait=False)


def test_a_retried_step_refused_again_before_the_persister_fails_its_save_at_once(tmp_path, parts):
    """Two local ranks, one node: rank 1 handed over its part of step 7 of ``best``, the free-space check of
    rank 0 refused it (``fail_part``), the save failed. The step is retried and rank 0's check refuses it again before
    rank 1 hands over its new snapshot. Right: the retry fails at once on rank 0's error, as the first save did.
    Before the fix ``fail_part`` put the error on the ended first save's record (not a new save of the step:
    no commit started for it either), rank 1's part then started a new save without it, and that commit waited
    for rank 0's part, which never comes (one node: no failure marker either), until the commit timeout."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    run.connected = {0, 1}
    key = (RUN, 7, TAG)
    refused = {"type": "InsufficientDiskError", "message": "no room"}

    def ready(seq: int) -> None:
        s = Slot(index=100 + seq, path=os.path.join(ckpt, "rank1"), nbytes=NBYTES, state=SlotState.READY,
                 step=7, run_id=RUN, dirname=TAG, seq=seq)
        with sched.lock:
            sched.slots.ranks[1].slots.append(s)
            sched.persist(sched.slots.ranks[1], 7, run)

    sched.slots.ranks[1] = RankEntry(rank=1, slots=[], run_id=RUN)
    try:
        ready(7)
        sched.fail_part(0, run, 7, TAG, refused)
        assert wait_until(lambda: sched.results[key].state != "pending", timeout=30)
        first = sched.results[key]
        assert first.state == "failed"
        assert wait_until(lambda: first.writers == 0 and not sched.discarding, timeout=30)
        sched.fail_part(0, run, 7, TAG, refused)  # the retry: refused again, before rank 1's part
        ready(8)
        retry = sched.results[key]
        assert retry is not first and retry.rank_seq == {1: 8}
        assert wait_until(lambda: retry.state != "pending", timeout=30), \
            "the retry's commit waits for rank 0's part, refused before the persister"
        assert retry.state == "failed" and "no room" in json.dumps(retry.error), retry.error
        assert sched.result(key, 1, 8) is retry and sched.result(key, 1, 7) is first
    finally:
        _end_pending(sched, key)


def test_a_retry_refused_while_the_first_save_of_the_step_is_in_flight_does_not_fail_that_save(tmp_path, parts):
    """Two local ranks: the first save of step 7 of ``best`` is in flight (rank 0's part written, rank 1's
    writer still runs) when rank 0 saves step 7 again and its free-space check refuses it (``fail_part``).
    Right: the first save is untouched and commits once rank 1's part ends; the refusal is the retry's, which
    fails at once when rank 1 hands over its part of it. Before the fix the refusal went onto the first save's
    record: its commit failed on a part that had been written."""
    ckpt = str(tmp_path)
    sched, run, key, slot, persist, first = _first_save_of_step_7_in_flight(ckpt)
    try:
        sched.fail_part(0, run, 7, TAG, {"type": "InsufficientDiskError", "message": "no room"})
        assert not first.part_errors, "the retry's refusal fails the first save"
        with sched.lock:  # rank 1's part of the first save ends written; its commit ends committed
            first.parts_done.add(1)
            first.writers -= 1
            sched.pending -= 1
            first.state = "committed"
            sched._run_over_calls(key, first)
        retry = sched.results[key]
        assert retry is not first and set(retry.part_errors) == {0}
        persist(1, slot(1, 8))
        assert wait_until(lambda: retry.state != "pending", timeout=30)
        assert retry.state == "failed" and "no room" in json.dumps(retry.error), retry.error
        assert first.state == "committed" and sched.result(key, 1, 7) is first
    finally:
        _end_pending(sched, key)


def test_a_rank_whose_part_came_after_the_save_failed_joins_the_save_of_the_step_again(tmp_path, parts):
    """Two local ranks: rank 0's free-space check refused step 7 of ``best`` (``fail_part``) and the save failed
    at once, before rank 1 handed over its part (a late part: not written). Step 7 is saved again, rank 1 first
    (rank 0's disk has room now). Right: rank 1's part is the retry's, which commits; rank 1's handle of its
    first snapshot still hears the failure. Before the fix the late part left no trace in the failed save's
    record: rank 1's next part was taken for another late part of it and dropped, and rank 0's then started
    the retry, whose commit waited for rank 1's part until the commit timeout."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    run.connected = {0, 1}
    key = (RUN, 7, TAG)
    slot, persist = _saves_of_step_7_again(sched, run, ckpt)
    sched.slots.ranks[1].slots.clear()
    try:
        sched.fail_part(0, run, 7, TAG, {"type": "InsufficientDiskError", "message": "no room"})
        assert wait_until(lambda: sched.results[key].state == "failed", timeout=30)
        first = sched.results[key]
        persist(1, slot(1, 7))  # the late part
        assert wait_until(lambda: not sched.discarding and first.writers == 0, timeout=30)
        persist(1, slot(1, 8))  # the retry, rank 1 first
        persist(0, slot(0, 8))
        retry = sched.results[key]
        assert retry is not first
        assert wait_until(lambda: retry.state != "pending", timeout=30), \
            f"the retry waits for rank 1's part (it holds {sorted(retry.rank_seq)})"
        assert retry.state == "committed", retry.error
        assert sched.result(key, 1, 7) is first and sched.result(key, 1, 8) is retry
        _assert_part(ckpt, TAG, 1, 7)
    finally:
        _end_pending(sched, key, rank=1)
