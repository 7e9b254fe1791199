"""The persister's save records: the in-flight index its waits read, and the pruning of ended records.

A job saving every few steps for weeks leaves 100,000 records; before the index, every writer and every commit
read all of them (``Scheduler._wait_for_directory``: 18 ms per wait at 100,000), and they were never dropped.
The index must give exactly the waits of that scan (only saves of the same run and directory, in flight, and
recorded before the waiting one), and pruning must keep what a rank can still ask about.
"""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace
from typing import List

import pytest

from snapckpt.persister.scheduler import KEEP_ENDED, Result, Scheduler
from snapckpt.persister.server import Server
from snapckpt.persister.slots import RankEntry, Run, SlotTable

RUN = "a" * 16 + "0123456789ab"
OTHER = "b" * 16 + "0123456789ab"


@pytest.fixture
def node():
    """A scheduler (no task is started by these tests) and a one-node, two-rank run of it, both ranks
    connected."""
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    run = Run(run_id=RUN, world_size=2, local_ranks=[0, 1], committer=True, checkpoint_dir="/nonexistent",
              keep_last=None, commit_timeout_secs=60.0, flush_on_crash=False, fsync=False, connected={0, 1})
    yield sched, run
    for pool in (sched.pool, sched.commit_pool, sched.remove_pool):
        pool.shutdown()
    sched.syncer.shutdown()
    sched.uploader.shutdown()


def _scan(sched: Scheduler, key) -> List[int]:
    """The waits of ``key`` as the scan before the index found them: every record in ``results`` order up to
    ``key``'s, of its run and directory, with a writer running or a commit started and not ended."""
    earlier = []
    for k, r in sched.results.items():
        if k == key:
            break
        if k[2] == key[2] and k[0] == key[0] and (
                r.writers > 0 or (r.state == "pending" and k in sched.commits_started)):
            earlier.append(k[1])
    return earlier


def _ended(sched: Scheduler, key, state: str = "committed", ranks=(0, 1)) -> Result:
    """A save ``key`` whose parts of ``ranks`` were written and whose commit ended ``state``, as the tasks leave
    it (the commit's end goes through the scheduler's end hook)."""
    res = sched.results.setdefault(key, Result())
    sched.commits_started.add(key)
    for r in ranks:
        res.rank_seq[r] = key[1]
        res.parts_done.add(r)
    res.state = state
    sched._run_over_calls(key, res)
    return res


def test_the_in_flight_index_gives_the_waits_of_the_scan(node):
    """Random histories of two runs and three directories, through the scheduler's own steps (a record made,
    writers started and ended, commits started and ended, a failed save replaced by a save of its step again,
    a record forgotten by the crash flush, one deleted and made again): after every step, every key's waits (and
    those of keys with no record) are the scan's."""
    sched, run = node
    rng = random.Random(7)
    keys = [(rid, step, d) for rid in (RUN, OTHER) for step in range(6) for d in ("best", "step_x", "latest")]
    with sched.lock:
        for i in range(3000):
            key = rng.choice(keys)
            res = sched.results.get(key)
            op = rng.random()
            if res is None:
                res = sched.results.setdefault(key, Result())  # persist / stream / fail_part
                if op < 0.5:
                    res.writers += 1
                    sched.results.track(key)
                if op < 0.8:
                    sched.commits_started.add(key)  # (_start_commit)
                    sched.results.track(key)
            elif op < 0.25 and res.state == "pending":
                res.writers += 1  # another rank's writer
                sched.results.track(key)
            elif op < 0.5 and res.writers > 0:
                res.writers -= 1  # a writer ended (_part_ended)
                sched._run_over_calls(key, res)
            elif op < 0.7 and res.state == "pending" and key in sched.commits_started:
                res.state = rng.choice(["committed", "failed"])  # the commit ended (_commit_task)
                sched._run_over_calls(key, res)
            elif op < 0.8 and not sched._in_flight(key, res):
                sched._replace(run, key)  # a save of the step again
            elif op < 0.87:
                sched.forget(key)  # the crash flush
            elif op < 0.9:
                del sched.results[key]  # a record dropped and made again: it is now the newest
                sched.results[key] = Result()
            probe = rng.choice(keys)
            assert sched._earlier(probe) == _scan(sched, probe), (i, probe)
        for key in keys:
            assert sched._earlier(key) == _scan(sched, key), key


