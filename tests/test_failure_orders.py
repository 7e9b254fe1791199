"""A failure is not a clean end (contract 11, cases G1 and G2, on one node).

The ranks of a job rarely die at one instant: one rank fails first (an exception, an OOM), and the others
die a moment later of the collective error. Each leaves its ``with Checkpointer(...)`` block through
``close()`` while an exception propagates. Such a close must not count as the job's clean end: the node's
persister keeps the memory snapshots (and runs the crash flush), and the restart resumes from the newest
step every rank held in memory, not from an older disk checkpoint.
"""
from __future__ import annotations

import glob
import json
import re

from _harness import finish, launch, result_lines, wait_until
from faults import committed


def test_G1_rank_fails_first_the_others_die_of_the_collective_error_resume_from_memory(snap_env):
    procs = launch("failure_order_worker.py", 2, ["crash", snap_env.ckpt_dir], snap_env.env)
    outs = finish(procs, timeout=180)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert "SAVED" in out, out
        assert p.returncode != 0, f"rank {r} should have died of the failure:\n{out}"
    assert "fails first" in outs[1]
    outs = finish(launch("failure_order_worker.py", 2, ["resume", snap_env.ckpt_dir], snap_env.env), timeout=180)
    got = [json.loads(result_lines(o)[0]) for o in outs]
    # the newest step every rank held (4, in memory), not the disk checkpoint of step 2
    assert [g["step"] for g in got] == [4, 4], outs
    assert [g["w"] for g in got] == [[4.0] * 4] * 2
    # and the crash flush wrote it to disk too, tracker last
    assert wait_until(lambda: 4 in committed(snap_env.ckpt_dir), 60), committed(snap_env.ckpt_dir)


def test_a_persister_killed_and_restarted_by_rank_1_first_still_commits(snap_env):
    """Found by a break-it trial (2 ranks, kill -9 of the persister, training goes on): the restarted persister
    took itself for a watcher when a rank other than 0 reached it first, so the next DISK save never committed
    (``CommitTimeoutError`` on every rank, in 2 of 4 runs; ``Checkpointer.wait()`` then blocked up to
    ``commit_timeout_secs``). Rank 1 now reaches it first on purpose: step 2 commits."""
    snap_env.leftover_ok = True  # the killed persister's arena files
    outs = finish(launch("failure_order_worker.py", 2, ["persister_killed", snap_env.ckpt_dir], snap_env.env),
                  timeout=180)
    assert [[json.loads(line) for line in result_lines(o)] for o in outs] == [[{"latest": 2}]] * 2, outs
    assert 2 in committed(snap_env.ckpt_dir)


def test_G1_ctrl_c_while_the_clean_close_waits_for_a_commit_keeps_the_memory_tier(snap_env, tmp_path):
    """A KeyboardInterrupt that arrives while ``close()`` waits for an outstanding commit ends the job as a
    failure: the memory snapshot of step 4 is kept (and flushed), not dropped with a goodbye. Step 2's commit
    is held before its rename until the ranks have exited (fault point ``action=wait``), so that it is still
    outstanding when the Ctrl-C comes 1 s into ``close()`` however loaded the machine is (CI under load
    reached ``close()`` after a commit slowed by a fixed sleep, 10 s, had ended, and the close was clean). The
    worker installs Python's SIGINT handler itself: a run started in the background of a non-interactive
    shell inherits SIGINT ignored, and the Ctrl-C then did nothing (the close ended when the hold did)."""
    release = tmp_path / "release-step-2"
    env = {**snap_env.env,  # (the hold alone keeps the commit outstanding: no slowed writes, 0.5 s each, before)
           "SNAPCKPT_FAULT_POINT": f"commit.before_rename:step=2:action=wait:path={release}:secs=150"}
    procs = launch("failure_order_worker.py", 2, ["interrupted_close", snap_env.ckpt_dir], env)
    try:
        outs = finish(procs, timeout=180)
    finally:
        release.touch()  # step 2's commit goes on, then the crash flush of step 4
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert "SAVED" in out and "CLOSED" not in out and "KeyboardInterrupt" in out, f"rank {r}:\n{out}"
    outs = finish(launch("failure_order_worker.py", 2, ["resume", snap_env.ckpt_dir], snap_env.env), timeout=180)
    got = [json.loads(result_lines(o)[0]) for o in outs]
    assert [g["step"] for g in got] == [4, 4], outs
    assert wait_until(lambda: {2, 4} <= set(committed(snap_env.ckpt_dir)), 60), committed(snap_env.ckpt_dir)


CRASH_AFTER_MEMORY_ONLY = """
import os, sys, torch
from snapckpt import Checkpointer, StorageType
from snapckpt.formats import MemoryOnly
ck = Checkpointer(sys.argv[1], persister_idle_timeout_secs=1)
ck.save({"w": torch.ones(4)}, 1, StorageType.DISK)
ck.wait()
for step in (2, 3):  # Megatron's memory record: a snapshot no flush can write
    ck.save_files({"rec.pt": MemoryOnly({"w": torch.full((4,), float(step))})}, step, StorageType.MEMORY,
                  dirname=f"step_{step:08d}", tracker_name=None)
print("SAVED", flush=True)
os._exit(1)
"""


def test_memory_only_snapshots_dropped_at_the_idle_exit_are_named(snap_env):
    """A crashed job's memory-only snapshots (Megatron's memory record: the crash flush cannot write them)
    live only as long as the persister, which exits ``persister_idle_timeout_secs`` after the crash when no
    rank comes back. That exit is not silent: ``persister.log`` (kept) names the run, the steps dropped
    (newer than disk, newest first) and the option to raise. Found by the fault matrix (Megatron,
    ``snapshot.before_ready`` at step 2, a restart slower than the worker's idle timeout)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", CRASH_AFTER_MEMORY_ONLY, snap_env.ckpt_dir],
                       env={**__import__("os").environ, **snap_env.env}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "SAVED" in p.stdout, (p.stdout, p.stderr)
    assert wait_until(lambda: not snap_env.persisters(), 30)
    (log,) = glob.glob(f"{snap_env.runtime_root}/**/persister.log", recursive=True)
    text = open(log).read()
    assert re.search(r"memory snapshots of steps \[3, 2\] are dropped .*persister_idle_timeout_secs \(now 1 s\)",
                     text), text
    assert sorted(committed(snap_env.ckpt_dir)) == [1]
