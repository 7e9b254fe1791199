"""A step saved again under a fixed tag by two ranks, each save waited for, one rank slower (the engine no longer
waits on the training thread for an earlier save of the same directory: the persister orders them)."""
from __future__ import annotations

import json
import os

import torch

from _harness import result_lines, run_ranks

WORKER = "tag_resave_worker.py"


def test_a_slower_ranks_wait_for_its_first_save_of_a_step_is_not_answered_by_the_save_of_it_again(
        snap_env, tmp_path):
    """Rank 0's first save of step 7 (tag ``best``) committed and it handed over its second save of step 7;
    only then rank 1 waits for its first save (which committed), before it saves step 7 again. Right: rank 1's
    wait returns at once with the first save's commit, both second saves commit, ``best`` holds them. Before the
    fix rank 1's status named a snapshot absent from the newest save of the step (rank 0's second) and was
    answered with that save's ``pending``: rank 1's wait blocked on a save that needs its own next part, until
    the second save's commit timed out, and then raised that failure for a save that had committed."""
    d = snap_env.ckpt_dir
    outs = run_ranks(WORKER, 2, [d, str(tmp_path / "r0_saved2")], snap_env.env, timeout=180, check=False)
    res = sorted((json.loads(x) for o in outs for x in result_lines(o)), key=lambda r: r["rank"])
    assert [r["rank"] for r in res] == [0, 1], outs
    for r in res:
        assert r["first"] == "committed" and r["second"] == "committed", res
    for rank in (0, 1):
        w = torch.load(os.path.join(d, "best", f"rank{rank}.pt"))["w"]
        assert torch.equal(w, torch.full((1024,), float(200 + rank))), (rank, w[:2])