def test_a_wait_reads_only_the_saves_in_flight_not_every_record_held(node):
    """20,000 ended saves held, three in flight: the wait of a writer of a new save of a directory, the wake of a
    run's commits and the run-over check read the three, not the 20,000 (before the index: every record, each
    time, with the lock held)."""
    sched, run = node
    reads = [0]

    class Counted(Result):
        def __getattribute__(self, name):
            if name in ("writers", "state"):
                reads[0] += 1
            return super().__getattribute__(name)

    with sched.lock:
        for i in range(20_000):
            key = (RUN, i, "step_%d" % (i % 50))
            sched.results[key] = Counted()
            _ended(sched, key)
        for step in (20_000, 20_001, 20_002):  # in flight: their commits run
            sched.results[(RUN, step, "step_0")] = Counted()
            sched.commits_started.add((RUN, step, "step_0"))
        sched.notices = SimpleNamespace(forget=lambda run_id: None)
        run.connected.clear()
        reads[0] = 0
        sched._wait_for_directory(run, (RUN, 20_000, "step_0"), "a writer")  # nothing earlier in flight
        sched._wait_for_directory(run, (RUN, 20_003, "step_1"), "a writer")
        sched.wake_run(RUN)
        sched.release_if_over(run)
    assert reads[0] <= 4 * 3 * 3, f"{reads[0]} reads of the records' state"


def test_the_refused_saves_of_a_one_rank_run_are_pruned_to_a_bound(node):
    """A one-rank run whose 20,000 saves were each refused before they reached the persister (``fail_part``: the
    free-space check; the rank raised the error itself, it never asks): the persister holds at most
    ``2 * KEEP_ENDED`` of their records, the newest ``KEEP_ENDED`` among them (before: all 20,000)."""
    sched, _ = node
    one = Run(run_id=OTHER, world_size=1, local_ranks=[0], committer=True, checkpoint_dir="/nonexistent",
              keep_last=None, commit_timeout_secs=60.0, flush_on_crash=False, fsync=False, connected={0})
    for i in range(20_000):
        sched.fail_part(0, one, i, "step_%d" % i, {"type": "InsufficientDiskError", "message": "full"})
    held = [k for k in sched.results if k[0] == OTHER]
    assert KEEP_ENDED <= len(held) <= 2 * KEEP_ENDED, len(held)
    assert [k[1] for k in held[-KEEP_ENDED:]] == list(range(20_000 - KEEP_ENDED, 20_000))


def test_ended_records_are_pruned_to_a_bound(node):
    """20,000 committed saves whose ranks were told (a status reply each) or left: the run holds at most
    ``2 * KEEP_ENDED`` records, the newest ``KEEP_ENDED`` among them, and the commits-started set shrinks with
    them."""
    sched, run = node
    for i in range(20_000):
        with sched.lock:
            res = _ended(sched, (RUN, i, "step_%d" % i))
            if i < 10_000:
                res.told |= {0, 1}  # both ranks' status requests were answered
            else:
                run.connected = set()  # both ranks left (a clean end)
            sched._prune(run)  # (as the next save's commit starts)
    held = sched.results.of_run(RUN)
    assert KEEP_ENDED <= len(held) <= 2 * KEEP_ENDED, len(held)
    assert [k[1] for k in held[-KEEP_ENDED:]] == list(range(20_000 - KEEP_ENDED, 20_000))
    assert len(sched.commits_started) <= 2 * KEEP_ENDED


def _status(sched: Scheduler, rank: int, step: int, dirname: str):
    """The persister's answer to rank ``rank``'s ``status`` request of ``(step, dirname)`` (Server._op_status)."""
    owner = SimpleNamespace(scheduler=sched, slots=sched.slots)
    msg = {"step": step, "dirname": dirname, "seq": -1}  # (seq -1: the newest save of the step)
    return Server._op_status(owner, RankEntry(rank=rank, slots=[], run_id=RUN), msg)


