"""``load(step=N)`` by another job while the job saving there retires step N (retention renames its directory
away) after the listing and before the read. Before the listing the answer is ``CheckpointNotFoundError``
("no complete checkpoint of step N", the loadable steps named); a moment later it must be the same kind of
error, saying that the directory went away while it was read: nothing is damaged, so not
``CheckpointCorruptError`` with advice to restore or delete damaged checkpoints."""
from __future__ import annotations

import os

import pytest

from _harness import wait_until
from snapckpt import Checkpointer
from snapckpt.engine import loader as loader_mod
from snapckpt.errors import CheckpointNotFoundError
from workers.commit_crash_worker import make_state

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30)


@pytest.mark.parametrize("into", [False, True], ids=["load", "load_into_state_dict"])
def test_load_of_a_step_retired_while_it_is_read_is_not_found_not_damaged(snap_env, monkeypatch, into):
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        for step in (1, 2, 3):
            ck.save(make_state(step, 0), step).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)  # no memory tier: read from disk
    with Checkpointer(d, **OPTS) as ck:  # retired before the listing: not found
        os.rename(os.path.join(d, "step_00000001"), os.path.join(d, ".step_00000001.deleted-other"))
        with pytest.raises(CheckpointNotFoundError, match="step 1"):
            ck.load(step=1)
    real = loader_mod.parse_manifest
    retired = []

    def parse(data, dirname, *a, **kw):  # retention lands right after this load read the manifest
        m = real(data, dirname, *a, **kw)
        if dirname == "step_00000002" and not retired:
            os.rename(os.path.join(d, dirname), os.path.join(d, f".{dirname}.deleted-other"))
            retired.append(dirname)
        return m

    monkeypatch.setattr(loader_mod, "parse_manifest", parse)
    with Checkpointer(d, **OPTS) as ck:
        live = make_state(7, 0)
        with pytest.raises(CheckpointNotFoundError) as ei:
            ck.load(live, step=2) if into else ck.load(step=2)
        assert retired == ["step_00000002"]
        msg = str(ei.value)
        assert "step 2" in msg and "deleted or renamed while it was read" in msg, msg
        assert "damaged" not in msg, msg
        assert float(live["w"][0]) == float(make_state(7, 0)["w"][0])  # nothing half-loaded
