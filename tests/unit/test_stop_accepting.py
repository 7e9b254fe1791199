"""A persister sent SIGTERM takes no more requests (``Scheduler.stop_accepting``): a commit that waits for the part
of a local rank that never handed it over fails at once, naming that rank, instead of at ``commit_timeout_secs``
(600 s by default: a new-user trial's persister did not stop within 15 s of SIGTERM, nor ``snapckpt stop`` within
30 s); a part already handed over is still written and its save committed. The real signal is
tests/test_hung_persister.py's."""
from __future__ import annotations

import os

import pytest
from _harness import wait_until
from _sched_rig import NBYTES, node, stub_slot_reads

from snapckpt.persister.arena import SlotState
from snapckpt.persister.slots import RankEntry, Slot

RUN = "e" * 16 + "0123456789ab"
STEP = 5


@pytest.fixture
def parts(monkeypatch):
    stub_slot_reads(monkeypatch)


def _hand_over(sched, run, ckpt, rank):
    s = Slot(index=rank, path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES, state=SlotState.READY, step=STEP,
             run_id=RUN, dirname=f"step_{STEP}", seq=1)
    with sched.lock:
        sched.slots.ranks[rank].slots.append(s)
        sched.persist(sched.slots.ranks[rank], STEP, run, slot=s)


def _node(ckpt):
    sched, run = node(RUN, ckpt)  # commit_timeout_secs=600
    run.connected = {0, 1}
    for r in (0, 1):
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[], run_id=RUN)
    return sched, run


def test_a_commit_waiting_for_a_rank_that_never_handed_over_fails_when_the_persister_stops(tmp_path, parts):
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    _hand_over(sched, run, ckpt, 0)
    res = sched.results[(RUN, STEP, f"step_{STEP}")]
    assert wait_until(lambda: 0 in res.parts_done, timeout=30), res
    assert res.state == "pending"  # rank 1's part is missing: the commit waits for it
    sched.stop_accepting()
    assert wait_until(lambda: res.state != "pending", timeout=30), res  # before: 600 s
    assert res.state == "failed", res
    assert "stopped (SIGTERM) before ranks [1]" in res.error["message"], res.error
    assert not os.path.exists(os.path.join(ckpt, f"step_{STEP}"))  # nothing committed
    sched.shutdown()


def test_a_save_whose_parts_are_all_handed_over_still_commits_after_the_stop(tmp_path, parts):
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    with sched.lock:  # both parts in hand before the stop (after it, no part is handed over any more)
        _hand_over(sched, run, ckpt, 0)
        _hand_over(sched, run, ckpt, 1)
    sched.stop_accepting()  # their writers and the commit may still be running
    res = sched.results[(RUN, STEP, f"step_{STEP}")]
    assert wait_until(lambda: res.state != "pending", timeout=30), res
    assert res.state == "committed", res
    assert {"rank0.bin", "rank1.bin"} <= set(os.listdir(os.path.join(ckpt, f"step_{STEP}")))
    sched.shutdown()
