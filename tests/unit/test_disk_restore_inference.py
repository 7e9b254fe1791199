"""The disk restore's reads straight into live tensors (snapckpt.engine.disk_restore) keep torch's refusal of
in-place updates to tensors made under torch.inference_mode(): such a tensor is not read into by address; and, as
an in-place copy, they bump the tensors' versions (autograd sees them written)."""
from __future__ import annotations

import os

import pytest
import torch

from snapckpt.engine.disk_restore import DIRECT_MIN_NBYTES, read_into
from snapckpt.engine.restore import copy_into

N = DIRECT_MIN_NBYTES // 4 * 2  # float32 elements: a record read straight into its live tensor


def _load(path: str, dst: dict) -> set:
    obj, filled = read_into(path, os.path.getsize(path), {}, dst, weights_only=True, verify=False)
    copy_into(dst, obj, own=True, skip=filled)  # as Checkpointer.load does
    return filled


def test_a_live_tensor_made_under_inference_mode_gets_torchs_refusal_not_a_direct_read(tmp_path):
    path = str(tmp_path / "rank_00000.pt")
    torch.save({"w": torch.full((N,), 2.0)}, path)
    with torch.inference_mode():
        live = {"w": torch.zeros(N)}
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        _load(path, live)
    with torch.inference_mode():
        assert _load(path, live) == {id(live["w"])}  # inside it: read straight into it
    assert torch.equal(live["w"], torch.full((N,), 2.0))
    normal = {"w": torch.zeros(N)}
    assert _load(path, normal) == {id(normal["w"])} and torch.equal(normal["w"], live["w"])


def test_a_direct_read_bumps_the_version_as_copy_does(tmp_path):
    """A tensor read straight from the file is written in place: its version moves as ``copy_`` moves it, so autograd
    refuses a backward through a graph that saved it before the load (it read the old values)."""
    path = str(tmp_path / "rank_00000.pt")
    torch.save({"w": torch.full((N,), 3.0)}, path)
    w = torch.zeros(N, requires_grad=True)
    live = {"w": w}
    x = torch.ones(N, requires_grad=True)
    y = (x * w).sum()  # saves w for the backward
    before = w._version
    assert _load(path, live) == {id(w)}
    assert w._version > before and torch.equal(w.detach(), torch.full((N,), 3.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