def test_pruning_keeps_what_a_rank_can_still_ask_about(node):
    """Old ended saves that a connected rank was not yet told the end of, a save still in flight, one a rank's
    save of it again waits for, one with a call after its end, and (another node) a failed one whose abort
    notice has not come stay, however many newer ones came; each goes once that no longer holds. A status
    answer tells the rank (the record of a committed save whose ranks both asked goes)."""
    sched, run = node
    with sched.lock:
        untold = _ended(sched, (RUN, 1, "step_1"))
        untold.told.add(0)  # rank 1 has not asked yet
        failed = _ended(sched, (RUN, 2, "step_2"), state="failed")
        failed.part_errors[1] = {"type": "OSError", "message": "disk"}
        inflight = sched.results.setdefault((RUN, 3, "step_3"), Result())
        inflight.writers = 1
        sched.results.track((RUN, 3, "step_3"))
        deferred = _ended(sched, (RUN, 4, "step_4"), state="failed")
        deferred.told |= {0, 1}
        deferred.deferred.add(0)
        calls = _ended(sched, (RUN, 5, "step_5"))
        calls.told |= {0, 1}
        sched.when_over((RUN, 5, "step_5"), lambda: None)  # (a crash flush's, registered before it ended)
        _ended(sched, (RUN, 6, "step_6")).told.add(0)  # rank 1 was not told (it leaves, below)
        told = _ended(sched, (RUN, 7, "step_7"))
    assert _status(sched, 0, 7, "step_7")["state"] == "committed"
    assert _status(sched, 1, 7, "step_7")["state"] == "committed"
    assert told.told == {0, 1}
    assert _status(sched, 0, 2, "step_2")["state"] == "failed"
    assert _status(sched, 1, 2, "step_2") == {"ok": True, "state": "failed", "where": "part",
                                             "error": {"type": "OSError", "message": "disk"}}
    with sched.lock:
        for i in range(100, 100 + 3 * KEEP_ENDED):
            _ended(sched, (RUN, i, "step_%d" % i)).told |= {0, 1}
        run.connected = {0, 1}
        sched._prune(run)
        held = set(sched.results)
        assert {(RUN, s, "step_%d" % s) for s in (1, 3, 4, 5, 6)} <= held
        assert (RUN, 2, "step_2") not in held and (RUN, 7, "step_7") not in held  # both ranks told
        assert (RUN, 7, "step_7") not in sched.commits_started
    assert _status(sched, 1, 1, "step_1")["state"] == "committed"  # still answered; now told
    with sched.lock:
        run.connected = {0}  # rank 1 left: nobody asks about step 6 any more
        inflight.writers = 0
        sched._run_over_calls((RUN, 3, "step_3"), inflight)
        deferred.deferred.clear()
        sched.over_calls.clear()
        for i in range(1000, 1000 + 2 * KEEP_ENDED):
            _ended(sched, (RUN, i, "step_%d" % i)).told |= {0, 1}
        sched._prune(run)
        assert not {(RUN, s, "step_%d" % s) for s in (1, 3, 4, 5, 6)} & set(sched.results)
    # a pruned save is one never asked for: its status says so, a late notice about it is dropped
    assert _status(sched, 0, 1, "step_1") == {"ok": True, "state": "unknown"}
    sched.on_notice(RUN, 1, "step_1", 1, aborted=True)
    sched.on_notice(RUN, 1, "step_1", 1, committed=True, removed=True)
    assert sched.result((RUN, 1, "step_1")) is None and not sched._commit_over(run, (RUN, 1, "step_1"))


def test_a_watchers_failed_save_waits_for_its_abort_notice_before_it_is_pruned(node):
    """Another node than the committer's: a failed save whose committer's abort notice has not come is kept
    (the notice names the save's generation, at which a save of the step again would start anew after a prune:
    it would take that notice for its own); once it came, it goes."""
    sched, run = node
    run.committer = False
    run.world_size = 4
    with sched.lock:
        _ended(sched, (RUN, 1, "step_1"), state="failed").told |= {0, 1}
        for i in range(100, 100 + 2 * KEEP_ENDED):
            _ended(sched, (RUN, i, "step_%d" % i)).told |= {0, 1}
        sched._prune(run)
        assert (RUN, 1, "step_1") in sched.results
    sched.on_notice(RUN, 1, "step_1", 1, aborted=True)
    with sched.lock:
        for i in range(1000, 1000 + 2 * KEEP_ENDED):
            _ended(sched, (RUN, i, "step_%d" % i)).told |= {0, 1}
        sched._prune(run)
        assert (RUN, 1, "step_1") not in sched.results


