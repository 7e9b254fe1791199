"""The CUDA path (snapckpt/engine/device_copy.py): run only on a machine with a CUDA GPU, by
``benchmarks/gpu_check.sh`` (``pytest tests/gpu_cuda_path.py``).

The file name does not match ``test_*.py`` on purpose: the CPU suite (``scripts/test.sh``) never collects
it, so it is neither skipped nor faked there. Each test fails (it does not skip) when CUDA is missing.

Covered: snapshot isolation of CUDA state with overlap off and on (A1: the state is mutated on the compute
stream right after ``fence()``, and a temporary tensor freed right after ``save()`` has its memory reused);
the slots are page-locked and the copy runs on a side stream; disk and memory round trips give back the
saved values; a snapshot is read by stock ``torch.load`` with CUDA locations.
"""
from __future__ import annotations

import os

import pytest
import torch

from snapckpt import Checkpointer, StorageType

OPTS = dict(persister_startup_timeout_secs=60)


@pytest.fixture(autouse=True)
def _cuda():
    assert torch.cuda.is_available(), "these tests need a CUDA GPU (run them through benchmarks/gpu_check.sh)"


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _step(model, opt):
    x = torch.randn(64, 1024, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# (overlap, cuda_copy_piece_nbytes): overlap off; overlap on paced in the default pieces, in 1 MiB pieces (many
# pieces per tensor), and queued at once
COPY_MODES = pytest.mark.parametrize("overlap,piece", [(False, None), (True, None), (True, 1 << 20), (True, 0)],
                                     ids=["overlap_off", "paced", "paced_1MiB", "queued"])


def _opts(piece):
    return dict(OPTS, **({} if piece is None else {"cuda_copy_piece_nbytes": piece}))


@COPY_MODES
def test_A1_cuda_state_mutated_after_fence_checkpoint_holds_step(snap_env, overlap, piece):
    model, opt = _model()
    with Checkpointer(snap_env.ckpt_dir, overlap=overlap, **_opts(piece)) as ck:
        for step in range(1, 4):
            _step(model, opt)
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            expected = _cpu(state)
            h = ck.save(state, step, StorageType.DISK)
            _step(model, opt)  # next forward/backward on the compute stream while the copy may run
            ck.fence()
            opt.step()  # mutates every parameter and optimizer tensor in place
            opt.zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            h.wait()
            got = torch.load(os.path.join(snap_env.ckpt_dir, f"step_{step:08d}", "rank_00000.pt"),
                             weights_only=True)
            assert _equal(expected, got), f"step {step}: the checkpoint does not hold the state at save()"
            assert got["model"]["0.weight"].is_cuda  # stock torch.load restores the CUDA location
        assert ck._cuda is not None and ck._cuda._streams, "the copy did not go through the side stream"
        assert (ck._cuda._pacer is not None) == bool(overlap and piece != 0), "paced exactly when overlap is on"
        assert ck._cuda._registered, "no arena slot was page-locked (cudaHostRegister)"
        loaded = ck.load()
        assert ck.last_load.tier == StorageType.MEMORY
        assert _equal(_cpu(loaded), expected)


@COPY_MODES
def test_A3_cuda_temporary_freed_right_after_save_is_not_reused_before_the_copy(snap_env, overlap, piece):
    """``record_stream``: a tensor whose only reference is dropped right after ``save()`` keeps its memory
    until the side-stream copy has read it, although new allocations follow at once (paced: also the pieces
    the pacer has not issued yet when the caller drops it)."""
    with Checkpointer(snap_env.ckpt_dir, overlap=overlap, **_opts(piece)) as ck:
        for step in range(1, 6):
            t = torch.full((64 << 20,), float(step), device="cuda")  # 256 MiB
            h = ck.save({"t": t}, step, StorageType.MEMORY)
            del t
            junk = [torch.full((64 << 20,), -1.0, device="cuda") for _ in range(2)]
            ck.fence()
            del junk
            h.wait()
        got = ck.load()
        assert got["t"].float().min().item() == 5.0 and got["t"].float().max().item() == 5.0


def test_cuda_memory_and_disk_tiers_round_trip(snap_env):
    model, opt = _model()
    _step(model, opt)
    opt.step()
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = _cpu(state)
        ck.save(state, 1, StorageType.DISK).wait()
        ck.save(state, 2, StorageType.MEMORY).wait()
        mem = ck.load()
        assert ck.last_load.tier == StorageType.MEMORY and ck.last_load.step == 2
        assert _equal(_cpu(mem), expected)
        ck.save(state, 3, StorageType.MEMORY).wait()  # two slots per rank: step 1's slot now holds step 3
        disk = ck.load(step=1)
        assert ck.last_load.tier == StorageType.DISK, "step 1 is no longer in memory; it must come from disk"
        assert _equal(_cpu(disk), expected)
