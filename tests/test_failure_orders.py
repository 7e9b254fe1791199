"""A failure is not a clean end (contract 11, cases G1 and G2, on one node).

The ranks of a job rarely die at one instant: one rank fails first (an exception, an OOM), and the others
die a moment later of the collective error. Each leaves its ``with Checkpointer(...)`` block through
``close()`` while an exception propagates. Such a close must not count as the job's clean end: the node's
persister keeps the memory snapshots (and runs the crash flush), and the restart resumes from the newest
step every rank held in memory, not from an older disk checkpoint.
"""
from __future__ import annotations

import json

from _harness import finish, launch, result_lines, wait_until
from faults import committed, slow_env


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


def test_G1_ctrl_c_while_the_clean_close_waits_for_a_commit_keeps_the_memory_tier(snap_env):
    """A KeyboardInterrupt that arrives while ``close()`` waits for an outstanding commit ends the job as a
    failure: the memory snapshot of step 4 is kept (and flushed), not dropped with a goodbye."""
    env = {**snap_env.env, **slow_env(0.5)}
    procs = launch("failure_order_worker.py", 2, ["interrupted_close", snap_env.ckpt_dir], env)
    outs = finish(procs, timeout=180)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert "SAVED" in out and "CLOSED" not in out and "KeyboardInterrupt" in out, f"rank {r}:\n{out}"
    outs = finish(launch("failure_order_worker.py", 2, ["resume", snap_env.ckpt_dir], snap_env.env), timeout=180)
    got = [json.loads(result_lines(o)[0]) for o in outs]
    assert [g["step"] for g in got] == [4, 4], outs
    assert wait_until(lambda: {2, 4} <= set(committed(snap_env.ckpt_dir)), 60), committed(snap_env.ckpt_dir)
