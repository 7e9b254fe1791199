"""A load by another job (an evaluation job, a second reader) while the job that owns the checkpoint directory
commits the same step again (a save after a rewind swaps a new copy of ``step_N`` into place): every rank of the
load must take the same copy. Each copy is whole and passes its own manifest's checksums, so a rank that read
the old copy and a rank that read the new one would resume from two different states without any error.
Right: the ranks check that the manifest each read is the one rank 0 listed, and a candidate whose manifest
changed is refused by all (the load falls back, saying why)."""
from __future__ import annotations

import json
import os

import pytest

from _harness import result_lines, run_ranks, wait_until

WORKER = "resave_race_worker.py"


@pytest.mark.parametrize("how", ["plain", "into"], ids=["load", "load_into_state_dict"])
def test_a_step_recommitted_during_another_jobs_load_is_taken_whole_by_every_rank(snap_env, tmp_path, how):
    d, other = snap_env.ckpt_dir, str(tmp_path / "other")
    run_ranks(WORKER, 2, ["save", d, "0", "1", "2"], snap_env.env)
    run_ranks(WORKER, 2, ["save", other, "1", "2"], snap_env.env)  # the copy the owner commits again
    snap_env.kill_persisters()  # the memory tier is gone: the load reads the disk tier
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    outs = run_ranks(WORKER, 2, ["load", d, os.path.join(other, "step_00000002"), str(tmp_path / "r0_read"), how],
                     snap_env.env, timeout=180)
    res = sorted((json.loads(x) for o in outs for x in result_lines(o)), key=lambda r: r["rank"])
    assert [r["rank"] for r in res] == [0, 1], outs
    assert all(r["whole"] for r in res), res
    # The same step and the same copy on every rank: not rank 0 on the old copy and rank 1 on the new one.
    assert len({(r["step"], r["gen"]) for r in res}) == 1, res
    assert os.path.isdir(os.path.join(d, ".step_00000002.replaced-other")), "the race did not happen"
    for r in res:
        assert r["w"] == r["gen"] * 10000 + r["step"] * 100 + r["rank"], r
    # The refused copy is named, with the reason: changed while it was read, not damage.
    assert res[0]["step"] == 1 and all("committed again while" in " ".join(r["skipped"]) for r in res), res
