"""A load by another job while the job that owns the checkpoint directory commits the same step again, the new copy
swapped into place on one rank AFTER it read the manifest of the copy the ranks agreed on (so the manifest check of
``test_load_resave_race.py`` passes) and BEFORE it opened its files: by ``load()`` (checksums checked on the old
files, then ``torch.load`` opening the path again), by ``load(state)`` (the file opened after the manifest), and by
the integrations' pattern ``load_with(fn, check=lambda c: c.verify())`` whose ``fn`` reads the directory by path
(a framework's own loader). Each copy is whole and passes its own checksums, so a rank that read the new files
while the others read the old ones resumes from another state, with no error. Right: every rank takes the same
copy (here the swap makes rank 1's copy another one, so the step is refused by all and the load falls back to the
previous step), and the refusal says why (committed again while it was read, not damage)."""
from __future__ import annotations

import json
import os

import pytest

from _harness import result_lines, run_ranks, wait_until

WORKER = "resave_toctou_worker.py"


@pytest.mark.parametrize("how,verify", [("plain", "1"), ("plain", "0"), ("into", "1"), ("into", "0"),
                                        ("path", "1")],
                         ids=["load", "load_no_checksums", "load_into_state_dict",
                              "load_into_state_dict_no_checksums", "load_with_check_then_read_by_path"])
def test_a_step_recommitted_between_a_ranks_manifest_read_and_its_file_reads_is_refused_by_every_rank(
        snap_env, tmp_path, how, verify):
    d, other = snap_env.ckpt_dir, str(tmp_path / "other")
    run_ranks(WORKER, 2, ["save", d, "0", "1", "2"], snap_env.env)
    run_ranks(WORKER, 2, ["save", other, "1", "2"], snap_env.env)  # the copy the owner commits again
    snap_env.kill_persisters()  # the memory tier is gone: the load reads the disk tier
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    outs = run_ranks(WORKER, 2, ["load", d, os.path.join(other, "step_00000002"), str(tmp_path / "r0_read"), how,
                                 verify], snap_env.env, timeout=180)
    res = sorted((json.loads(x) for o in outs for x in result_lines(o)), key=lambda r: r["rank"])
    assert [r["rank"] for r in res] == [0, 1], outs
    assert os.path.isdir(os.path.join(d, ".step_00000002.replaced-other")), "the race did not happen"
    assert all(r["whole"] for r in res), [r["skipped"] for r in res]
    for r in res:
        assert r["w"] == r["gen"] * 10000 + r["step"] * 100 + r["rank"], r
    # The same step and the same copy on every rank: not rank 0 on the old copy and rank 1 on the new one.
    assert len({(r["step"], r["gen"]) for r in res}) == 1, res
    # The refused copy is named, with the reason: changed while it was read, not damage (no checksum blamed).
    skipped = [r["skipped"] for r in res]
    assert res[0]["step"] == 1 and all("committed again while" in " ".join(s) for s in skipped), skipped
