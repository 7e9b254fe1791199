"""``snapckpt verify DIR`` while the job that owns DIR commits a step again (a save after a rewind swaps a new copy
of ``step_N`` into place) between the listing of the committed checkpoints and the check of that step's files:
the new copy's files are checked against the old copy's manifest and fail their checksums. Both copies are
intact, so calling the step DAMAGED (exit 1) is a false alarm an operator may act on (delete a good
checkpoint). Right: the step is checked as it now is (the new copy against its own manifest), reported intact,
exit 0."""
from __future__ import annotations

import json
import os
import shutil

import torch

from _harness import wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.cli import verify as verify_mod
from snapckpt.cli.main import main

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30)
RACED = "step_00000002"


def _save(d: str, gen: int, steps) -> None:
    with Checkpointer(d, **OPTS) as ck:
        for step in steps:
            ck.save({"w": torch.full((4096,), float(gen * 100 + step))}, step, StorageType.DISK).wait()


def test_cli_verify_of_a_step_committed_again_while_it_is_checked_is_no_false_damage(snap_env, tmp_path,
                                                                                    monkeypatch, capsys):
    d, other = snap_env.ckpt_dir, str(tmp_path / "other")
    _save(d, 0, [1, 2])
    _save(other, 1, [2])  # the copy the owner commits again: other values, so other checksums
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    real = verify_mod.check_checksums
    swapped = []

    def check(reader, path, *a, **kw):  # the owner's re-commit lands after the listing, before the files' check
        if os.path.basename(path) == RACED and not swapped:
            swapped.append(True)
            shutil.copytree(os.path.join(other, RACED), os.path.join(d, f".{RACED}.incoming"))
            os.rename(os.path.join(d, RACED), os.path.join(d, f".{RACED}.replaced-other"))
            os.rename(os.path.join(d, f".{RACED}.incoming"), os.path.join(d, RACED))
        return real(reader, path, *a, **kw)

    monkeypatch.setattr(verify_mod, "check_checksums", check)
    capsys.readouterr()
    code = main(["verify", d, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert swapped, "the race did not happen"
    assert (code, out["damaged"]) == (0, 0), out
    assert sorted((c["name"], c["state"]) for c in out["checkpoints"]) == [("step_00000001", "intact"),
                                                                           (RACED, "intact")], out
