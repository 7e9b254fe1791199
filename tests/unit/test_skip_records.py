"""A save that a rank skips (``on_slot_busy="skip"``) is skipped on every rank: the scheduler's records, with real
writer and commit tasks (the slot reads stubbed, as in tests/unit/test_resave_after_failure.py). The rank's skip
reaches its persister as ``fail`` with a :class:`SaveSkippedError` record (``Scheduler.fail_part``); it counts as
that rank's save of the step and directory, so that every rank's k-th save of them is the k-th save on every
node, whatever order the ranks come in. The multi-process tests are tests/test_skip_collective.py and
tests/test_multinode.py.
"""
from __future__ import annotations

import os

import pytest
from _harness import wait_until
from _sched_rig import NBYTES, node, stub_slot_reads

from snapckpt.errors import SaveSkippedError
from snapckpt.ondisk.manifest import partial_dirname
from snapckpt.persister import protocol as P
from snapckpt.persister.arena import SlotState
from snapckpt.persister.commit_notices import CommitNotices
from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.slots import RankEntry, Run, Slot

RUN = "d" * 16 + "0123456789ab"
TAG, STEP = "best", 7
KEY = (RUN, STEP, TAG)
SKIP = P.error_record(SaveSkippedError("rank 1 had no free arena slot for step 7 (on_slot_busy='skip')"))


@pytest.fixture
def parts(monkeypatch):
    stub_slot_reads(monkeypatch)


def _node(ckpt: str, committer: bool = True, world_size: int = 2, local_ranks=(0, 1)):
    sched, run = node(RUN, ckpt, committer, world_size, local_ranks)
    run.connected = set(local_ranks)
    for r in local_ranks:
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[], run_id=RUN)
    return sched, run


def _hand_over(sched: Scheduler, run: Run, ckpt: str, rank: int, seq: int) -> Slot:
    """Rank ``rank`` hands its snapshot ``seq`` of step 7 (tag ``best``) over for DISK."""
    s = Slot(index=seq, path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES, state=SlotState.READY, step=STEP,
             run_id=RUN, dirname=TAG, seq=seq)
    with sched.lock:
        sched.slots.ranks[rank].slots.append(s)
        sched.persist(sched.slots.ranks[rank], STEP, run, slot=s)
    return s


def _ended(sched: Scheduler, res: Result) -> None:
    assert wait_until(lambda: res.state != "pending" and res.writers == 0, timeout=30), res
    sched.syncer.shutdown()
    sched.remove_pool.shutdown(wait=True)


def test_a_rank_that_skips_a_step_saved_again_fails_the_next_save_not_the_one_it_took_part_in(tmp_path, parts):
    """Step 7 of ``best`` was saved (committed) by both ranks; both save it again and rank 1 skips that second save.
    Right: the skip is a new save (generation 2), which ends skipped, and rank 0's second part joins it (its status
    reads the skip); the committed save keeps its outcome. Before, the skip was recorded on the committed save."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    with sched.lock:
        first = sched.results[KEY] = Result(state="committed", rank_seq={0: 1, 1: 2}, parts_done={0, 1})
        sched.fail_part(1, run, STEP, TAG, SKIP)
    second = sched.results[KEY]
    assert second is not first and second.gen == 2 and first.state == "committed" and not first.part_errors
    _hand_over(sched, run, ckpt, 0, 3)
    _ended(sched, second)
    assert second.state == "failed" and second.error["type"] == "SaveSkippedError", second.error
    assert "rank 1 had no free arena slot" in second.error["message"]
    assert sched.result(KEY, 0, 3) is second and sched.result(KEY, 0, 1) is first
    assert not os.path.exists(os.path.join(ckpt, TAG))


def test_a_skip_while_the_ranks_earlier_save_of_the_step_is_in_flight_waits_for_it(tmp_path, parts):
    """Rank 1's first save of step 7 is in flight (its writer runs) when it skips the second. Right: the skip
    waits for the first save to be over here, then is the second save (before, it failed the first one)."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    with sched.lock:
        first = sched.results[KEY] = Result(state="committed", rank_seq={0: 1, 1: 2}, parts_done={0}, writers=1)
        sched.results.track(KEY)
        sched.fail_part(1, run, STEP, TAG, SKIP)
        assert sched.results[KEY] is first and not first.part_errors  # deferred
        first.writers = 0
        sched._run_over_calls(KEY, first)  # its last writer ended
    second = sched.results[KEY]
    assert second.gen == 2 and second.part_errors == {1: SKIP}
    _ended(sched, second)
    assert second.error["type"] == "SaveSkippedError"


