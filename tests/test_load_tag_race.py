"""DeepSpeed's ``engine.load_checkpoint(dir, tag=T)`` through snapckpt while the job that owns the directory retires
tag ``T`` (retention) or commits it again (a save after a rewind: the old copy renamed aside, then the new one
renamed into place), the rename landing right after the loader's first look at the tag. Right: a retired tag is
``CheckpointNotFoundError`` naming it (as documented for "no such tag"), not DeepSpeed's bare ``AssertionError``
from an empty list of files; a directory snapckpt committed is never handed to DeepSpeed's own loader unchecked,
so the re-committed copy (here with a damaged byte) is refused (not found, or corrupt), never loaded."""
from __future__ import annotations

import json
import os

import pytest

from _harness import result_lines, run_ranks
from test_deepspeed import ENV

WORKER = "ds_tag_race_worker.py"


@pytest.mark.parametrize("what", ["retired", "recommitted"])
def test_a_tag_retired_or_recommitted_while_load_checkpoint_looks_at_it(snap_env, what):
    d = snap_env.ckpt_dir
    outs = run_ranks(WORKER, 1, [d, what], ENV, timeout=300)
    res = [json.loads(x) for o in outs for x in result_lines(o)]
    assert len(res) == 1, outs
    r = res[0]
    assert os.path.isdir(os.path.join(d, ".t2.deleted-other")), "the race did not happen"
    assert "returned" not in r, f"loaded {r['returned']} from a copy whose manifest was never checked"
    if what == "retired":
        assert r["raised"] == "CheckpointNotFoundError" and "t2" in r["error"], r
    else:
        assert r["raised"] in ("CheckpointNotFoundError", "CheckpointCorruptError") and "t2" in r["error"], r
