"""The self-retirement of a late commit (contract 5, ``commit.retire_after_answer``), on the committer's
scheduler: a commit that ended behind a later save's commit, beyond the newest ``keep_last``, is retired by
its own retention once its answer is out. Two orders where that retirement must not run at once:

- the commit is not behind any later save of this run (an earlier run's checkpoint merely sorts after it in
  save order: that run's node clock was ahead). It is the newest save; the tracker names it;
- another node's watcher has not read its manifest and the committer's ``committed`` notice did not reach
  that node (a lost notice costs only latency, contract 4): it must still find the manifest on its own
  backstop read, not take the commit for aborted.

The commit tasks run synchronously here (``Scheduler._commit_task``), in the order the test gives.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from snapckpt.ondisk.manifest import MANIFEST, SIDECAR, build_manifest, part_marker_name, partial_dirname
from snapckpt.persister.commit import CommitRequest, watch_commit
from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.slots import Run, SlotTable
from snapckpt.storage.posix import PosixStorage

RUN = "k" * 16 + "0123456789ab"
OLD_RUN = "k" * 16 + "ba9876543210"


def _dirname(step: int) -> str:
    return f"step_{step:08d}"


def _parts(ckpt: str, step: int, ranks, dirname: str = "") -> None:
    """The parts of ``ranks`` of ``step`` (run RUN) into ``dirname``'s partial directory (default: the step's),
    written as the writers leave them."""
    partial = os.path.join(ckpt, partial_dirname(dirname or _dirname(step), RUN))
    os.makedirs(os.path.join(partial, SIDECAR), exist_ok=True)
    for r in ranks:
        name = f"rank_{r:05d}.pt"
        open(os.path.join(partial, name), "wb").close()
        marker = {"rank": r, "run_id": RUN, "step": step,
                  "files": {name: {"nbytes": 0, "xxh3_64": "0", "kind": "torch"}}}
        with open(os.path.join(partial, part_marker_name(r)), "w") as f:
            json.dump(marker, f)


def _committer(ckpt: str, world_size: int, notices=None):
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    sched.notices = notices
    run = Run(run_id=RUN, world_size=world_size, local_ranks=[0], committer=True, checkpoint_dir=ckpt,
              keep_last=1, commit_timeout_secs=10.0, flush_on_crash=False, fsync=False)
    return sched, run


def _request(sched: Scheduler, run: Run, step: int, dirname: str = "") -> CommitRequest:
    """Save ``step`` (into ``dirname``, default the step's) as ``Scheduler._start_commit`` records it (in flight
    from now), without its task."""
    key = (RUN, step, dirname or _dirname(step))
    with sched.lock:
        sched.results[key] = Result()
        sched.commit_seq += 1
        with sched.committing_lock:
            mine = sched.committing.setdefault(run.checkpoint_dir, {})
            mine[key[2]] = mine.get(key[2], 0) + 1
        sched.pending += 1
        req = CommitRequest(checkpoint_dir=run.checkpoint_dir, dirname=key[2], step=step, run_id=RUN,
                            world_size=run.world_size, timeout_secs=10.0, keep_last=run.keep_last,
                            tracker_name="latest", tracker_content=key[2],
                            tracker_gate=sched._tracker_gate(run.checkpoint_dir, "latest", sched.commit_seq),
                            in_flight=lambda: sched._committing(run.checkpoint_dir))
        return req, sched.commit_seq


def _tracker(ckpt: str) -> str:
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read()


def test_the_newest_save_is_never_retired_by_its_own_retention_behind_an_earlier_runs_later_stamp(tmp_path):
    """An earlier run of the job committed step 9 on a node whose clock was an hour ahead (its save order is
    later than anything this run saves for an hour). This run commits step 10 with ``keep_last=1``: nothing
    this run saved is newer, the tracker names step 10. Right: step 10 stays (as before the late
    self-retirement: its own retention protects it) and ``latest`` names a directory that exists. Before
    the fix: step 10 was retired right after its answer, ``latest`` named a missing directory."""
    ckpt = str(tmp_path)
    old = os.path.join(ckpt, _dirname(9))
    os.makedirs(os.path.join(old, SIDECAR))
    m = build_manifest(step=9, dirname=_dirname(9), world_size=1, requested_unix=time.time() + 3600,
                       run_id=OLD_RUN, parts={0: {}})
    with open(os.path.join(old, MANIFEST), "w") as f:
        json.dump(m, f)
    sched, run = _committer(ckpt, world_size=1)
    req, seq = _request(sched, run, 10)
    _parts(ckpt, 10, [0])
    sched._commit_task(req, run, seq)
    assert sched.results[(RUN, 10, _dirname(10))].state == "committed"
    assert _tracker(ckpt) == _dirname(10)
    assert os.path.isfile(os.path.join(ckpt, _dirname(10), MANIFEST))


class _Notices:
    """The committer's commit notices, as far as the scheduler uses them: ``commit_ended`` records the notice
    and reports it delivered to every other node or not (``delivered`` callback, when asked)."""

    def __init__(self, delivered: bool) -> None:
        self.ok, self.sent = delivered, []

    def commit_ended(self, run_id, step, dirname, gen, state, delivered=None):
        self.sent.append((step, state))
        if delivered is not None:
            delivered(self.ok)

    def forget(self, run_id):
        pass


class _SeesPartial(PosixStorage):
    """Sets ``seen`` once the watcher found ``partial`` there (its watch then knows the save was under way)."""

    def __init__(self, partial: str) -> None:
        super().__init__(fsync=False)
        self.partial, self.seen = partial, threading.Event()

    def isdir(self, path: str) -> bool:
        out = super().isdir(path)
        if out and path == self.partial:
            self.seen.set()
        return out


@pytest.mark.parametrize("delivered", [False, True], ids=["notice_lost", "notice_delivered"])
def test_a_late_commit_is_retired_only_once_every_watcher_can_know_it_committed(tmp_path, delivered):
    """Two nodes (rank 0 on the committer's, rank 1 on node 1), ``keep_last=1``. Step 2 commits first, then
    step 1 (held behind it). Node 1 watches step 1's commit; the committer's ``committed`` notice to node 1
    is lost (``notice_lost``) or delivered. Right: with the notice lost, step 1 stays in place (the next
    commit's retention retires it) and node 1's watch reads its manifest on its backstop read; with the notice
    delivered, step 1 is retired right after its answer (node 1 ends on the notice). Before the fix, with
    the notice lost, step 1 was retired right after its answer and node 1 took the commit for aborted
    (``CommitError``) while rank 0 had it committed."""
    ckpt = str(tmp_path)
    notices = _Notices(delivered)
    sched, run = _committer(ckpt, world_size=2, notices=notices)
    req1, seq1 = _request(sched, run, 1)
    req2, seq2 = _request(sched, run, 2)
    for step in (1, 2):
        _parts(ckpt, step, [0, 1])
    # node 1's watch of step 1 (its own scheduler would answer committed_notice from the notice)
    reader = _SeesPartial(req1.partial_dir)
    notice = threading.Event()  # node 1's record of the committer's committed notice of step 1
    watch_req = CommitRequest(checkpoint_dir=ckpt, dirname=_dirname(1), step=1, run_id=RUN, world_size=2,
                              timeout_secs=10.0, keep_last=1, tracker_name="", tracker_content="",
                              committed_notice=notice.is_set)
    out = {}

    def watch():
        try:
            out["manifest"] = watch_commit(reader, watch_req)
        except BaseException as e:  # checked below
            out["error"] = e

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert reader.seen.wait(10)
    sched._commit_task(req2, run, seq2)
    sched._commit_task(req1, run, seq1)
    assert notices.sent == [(2, "committed"), (1, "committed")]
    assert _tracker(ckpt) == _dirname(2)
    if delivered:  # node 1 receives it: recorded, and the watch woken
        notice.set()
        watch_req.wake.set()
    t.join(30)
    assert not t.is_alive()
    assert "error" not in out, out
    if delivered:
        assert not os.path.exists(os.path.join(ckpt, _dirname(1)))
        assert out["manifest"] is None or out["manifest"]["step"] == 1
    else:
        assert out["manifest"]["step"] == 1
        assert os.path.isdir(os.path.join(ckpt, _dirname(1)))  # left for the next commit's retention
        req3, seq3 = _request(sched, run, 3)
        _parts(ckpt, 3, [0, 1])
        sched._commit_task(req3, run, seq3)
        assert sorted(n for n in os.listdir(ckpt) if n.startswith("step_")) == [_dirname(3)]


def test_a_late_commit_of_a_tag_saved_again_meanwhile_is_not_retired_under_the_new_save(tmp_path):
    """Fixed tags, ``keep_last=1``: tag ``a`` saved at step 1 (its commit ends late), ``b`` at step 2 (commits
    first), ``a`` again at step 3 (requested before step 1's commit ended; it writes once that is over). Step
    1's commit ends behind step 2's, but its self-retirement finds ``a`` in flight again (step 3): ``a`` stays,
    and step 3 commits into it; then ``b`` is the one beyond keep_last. Held before the fix too."""
    ckpt = str(tmp_path)
    sched, run = _committer(ckpt, world_size=1)
    a1, seq1 = _request(sched, run, 1, "a")
    b2, seq2 = _request(sched, run, 2, "b")
    a3, seq3 = _request(sched, run, 3, "a")
    _parts(ckpt, 1, [0], "a")
    _parts(ckpt, 2, [0], "b")
    sched._commit_task(b2, run, seq2)
    sched._commit_task(a1, run, seq1)
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".") and n != "latest") == ["a", "b"]
    _parts(ckpt, 3, [0], "a")
    sched._commit_task(a3, run, seq3)
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".") and n != "latest") == ["a"]
    with open(os.path.join(ckpt, "a", MANIFEST)) as f:
        assert json.load(f)["step"] == 3
    assert _tracker(ckpt) == "a"
