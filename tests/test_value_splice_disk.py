"""A training loop's saves (new scalars each save, the same tensors' layout) reach disk with each save's own values."""
import struct

import torch

from snapckpt import Checkpointer, StorageType
from snapckpt.engine import stager as stager_mod


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_disk_files_of_a_loop_hold_each_saves_values(snap_env, monkeypatch):
    calls = []
    real = stager_mod.pickle_skeleton
    monkeypatch.setattr(stager_mod, "pickle_skeleton", lambda obj, refs: calls.append(obj) or real(obj, refs))
    model = {f"w{i}": torch.rand(3) for i in range(40)}
    nan = struct.unpack("<d", bytes.fromhex("0200000000f87fff"))[0]
    losses = [0.5, -0.0, nan, 1e-310]
    with Checkpointer(snap_env.ckpt_dir, keep_last=8) as ck:
        for step, loss in enumerate(losses, start=1):
            state = {"model": model, "iteration": step * 100, "loss": loss, "tag": f"run-{step}", "done": step == 4,
                     "rng": ("MT", (step, -step), None)}
            ck.save(state, step, StorageType.DISK).wait()
        back = ck.load(step=4)
    assert len(calls) == 2  # the first save, then the template; the last two saves are spliced
    assert back["iteration"] == 400 and _bits(back["loss"]) == _bits(1e-310) and back["done"] is True
    for step, loss in enumerate(losses, start=1):
        for weights_only in (True, False):
            got = torch.load(f"{snap_env.ckpt_dir}/step_{step:08d}/rank_00000.pt", weights_only=weights_only)
            assert got["iteration"] == step * 100 and _bits(got["loss"]) == _bits(loss)
            assert got["tag"] == f"run-{step}" and got["done"] is (step == 4)
            assert got["rng"] == ("MT", (step, -step), None)
            assert all(torch.equal(got["model"][k], model[k]) for k in model)
