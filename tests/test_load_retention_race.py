"""A load by another job racing the retention of the job that writes the checkpoint directory: the directory
of the candidate being read is renamed away (what retention does, persister/retention.py) right after its
manifest was read. Right: the load falls back to the next candidate whole (never a mix of two steps), or,
when every candidate is retired, raises naming the vanished file and saying that its directory went away
while it was read (not damage); it never returns a half-loaded state."""
from __future__ import annotations

import os

import pytest

from _harness import wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.engine import loader as loader_mod
from snapckpt.errors import SnapckptError
from workers.commit_crash_worker import consistent, make_state

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30)


def _retire_after_manifest_read(monkeypatch, d: str, dirnames) -> list:
    """Rename each of ``dirnames`` to its hidden trash name right after the loader parsed its manifest."""
    retired = []
    real = loader_mod.parse_manifest

    def parse(data, dirname, *a, **kw):
        m = real(data, dirname, *a, **kw)
        if dirname in dirnames and dirname not in retired:
            os.rename(os.path.join(d, dirname), os.path.join(d, f".{dirname}.deleted-other"))
            retired.append(dirname)
        return m

    monkeypatch.setattr(loader_mod, "parse_manifest", parse)
    return retired


@pytest.mark.parametrize("into", [False, True], ids=["load", "load_into_state_dict"])
def test_a_load_whose_newest_checkpoint_is_retired_mid_read_falls_back_whole(snap_env, monkeypatch, into):
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save(make_state(1, 0), 1).wait()
        ck.save(make_state(2, 0), 2).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)  # no memory tier: read from disk
    retired = _retire_after_manifest_read(monkeypatch, d, {"step_00000002"})
    with Checkpointer(d, **OPTS) as ck:
        if into:
            live = make_state(7, 0)
            out = ck.load(live)
        else:
            out = ck.load()
        assert retired == ["step_00000002"]
        assert out["step"] == 1 and consistent(out, 0), out["step"]
        if into:
            assert consistent(live, 0) and float(live["w"][0]) == float(make_state(1, 0)["w"][0])
        assert (ck.last_load.step, ck.last_load.tier) == (1, StorageType.DISK)
        assert len(ck.last_load.skipped) == 1 and "deleted or renamed while it was read" in ck.last_load.skipped[0]


def test_a_load_whose_every_checkpoint_is_retired_mid_read_raises_naming_the_vanished_file(snap_env, monkeypatch):
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save(make_state(1, 0), 1).wait()
        ck.save(make_state(2, 0), 2).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    _retire_after_manifest_read(monkeypatch, d, {"step_00000001", "step_00000002"})
    with Checkpointer(d, **OPTS) as ck:
        live = make_state(7, 0)
        with pytest.raises(SnapckptError, match="FileNotFoundError") as ei:
            ck.load(live)
        msg = str(ei.value)
        assert "step_00000002" in msg and "step_00000001" in msg, msg
        assert msg.count("deleted or renamed while it was read") == 2, msg  # gone, not damaged
        assert float(live["w"][0]) == float(make_state(7, 0)["w"][0])  # untouched: nothing half-loaded
