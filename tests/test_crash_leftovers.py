"""What a persister killed in the middle of a DISK save leaves in the checkpoint directory, when the training
process goes on (case B1/B2 from the trainer's side): the next persister of the same run removes it.

A training loop that catches the ``PersisterDiedError`` and saves on keeps its run id; the persister it
starts then serves a run it has never seen. Before the fix, that persister took the dead persister's
partial directory for one of its own saves in flight and kept it for the rest of the job (a whole step's
bytes per crash, on a long run).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from _harness import gone, wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import PersisterDiedError
from snapckpt.ondisk.manifest import check_checksums, list_committed
from snapckpt.storage.posix import PosixStorage

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30)
FS = PosixStorage()


def state(step: int) -> dict:
    return {"w": torch.full((256, 1024), float(step)), "b": torch.full((4096,), float(step)), "step": step}



def test_B2_partial_of_a_killed_persister_is_removed_when_the_run_saves_on(snap_env, monkeypatch):
    """The persister is SIGKILLed after writing step 2's file, before its part marker (a real crash in the
    write phase). The trainer gets ``PersisterDiedError``, saves on with a new persister (same run), and
    commits step 3. Right: step 2's partial directory is gone once the new persister serves the run, steps
    1 and 3 are committed and verify, and step 3 loads."""
    snap_env.leftover_ok = True  # the killed persister's arena
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", "persist.before_part_marker:step=2")
    d = snap_env.ckpt_dir
    ck = Checkpointer(d, **OPTS)
    try:
        ck.save(state(1), 1).wait()
        pid = ck.persister_pid
        ck.save(state(2), 2)
        assert wait_until(lambda: gone(pid), timeout=60), "the fault point did not kill the persister"
        assert [n for n in os.listdir(d) if ".partial-" in n], "the killed save left no partial directory"
        with pytest.raises(PersisterDiedError):
            ck.wait()
        ck.save(state(3), 3, StorageType.DISK).wait()
        assert ck.persister_pid != pid
        assert [c.step for c in list_committed(FS, d)] == [1, 3]
        for c in list_committed(FS, d):
            check_checksums(FS, c.path, c.manifest)
        assert [n for n in os.listdir(d) if n.startswith(".")] == [], sorted(os.listdir(d))
        out = ck.load()
        assert out["step"] == 3 and bool((out["w"] == 3).all())
    finally:
        ck.close()


def test_B1_tracker_temp_file_of_a_persister_killed_mid_replace_is_removed_by_a_later_commit(snap_env):
    """A persister SIGKILLed while it replaces the tracker (its temporary file ``.latest.tmp-<12 hex>`` written
    and fsynced, the rename not done: a window as long as that fsync) leaves the temporary file in the
    checkpoint directory, next to the native tracker; no later run knew it. Found by killing the persister at
    random moments of a DISK save (1 kill in 3 landed there). The file is what that kill leaves, aged past
    the bound within which a live writer renames its own. Right: the next commit of the tracker removes it;
    a fresh temporary file (a writer that may be live) is left alone."""
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save(state(1), 1).wait()
        stale, fresh = os.path.join(d, ".latest.tmp-0123456789ab"), os.path.join(d, ".latest.tmp-ba9876543210")
        for path in (stale, fresh):
            with open(path, "w") as f:
                f.write("step_00000002")
        old = time.time() - 3600
        os.utime(stale, (old, old))
        ck.save(state(2), 2).wait()
        assert not os.path.exists(stale), sorted(os.listdir(d))
        assert os.path.exists(fresh)
        with open(os.path.join(d, "latest")) as f:
            assert f.read() == "step_00000002"
        assert [c.step for c in list_committed(FS, d)] == [1, 2]