def _save_of(sched: Scheduler, run: Run, key, seqs, told=(0, 1), state: str = "committed") -> Result:
    """The newest save of ``key`` (a save of it again replaces the one held, ``Scheduler._replace``), ended
    ``state``, rank ``r``'s part from its snapshot ``seqs[r]``; ``told``: the ranks whose status was answered."""
    res = sched._replace(run, key) if key in sched.results else sched.results.setdefault(key, Result())
    res.rank_seq.update(seqs)
    res.parts_done.update(seqs)
    res.state = state
    res.told.update(told)
    return res


def test_the_records_of_a_step_saved_again_are_one_list_by_generation_kept_only_while_needed(node):
    """A step saved again and again under one directory: its records are held in generation order, the newest
    last, and an earlier one stays only while something can ask about it: the one replaced last (a rank that
    reconnects), one whose connected rank 1 was not told its end (found by rank 1's ``seq``), one whose wait for
    the committer's deletion runs (found by its generation, for the ``removed`` notice). Nothing else: a
    rank's ``seq`` of a dropped save is answered with the newest, a notice about it touches nothing."""
    sched, run = node
    key = (RUN, 7, "best")
    with sched.lock:
        _save_of(sched, run, key, {0: 10, 1: 11})
        untold = _save_of(sched, run, key, {0: 20, 1: 21}, told=(0,), state="failed")
        waits = _save_of(sched, run, key, {0: 30, 1: 31}, state="failed")
        waits.awaiting_removal = True  # (another node: _await_removal_task runs)
        _save_of(sched, run, key, {0: 40, 1: 41})
        _save_of(sched, run, key, {0: 50, 1: 51})
        newest = _save_of(sched, run, key, {0: 60, 1: 61}, told=())
        assert [r.gen for r in sched.results.records(key)] == [2, 3, 5, 6]
        assert sched.results[key] is newest and list(sched.results) == [key]
    assert sched.result(key, 1, 21) is untold and sched.result(key, 0, 20) is untold
    assert sched.result(key, 0, 40) is newest and sched.result(key, 1, 11) is newest  # dropped: the newest
    assert sched.result(key, 1, 51).gen == 5 and sched.result(key, 1, -1) is newest
    sched.on_notice(*key, 3, aborted=True, removed=True)  # the committer deleted generation 3's partial directory
    assert waits.removed.is_set() and waits.aborted_at is not None
    sched.on_notice(*key, 4, aborted=True)  # a notice about a save no longer held: dropped
    assert newest.notices == 0 and newest.aborted_at is None
    reply = Server._op_status(SimpleNamespace(scheduler=sched, slots=sched.slots),
                              RankEntry(rank=1, slots=[], run_id=RUN), {"step": 7, "dirname": "best", "seq": 21})
    assert reply["state"] == "failed" and untold.told == {0, 1}
    with sched.lock:
        waits.awaiting_removal = False  # its wait ended
        _save_of(sched, run, key, {0: 70, 1: 71})
        assert [r.gen for r in sched.results.records(key)] == [6, 7]


def test_a_key_is_pruned_only_once_none_of_its_records_is_needed(node):
    """An old key whose newest save ended and was told, but an earlier record of which is still needed (a wait
    for its deletion runs; a connected rank was not told its end), outlives ``KEEP_ENDED`` newer saves; once
    nothing needs any of its records, the whole key goes, and a crash flush (``forget``) keeps only a record
    whose deletion wait runs."""
    sched, run = node
    key = (RUN, 1, "best")
    newer = iter(range(100, 100_000))

    def prune() -> None:  # as the commits of 2 * KEEP_ENDED newer saves start
        for _ in range(2 * KEEP_ENDED):
            i = next(newer)
            _ended(sched, (RUN, i, "step_%d" % i)).told |= {0, 1}
        sched._prune(run)

    with sched.lock:
        first = _save_of(sched, run, key, {0: 1, 1: 1}, told=(0,), state="failed")
        _save_of(sched, run, key, {0: 2, 1: 2})
        _save_of(sched, run, key, {0: 3, 1: 3})  # first: kept, rank 1 was not told
        prune()
        assert [r.gen for r in sched.results.records(key)] == [1, 2, 3]
        first.told.add(1)
        first.awaiting_removal = True
        prune()
        assert [r.gen for r in sched.results.records(key)] == [1, 2, 3]  # its deletion wait still runs
        sched.forget(key)  # the crash flush of step 1
        assert [r.gen for r in sched.results.records(key)] == [1, 4]
        _save_of(sched, run, key, {0: 5, 1: 5})
        first.awaiting_removal = False
        prune()
        assert key not in sched.results and sched.results.records(key) == []
