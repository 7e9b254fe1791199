"""``on_slot_busy="skip"`` is collective: a DISK save that one rank skips (no free arena slot) is skipped on every
rank, at once, and the next saves pair up (contract 2). Two ranks on one node (``launch``, gloo); the multi-node
variants are in tests/test_multinode.py. The worker is tests/workers/skip_worker.py.

Before the fix the skip was one rank's alone: the other ranks' save of the step waited for its part until
``commit_timeout_secs`` and failed with ``CommitTimeoutError``; a step saved again paired the skipper's second
snapshot with the other ranks' first one (a mixed checkpoint committed), and the other ranks' second save then
waited for a part that never came.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from _harness import result_lines, run_ranks

WORKER = "skip_worker.py"
SKIPPER = 1


def run_skip(snap_env, tmp_path, scenario: str, order: str, skipper: int = SKIPPER):
    """Run the worker on two ranks with rank ``skipper``'s part of step 1 held (its only slot busy); return
    ``{rank: RESULT}`` (asserting both ranks reported)."""
    signals = tmp_path / "signals"
    signals.mkdir()
    env = {**snap_env.env, "SNAPCKPT_FAULT_POINT":
           f"persist.mid_file:rank={skipper}:step=1:action=wait:path={signals / 'release'}"}
    outs = run_ranks(WORKER, 2, [scenario, snap_env.ckpt_dir, str(signals), str(skipper), order], env,
                     timeout=240, check=False)
    res = {r["rank"]: r for r in (json.loads(x) for o in outs for x in result_lines(o))}
    assert sorted(res) == [0, 1], outs
    return res


def w_of(d: str, dirname: str, rank: int) -> float:
    """The first value of ``w`` in rank ``rank``'s file of ``dirname``."""
    return torch.load(os.path.join(d, dirname, f"rank{rank}.pt"))["w"][0].item()


def assert_skipped_by(outcome: str, skipper: int) -> None:
    """``outcome`` says the save was skipped because rank ``skipper`` had no free slot."""
    assert outcome.startswith("skipped: "), outcome
    assert f"rank {skipper}" in outcome and "slot" in outcome, outcome


def assert_nothing_left_of(d: str, dirname: str) -> None:
    names = os.listdir(d)
    assert dirname not in names and not [n for n in names if n.startswith(f".{dirname}.")], names


@pytest.mark.parametrize("order", ["first", "last"])
def test_a_step_skipped_on_one_rank_is_skipped_on_every_rank_and_the_next_step_commits(snap_env, tmp_path, order):
    """Rank 1's only slot is busy (its part of step 1 is held in the persister) when step 2 is saved: rank 1 skips
    it, before (``first``) or after (``last``) rank 0 handed its snapshot of step 2 over. Right: rank 0's save of
    step 2 ends skipped too (not failed, not at the commit timeout), its reason naming rank 1 and the slot, with a
    ``skipped`` event on each rank; nothing of step 2 is left on disk; step 1 commits once released, and step 3
    commits with both ranks' parts (``latest`` names it)."""
    d = snap_env.ckpt_dir
    res = run_skip(snap_env, tmp_path, "step", order)
    for rank in (0, 1):
        out = res[rank]["outcomes"]
        assert_skipped_by(out["2"], SKIPPER)
        assert out["1"] == "committed" and out["3"] == "committed", res
        assert len(res[rank]["skipped"]) == 1 and f"rank {SKIPPER}" in res[rank]["skipped"][0], res
        assert res[rank]["failed"] == [], res
    assert_nothing_left_of(d, "s2")
    for rank in (0, 1):
        assert w_of(d, "s1", rank) == 100 + rank and w_of(d, "s3", rank) == 300 + rank
    with open(os.path.join(d, "latest")) as f:
        assert f.read() == "s3"


@pytest.mark.parametrize("order", ["first", "last"])
def test_a_tag_saved_twice_with_one_rank_skipping_the_first_save_commits_the_second_saves(snap_env, tmp_path, order):
    """Step 7 saved twice under the tag ``best``; rank 1 skips the first save (its slot busy) but not the second.
    ``first``: rank 1 skips, then saves again, before rank 0's first save of step 7 reaches the persister at all;
    ``last``: rank 0 handed its first snapshot over before rank 1 skipped. Right: the first save ends skipped on
    both ranks; the second commits with both ranks' second snapshots (before the fix the skipper's second snapshot
    was paired with rank 0's first one, and rank 0's second save waited for a part that never came)."""
    d = snap_env.ckpt_dir
    res = run_skip(snap_env, tmp_path, "resave", order)
    for rank in (0, 1):
        out = res[rank]["outcomes"]
        assert_skipped_by(out["71"], SKIPPER)
        assert out["1"] == "committed" and out["72"] == "committed", res
        assert res[rank]["failed"] == [], res
    for rank in (0, 1):
        assert w_of(d, "best", rank) == 7200 + rank, (rank, res)
    with open(os.path.join(d, "best", ".snapckpt", "manifest.json")) as f:
        assert json.load(f)["step"] == 7
    with open(os.path.join(d, "latest")) as f:
        assert f.read() == "best"
    assert not [n for n in os.listdir(d) if ".partial-" in n], os.listdir(d)
