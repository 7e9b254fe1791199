"""The persister's save records: the in-flight index its waits read.

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

from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.slots import Run, SlotTable

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