def test_a_rank_behind_a_skipped_save_pairs_with_the_others_next_save(tmp_path, parts):
    """Rank 1 skips the first save of step 7 (it ends at once) and hands its second snapshot over before rank 0's
    first one comes. Right: rank 0's first snapshot is its part of the skipped save (not written; its status
    reads the skip), and its second one joins rank 1's second: that save commits with both second snapshots.
    Before, rank 0's first snapshot was paired with rank 1's second."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    with sched.lock:
        sched.fail_part(1, run, STEP, TAG, SKIP)
    skipped = sched.results[KEY]
    assert wait_until(lambda: skipped.state == "failed", timeout=30)
    _hand_over(sched, run, ckpt, 1, 9)  # rank 1's second save
    second = sched.results[KEY]
    assert second is not skipped and second.gen == 2
    _hand_over(sched, run, ckpt, 0, 8)  # rank 0's first save, late
    assert sched.results[KEY] is second and 0 not in second.rank_seq
    assert skipped.rank_seq == {0: 8} and skipped.late == {0} and sched.result(KEY, 0, 8) is skipped
    assert (STEP, TAG) not in sched.pending_parts(run, 0)  # (a part not written: not pending for its rank)
    _hand_over(sched, run, ckpt, 0, 10)  # rank 0's second save
    _ended(sched, second)
    assert second.state == "committed", second.error
    assert second.rank_seq == {0: 10, 1: 9} and sched.result(KEY, 0, 10) is second


@pytest.mark.parametrize("removed", [True, False], ids=["removed_said", "removal_not_said_yet"])
def test_another_node_that_hears_the_skip_before_its_rank_comes_writes_nothing(tmp_path, parts, removed):
    """Node 1 (rank 1 of 2): the committer's rank skipped step 7 and the committer ended that save, sending its
    abort notice (with the skip's record) before rank 1 handed its snapshot over here. Right: rank 1's part is not
    written (the committer deleted, or deletes, the partial directory: a part written now would re-create it, and
    a save of it again would count it), its status reads the skip; its next save of step 7 is a new save, written
    (once the committer's deletion is known ended: said, or the directory seen gone). Before, the notice was
    dropped: the part was written and the watch waited for a commit that never came."""
    ckpt = str(tmp_path)
    sched, run = _node(ckpt, committer=False, local_ranks=(1,))
    notices = CommitNotices({}.get, sched.on_notice)
    notices.receive(RUN, {"op": "commit_ended", "run_id": RUN, "step": STEP, "dirname": TAG, "gen": 1,
                          "state": "failed", "error": SKIP})
    if removed:
        notices.receive(RUN, {"op": "commit_ended", "run_id": RUN, "step": STEP, "dirname": TAG, "gen": 1,
                              "state": "removed"})
    assert KEY not in sched.results
    _hand_over(sched, run, ckpt, 1, 5)
    first = sched.results[KEY]
    assert first.state == "failed" and first.error["type"] == "SaveSkippedError" and first.writers == 0
    assert sched.result(KEY, 1, 5) is first and not sched.aborts_ahead
    partial = os.path.join(ckpt, partial_dirname(TAG, RUN))
    assert not os.path.exists(partial)
    _hand_over(sched, run, ckpt, 1, 6)  # its next save of step 7
    second = sched.results[KEY]
    assert second is not first and second.gen == 2
    assert wait_until(lambda: 1 in second.parts_done, timeout=30), second
    assert os.path.isfile(os.path.join(partial, "rank1.bin"))


def test_a_commit_notice_carries_the_error_of_a_skipped_save():
    """``commit_ended`` sends the failed commit's error record when given (a skipped save's), and the receiver
    passes it on; a notice without one passes none."""
    got = []
    notices = CommitNotices({}.get, lambda *a, **k: got.append((a, k)))
    header = {"op": "commit_ended", "run_id": RUN, "step": STEP, "dirname": TAG, "gen": 2, "state": "failed"}
    notices.receive(RUN, dict(header, error=SKIP))
    notices.receive(RUN, header)
    assert got[0] == ((RUN, STEP, TAG, 2), {"aborted": True, "committed": False,
                                           "error": {"type": "SaveSkippedError", "message": SKIP["message"]}})
    assert got[1] == ((RUN, STEP, TAG, 2), {"aborted": True, "committed": False})


def test_a_crash_flush_writes_a_rank_that_took_no_part_in_the_failed_save_it_replaces(tmp_path, parts):
    """Node 1 (ranks 2 and 3 of 4): step 7's save failed here before rank 3 handed its part over (rank 2's part
    failed), and the wait for the committer's deletion of it still runs; the job dies and node 1's crash flush
    writes step 7 again. Right: both ranks' parts of the flush are written: a flush writes every local rank's
    newest snapshot, none is a late part of the failed save (the rule that a rank behind a save gives its part to
    it is about the ranks' own saves only)."""
    from snapckpt.persister.flush import flush_newest

    ckpt = str(tmp_path)
    sched, run = _node(ckpt, committer=False, world_size=4, local_ranks=(2, 3))
    for r in (2, 3):
        sched.slots.ranks[r].slots.append(Slot(index=r, path=os.path.join(ckpt, f"rank{r}"), nbytes=NBYTES,
                                               state=SlotState.READY, step=STEP, run_id=RUN, dirname=TAG, seq=7))
    with sched.lock:
        sched.results[KEY] = Result(state="failed", part_errors={2: {"type": "OSError", "message": "disk full"}},
                                    awaiting_removal=True)
        assert flush_newest(run, sched.slots, sched, "crashed") == STEP
    flush = sched.results[KEY]
    assert flush.gen == 2 and len(sched.results.records(KEY)) == 2
    assert wait_until(lambda: flush.parts_done == {2, 3}, timeout=30), flush
    sched.pool.shutdown(wait=True)
    sched.syncer.shutdown()
