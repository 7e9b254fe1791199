"""Tensors of the dtypes ``torch.save`` writes as an ``UntypedStorage`` with ``_rebuild_tensor_v3`` (float8 for
FP8 training, uint16/32/64, complex32...): saved, then loaded from memory and from disk, bit for bit, and the
file is loaded by ``torch.load(weights_only=True)`` as well. Found by feeding odd tensors to ``save``: they failed
with ``KeyError: 'dtype torch.float8_e4m3fn is not recognized'`` from inside the skeleton pickler."""
from __future__ import annotations

import os

import torch

from _harness import wait_until
from snapckpt import Checkpointer, StorageType


def _state():
    base = torch.linspace(-3, 3, 64)
    return {
        "f8_e4m3": base.to(torch.float8_e4m3fn),
        "f8_e5m2_view": base.to(torch.float8_e5m2)[8:40].view(4, 8).t(),  # a strided view into a larger storage
        "u16": torch.tensor([0, 4097, 65535], dtype=torch.uint16),
        "u32": torch.tensor([0, 1, 2 ** 32 - 1], dtype=torch.uint32),
        "f32": base.clone(),
        "step": 7,
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def test_float8_and_unsigned_dtypes_round_trip_memory_disk_and_torch_load(snap_env):
    d = snap_env.ckpt_dir
    want = _state()
    with Checkpointer(d, persister_idle_timeout_secs=5) as ck:
        ck.save(_state(), 6, StorageType.DISK).wait()
        ck.save(want, 7, StorageType.DISK).wait()  # the second save of one layout reuses the cached plan
        from_memory = ck.load()
        assert ck.last_load.tier == StorageType.MEMORY
    # the persister exits after the clean close, but a Checkpointer that reaches it first keeps it (and step 7
    # in memory) alive: wait for it to go, so that the next load reads the disk
    assert wait_until(lambda: not snap_env.persisters(), 30), "the persister outlived the clean close"
    with Checkpointer(d, persister_idle_timeout_secs=5) as ck:
        from_disk = ck.load()
        assert ck.last_load.tier == StorageType.DISK
        into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
        ck.load(into)  # in place, into live tensors of those dtypes
        assert all(_same(into[k], v) for k, v in want.items() if isinstance(v, torch.Tensor))
    native = torch.load(os.path.join(d, "step_00000007", "rank_00000.pt"), weights_only=True)
    for got in (from_memory, from_disk, native):
        assert got["step"] == 7
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert _same(got[k], v), (k, got[k], v)
