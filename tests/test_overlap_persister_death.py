"""The persister dies while an ``overlap=True`` snapshot is being copied (between ``save()`` and ``fence()``): the
``fence()`` that hands the slot over raises ``PersisterDiedError``, and that save's handle ends with the same error.
Before the fix the handle stayed "copying": ``wait()`` spun on the CPU for ``commit_timeout_secs`` + 30 s and then
raised ``CommitTimeoutError``, hiding the cause (found by SIGKILLing the persister during an overlapped save)."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from _harness import gone, wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import PersisterDiedError



@pytest.mark.parametrize("tier", [StorageType.DISK, StorageType.MEMORY])
def test_persister_killed_during_an_overlapped_copy_fails_fence_and_the_handle(snap_env, tier):
    snap_env.leftover_ok = True  # the killed persister's arena
    ts = [torch.full((1 << 18,), 1.0) for _ in range(8)]
    ck = Checkpointer(snap_env.ckpt_dir, overlap=True, commit_timeout_secs=5, request_timeout_secs=30,
                      persister_idle_timeout_secs=5)
    try:
        ck.save({"ts": ts, "step": 1}, 1).wait()
        for t in ts:
            t.fill_(2.0)
        h = ck.save({"ts": ts, "step": 2}, 2, tier)
        pid = ck.persister_pid
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: gone(pid), timeout=30)
        with pytest.raises(PersisterDiedError):
            ck.fence()
        assert h.done() and isinstance(h.exception(), PersisterDiedError)
        with pytest.raises(PersisterDiedError):
            h.wait()
        for t in ts:
            t.fill_(3.0)
        ck.save({"ts": ts, "step": 3}, 3).wait()  # a new persister
        ck.fence()
        out = ck.load()
        assert out["step"] == 3 and all(bool((t == 3).all()) for t in out["ts"])
    finally:
        ck.close()
