"""Smoke: one process saves to both tiers, mutates, loads back from memory and from disk."""
import os

import torch

from _harness import wait_until

from snapckpt import Checkpointer, StorageType


def test_memory_and_disk_round_trip(snap_env):
    model = torch.nn.Linear(8, 4)
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        h = ck.save({"model": model.state_dict(), "step": 1}, 1, StorageType.DISK)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        h.wait()
        assert h.done() and h.snapshot_taken
        out = ck.load()
        assert ck.last_load.step == 1 and ck.last_load.tier == StorageType.MEMORY
        for k in expected:
            assert torch.equal(out["model"][k], expected[k])
    on_disk = torch.load(f"{snap_env.ckpt_dir}/step_00000001/rank_00000.pt", weights_only=True)
    assert torch.equal(on_disk["model"]["weight"], expected["weight"])
    # contract 10: after a clean close nothing of the job is left: no persister, no arena (the fixture
    # checks both), and not even its runtime directory (socket, token, lock files, log).
    runtime = os.path.join(snap_env.runtime_root, f"snapckpt-{os.getuid()}")
    assert wait_until(lambda: not os.listdir(runtime), timeout=15), os.listdir(runtime)
