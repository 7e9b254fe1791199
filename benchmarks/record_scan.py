"""Cost of the persister's per-save scans against the number of save records it holds (issue: the records grew
forever and ``Scheduler._wait_for_directory`` read every one, once per writer and once per commit).

A :class:`~snapckpt.persister.scheduler.Scheduler` (no threads started: only its bookkeeping) is given ``N``
ended saves of one run, each under its own directory (``step_<n>``, as a job saving every few steps leaves
them), ended through the scheduler's own end hook, and one save in flight; then it times the wait check of
a writer of a new save of that directory (nothing earlier is in flight: the check returns at once), i.e.
the fixed cost every writer and every commit pays. Runs with whichever ``snapckpt`` is on ``PYTHONPATH``,
so two trees can be compared side by side::

    PYTHONPATH=/path/to/tree python benchmarks/record_scan.py --records 1000,10000,100000

Prints one JSON line per record count: ``{"records", "held", "waits", "us_per_wait", "load1"}`` (``held``:
records the scheduler still holds after the run's own pruning, which only production paths trigger; here
none is pruned, so both trees scan the same ``N`` records). Microseconds, wall clock (``perf_counter``).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.slots import Run, SlotTable

RUN = "r" * 28


def one(n: int, waits: int) -> dict:
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    run = Run(run_id=RUN, world_size=1, local_ranks=[0], committer=True, checkpoint_dir="/nonexistent",
              keep_last=None, commit_timeout_secs=60.0, flush_on_crash=False, fsync=False)
    with lock:
        for i in range(n):
            key = (RUN, i, f"step_{i:08d}")
            res = sched.results[key] = Result()
            sched.commits_started.add(key)
            res.parts_done.add(0)
            res.rank_seq[0] = i
            res.state = "committed"
            sched._run_over_calls(key, res)  # the end hook every save passes (a no-op before the index)
        key = (RUN, n, f"step_{n:08d}")
        res = sched.results[key] = Result()
        res.writers = 1
        sched.commits_started.add(key)
    t0 = time.perf_counter()
    for _ in range(waits):
        sched._wait_for_directory(run, key, "bench")
    dt = time.perf_counter() - t0
    out = {"records": n, "held": len(sched.results), "waits": waits, "us_per_wait": round(dt / waits * 1e6, 2),
           "load1": os.getloadavg()[0]}
    sched.pool.shutdown()
    sched.commit_pool.shutdown()
    sched.remove_pool.shutdown()
    sched.syncer.shutdown()
    sched.uploader.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", default="1000,10000,100000", help="comma-separated record counts")
    p.add_argument("--budget-secs", type=float, default=2.0, help="about how long to time each count")
    a = p.parse_args()
    for n in (int(x) for x in a.records.split(",")):
        probe = one(n, 5)
        waits = max(5, min(200000, int(a.budget_secs / max(probe["us_per_wait"] * 1e-6, 1e-7))))
        print(json.dumps(one(n, waits)), flush=True)


if __name__ == "__main__":
    main()
