"""``snapckpt verify s3://...`` (remote-only mode, or a remote tier) while the job saving there changes a prefix
between the listing and the check of its objects: its remote retention deletes a step (manifest first, then the
data), or a save after a rewind uploads the step again (its manifest goes first, then the new objects, then the
new manifest). Both leave no damaged checkpoint, so reporting the step DAMAGED (exit 1) is a false alarm. Right,
as ``verify DIR`` does for a local directory: a retired step is skipped with a note (gone, not damaged), a step
uploaded again is checked as it now is; exit 0."""
from __future__ import annotations

import json
import os

import pytest
import torch

from _harness import wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.cli.main import main
from snapckpt.storage.remote import RemoteStore

pytestmark = pytest.mark.timeout(300)
OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=60, request_timeout_secs=60,
            coordination_timeout_secs=60)


def _save(d: str, gen: int, steps) -> None:
    with Checkpointer(d, **OPTS) as ck:
        for step in steps:
            ck.save({"w": torch.full((4096,), float(gen * 100 + step))}, step, StorageType.DISK).wait()


@pytest.mark.parametrize("what", ["retired", "resaved"])
def test_cli_verify_url_while_the_owner_retires_or_uploads_a_step_again_is_no_false_damage(
        snap_env, s3_bucket, tmp_path, monkeypatch, capsys, what):
    url, other = s3_bucket.url("run"), str(tmp_path / "other")
    _save(url, 0, [1, 2])
    _save(other, 1, [1])  # the copy of step 1 a save after a rewind uploads again: other values
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    raced = "step_00000001"
    real = RemoteStore.verify_object
    done = []

    def verify_object(self, dirname, name, rec):  # the owner's change lands after the listing
        if dirname == raced and not done:
            done.append(True)
            if what == "retired":  # what remote retention does: the manifest first, then the data
                keys = sorted(s3_bucket.keys(f"run/{raced}/"), key=lambda k: not k.endswith("manifest.json"))
                for k in keys:
                    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=k)
            else:
                m = json.load(open(os.path.join(other, raced, ".snapckpt", "manifest.json")))
                RemoteStore(url, role="remote_dir").upload(os.path.join(other, raced), raced, m, run_id=m["run_id"])
        return real(self, dirname, name, rec)

    monkeypatch.setattr(RemoteStore, "verify_object", verify_object)
    capsys.readouterr()
    code = main(["verify", url, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert done, "the race did not happen"
    assert (code, out["damaged"]) == (0, 0), [c["problems"] for c in out["checkpoints"]]
    states = sorted((c["name"], c["state"]) for c in out["checkpoints"])
    want = [("step_00000002", "intact")] + ([(raced, "intact")] if what == "resaved" else [])
    assert states == sorted(want), out
